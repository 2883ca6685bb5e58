"""The sentence-transformers layout of a model directory: `modules.json` and each module's folder, read the way
sentence-transformers 2.x to 6.x reads them. No torch, so the gateway may use it too.

Modules are known by their class name whatever the module path a version wrote (`sentence_transformers.models.
Pooling`, `sentence_transformers.sentence_transformer.modules.pooling.Pooling`, ...). The pipeline bouquet runs
is Transformer, Pooling, Dense*, Normalize? (a ColBERT model saved by PyLate: Transformer, then Dense modules over
every token's state, task "multi_vector"; a CrossEncoder: a classifier's Transformer alone, or a causal LM's then
LogitScore; a SparseEncoder: a masked LM's Transformer, or MLMTransformer, then SpladePooling; a CLIP or SigLIP
model: a Transformer that gives each text's and image's embedding itself, then Dense* and Normalize?); any other
module, or these in another order, is refused at start-up with the file and the module named, because skipping one
would serve different embeddings without a word.

A CLIP model: 2.x-5.3's `CLIPModel` module (`0_CLIPModel` on the hub, no sentence_bert_config.json), or 5.4+'s
`Transformer` (or `CLIPModel`) whose config says it outputs `sentence_embedding` through `get_text_features` and
`get_image_features`; a SigLIP model: 5.4+'s alike. Either way the model pools: no Pooling module follows
(st_model_pools.py).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bouquet.st_model_pools import check_model_pools


class PoolingMethod(enum.Enum):
    """sentence-transformers' pooling modes, by the names its `pooling_mode` uses."""

    CLS = "cls"
    MAX = "max"
    MEAN = "mean"
    MEAN_SQRT_LEN = "mean_sqrt_len_tokens"
    WEIGHTED_MEAN = "weightedmean"
    LAST = "lasttoken"


# The legacy boolean flags (sentence-transformers < 5), in the order their outputs are concatenated.
_LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": PoolingMethod.CLS,
    "pooling_mode_max_tokens": PoolingMethod.MAX,
    "pooling_mode_mean_tokens": PoolingMethod.MEAN,
    "pooling_mode_mean_sqrt_len_tokens": PoolingMethod.MEAN_SQRT_LEN,
    "pooling_mode_weightedmean_tokens": PoolingMethod.WEIGHTED_MEAN,
    "pooling_mode_lasttoken": PoolingMethod.LAST,
}
_POOLING_ALIASES = {"last": PoolingMethod.LAST, "last_token": PoolingMethod.LAST}


@dataclass(frozen=True)
class PoolingSpec:
    """One or more methods whose rows are concatenated, as sentence-transformers' Pooling does."""

    methods: tuple[PoolingMethod, ...]
    include_prompt: bool = True  # False: a prompt's tokens are left out of the pooled span

    @property
    def name(self) -> str:
        return "+".join(method.value for method in self.methods)


@dataclass(frozen=True)
class DenseSpec:
    """A sentence-transformers Dense module: `activation(x @ W.T + b)` (plus `x` or a projection of it when
    `residual`), applied to each pooled row."""

    in_features: int
    out_features: int
    bias: bool
    activation: str  # torch.nn class name: Tanh, Identity, ...
    residual: bool
    weight_files: tuple[Path, ...]


@dataclass(frozen=True)
class SpladeSpec:
    """sentence-transformers' SpladePooling after a masked LM: per sequence and vocabulary entry, the max (or sum)
    over its tokens of log(1 + relu(logit)); `log1p_relu` takes log1p once more (OpenSearch's models)."""

    pooling: str  # "max" or "sum"
    activation: str  # "relu" or "log1p_relu"


SPLADE_POOLINGS = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")


@dataclass(frozen=True)
class StLayout:
    """What `modules.json` says: where the Transformer lives and what runs after it."""

    transformer_dir: Path
    pooling: PoolingSpec | None  # None: no Pooling module; the model family's default applies
    dense: tuple[DenseSpec, ...]
    normalize: bool | None  # None: no modules.json, so nothing says; True when it has a Normalize module
    task: str | None = None  # "embed", "score" (a CrossEncoder's), "sparse" (SPLADE); None: no modules.json says
    logit_score: LogitScoreSpec | None = None  # a causal LM's CrossEncoder: the tokens its score reads
    splade: SpladeSpec | None = None  # a SparseEncoder's pooling of its masked LM's logits
    token_dense: tuple[DenseSpec, ...] = ()  # PyLate's Dense modules on every token's state (ColBERT)
    model_pools: bool = False  # the Transformer gives each input's embedding itself (st_model_pools.py)
    text_padding: str | None = None  # a model that pools itself: how sentence-transformers pads its texts


@dataclass(frozen=True)
class LogitScoreSpec:
    """sentence-transformers' LogitScore after a causal LM: the last token's logit[true] - logit[false] (or
    logit[true] alone) is the score, e.g. "yes" and "no" for Qwen3-Reranker."""

    true_token_id: int
    false_token_id: int | None


# torch.nn activations a Dense module may name (layers/pooling.py computes each).
DENSE_ACTIVATIONS = ("GELU", "Identity", "ReLU", "SiLU", "Sigmoid", "Tanh")
_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# A Dropout module is the identity at inference; sentence-transformers keeps it in saved pipelines.
_IDENTITY_MODULES = ("Dropout",)


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc


def read_optional_json(path: Path) -> Any:
    return read_json(path) if path.is_file() else None


def require(path: Path) -> Path:
    if not path.is_file():
        raise FileNotFoundError(f"model file missing: {path}")
    return path


def find_weights(root: Path) -> tuple[Path, ...]:
    shards = sorted(root.glob("model-*-of-*.safetensors"))
    if shards:
        return tuple(shards)
    for file_name in _WEIGHT_FILES:
        if (root / file_name).is_file():
            return (root / file_name,)
    raise FileNotFoundError(f"model weights missing in {root}: expected one of {', '.join(_WEIGHT_FILES)}")


def read_st_layout(root: Path) -> StLayout:
    modules_file = root / "modules.json"
    modules = read_optional_json(modules_file)
    if modules is None:
        return StLayout(root, None, (), None)
    parser = _ModuleParser(root, modules_file)
    for index, module in enumerate(sorted(modules, key=lambda m: int(m.get("idx", 0)))):
        parser.add(index, module)
    return parser.layout()


def module_class(module: dict[str, Any]) -> str:
    """`Pooling` for every path a version wrote it under."""
    return str(module.get("type", "")).rsplit(".", 1)[-1]


class _ModuleParser:
    """Walks modules.json in order, accepting Transformer, Pooling, Dense*, Normalize? and refusing the rest."""

    def __init__(self, root: Path, modules_file: Path):
        self.root = root
        self.modules_file = modules_file
        self.stage = "start"
        self.transformer_dir: Path | None = None
        self.pooling: PoolingSpec | None = None
        self.dense: list[DenseSpec] = []
        self.normalize = False
        self.task = "embed"
        self.logit_score: LogitScoreSpec | None = None
        self.splade: SpladeSpec | None = None
        self.token_dense: list[DenseSpec] = []
        self.model_pools = False
        self.text_padding: str | None = None

    def add(self, index: int, module: dict[str, Any]) -> None:
        kind = module_class(module)
        folder = self.root / str(module.get("path", ""))
        expected = _NEXT_MODULES[self.stage]
        if kind in _IDENTITY_MODULES and self.stage != "start":
            return
        if self.task == "score":
            self._refuse(index, module, "nothing may follow a CrossEncoder's scores")
        if kind not in expected:
            why = f"expected {' or '.join(expected)} here" if expected else f"nothing may follow {self.stage}"
            self._refuse(index, module, why)
        self.stage = kind
        if kind in _TRANSFORMERS:
            self.transformer_dir = folder
            self.task = _transformer_task(folder, *_TRANSFORMERS[kind])
            self.stage = _TASK_STAGES.get(self.task, "Transformer")
            if self.task == _MODEL_POOLED:
                self.task, self.stage, self.model_pools = "embed", "PooledTransformer", True
                self.text_padding = _model_pools(folder)
        elif kind == "SpladePooling":
            self.splade = read_splade(require(folder / "config.json"))
            self.task = "sparse"
        elif kind == "LogitScore":
            self.logit_score = read_logit_score(require(folder / "config.json"))
            self.task = "score"
        elif kind == "Pooling":
            self.pooling = read_pooling(require(folder / "config.json"))
        elif kind == "Dense" and self.pooling is None:  # no Pooling before it: PyLate's, on token states
            self.token_dense.append(read_dense(folder))
            self.stage, self.task = "TokenDense", "multi_vector"
        elif kind == "Dense":
            self.dense.append(read_dense(folder))
        else:
            _check_normalize(folder)
            self.normalize = True

    def _refuse(self, index: int, module: dict[str, Any], why: str) -> None:
        raise ValueError(
            f"{self.modules_file}: module {index} ({module.get('type')!r}, path {module.get('path', '')!r}) is "
            f"not supported: {why}. bouquet runs Transformer, Pooling, Dense (any number) and Normalize, in that order "
            "(a CrossEncoder: Transformer alone, or with LogitScore; a SparseEncoder: a fill-mask Transformer, or "
            "MLMTransformer, then SpladePooling; a PyLate ColBERT model: Transformer, then Dense modules; a CLIP or "
            "SigLIP model: its Transformer or CLIPModel, then Dense and Normalize)"
        )

    def layout(self) -> StLayout:
        if self.transformer_dir is None:
            raise ValueError(f"{self.modules_file}: no Transformer module")
        if self.task in _TASK_STAGES:
            task = "text-generation" if self.task == "causal-lm" else "fill-mask"
            following = _NEXT_MODULES[_TASK_STAGES[self.task]][0]
            raise ValueError(f"{self.modules_file}: a {task} Transformer needs a {following} module after it")
        return StLayout(
            self.transformer_dir, self.pooling, tuple(self.dense), self.normalize, self.task, self.logit_score,
            self.splade, tuple(self.token_dense), self.model_pools, self.text_padding,
        )  # fmt: skip


# The Transformer modules by class name, with the transformer_task and output each defaults to: sentence-transformers
# 5.0-5.3 saved a SparseEncoder's masked LM as MLMTransformer, whose config may not name its task; 2.x-5.3 saved a
# CLIP model as CLIPModel, with no config at all.
_TRANSFORMERS = {
    "Transformer": ("feature-extraction", None),
    "MLMTransformer": ("fill-mask", None),
    "CLIPModel": ("feature-extraction", "sentence_embedding"),
}

# Which module may follow which: the pipeline bouquet can run.
_NEXT_MODULES = {
    "start": tuple(_TRANSFORMERS),
    "Transformer": ("Pooling", "Dense"),  # a Dense right after it projects every token (PyLate's ColBERT)
    "TokenDense": ("Dense",),
    "CausalTransformer": ("LogitScore",),  # a causal LM's logits, read by LogitScore (a CrossEncoder)
    "MaskedLMTransformer": ("SpladePooling",),  # a masked LM's logits, pooled by SpladePooling (a SparseEncoder)
    "Pooling": ("Dense", "Normalize"),
    "PooledTransformer": ("Dense", "Normalize"),  # a CLIP model's rows, pooled by the model
    "Dense": ("Dense", "Normalize"),
    "Normalize": (),
    "SpladePooling": (),
}
# A Transformer whose output only a particular module may read, and the stage that expects it.
_TASK_STAGES = {"causal-lm": "CausalTransformer", "masked-lm": "MaskedLMTransformer"}


# sentence-transformers 6 records what the Transformer computes: token states to pool, a classifier's scores, or
# an LM's logits.
_TRANSFORMER_TASKS = {
    ("feature-extraction", "token_embeddings"): "embed",
    ("sequence-classification", "scores"): "score",
    ("text-generation", "causal_logits"): "causal-lm",
    ("fill-mask", "token_embeddings"): "masked-lm",  # what SpladePooling reads as its "token_embeddings"
    ("feature-extraction", "sentence_embedding"): "pooled",  # a CLIP or SigLIP model's own rows
}
_MODEL_POOLED = "pooled"  # a model that pools itself: CLIP, SigLIP, SigLIP 2 (st_model_pools.py)


def _transformer_task(folder: Path, default_task: str, default_output: str | None) -> str:
    config_file = folder / "sentence_bert_config.json"
    config = read_optional_json(config_file) or {}
    task = config.get("transformer_task", default_task)
    output = default_output or ("scores" if task == "sequence-classification" else "token_embeddings")
    output = config.get("module_output_name", output)
    if (task, output) not in _TRANSFORMER_TASKS:
        raise ValueError(
            f"{config_file}: transformer_task {task!r} with output {output!r} is not supported; bouquet runs "
            "'feature-extraction' (token_embeddings, pooled; or a CLIP model's sentence_embedding), "
            "'sequence-classification' (scores), 'text-generation' (causal_logits, read by LogitScore) and "
            "'fill-mask' (read by SpladePooling)"
        )
    return _TRANSFORMER_TASKS[task, output]


def _model_pools(folder: Path) -> str:
    """A Transformer that pools itself, checked (st_model_pools.py); how sentence-transformers pads its texts."""
    architectures = read_json(require(folder / "config.json")).get("architectures") or []
    return check_model_pools(folder, architectures, read_optional_json(folder / "sentence_bert_config.json") or {})


def read_splade(config_file: Path) -> SpladeSpec:
    config = read_json(config_file)
    pooling = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if pooling not in SPLADE_POOLINGS or activation not in SPLADE_ACTIVATIONS:
        raise ValueError(
            f"{config_file}: SpladePooling with pooling_strategy {pooling!r} and activation_function {activation!r} "
            f"is not supported; supported: {' or '.join(SPLADE_POOLINGS)}, {' or '.join(SPLADE_ACTIVATIONS)}"
        )
    return SpladeSpec(pooling, activation)


def read_logit_score(config_file: Path) -> LogitScoreSpec:
    config = read_json(config_file)
    if config.get("module_input_name", "causal_logits") != "causal_logits":
        raise ValueError(f"{config_file}: a LogitScore over {config['module_input_name']!r} is not supported")
    false_id = config.get("false_token_id")
    return LogitScoreSpec(int(config["true_token_id"]), None if false_id is None else int(false_id))


def _check_normalize(folder: Path) -> None:
    config_file = folder / "config.json"
    _check_sentence_level(read_optional_json(config_file) or {}, config_file, "Normalize")


def _check_sentence_level(config: dict[str, Any], config_file: Path, module: str) -> None:
    """A module may also work on token states (multi-vector models); bouquet runs it on pooled rows only."""
    for key in ("module_input_name", "module_output_name"):
        if config.get(key) not in (None, "sentence_embedding"):
            raise ValueError(
                f"{config_file}: a {module} over {config[key]!r} is not supported, only over sentence_embedding"
            )


def read_pooling(config_file: Path) -> PoolingSpec:
    config = read_json(config_file)
    if "pooling_mode" in config:
        names = config["pooling_mode"]
        names = [names] if isinstance(names, str) else list(names)
        methods = tuple(_parse_pooling_name(name, config_file) for name in names)
    else:
        methods = tuple(method for flag, method in _LEGACY_POOLING_FLAGS.items() if config.get(flag))
        methods = methods or (PoolingMethod.MEAN,)  # sentence-transformers' default when no flag is set
    if not methods:
        raise ValueError(f"{config_file}: pooling_mode is empty")
    return PoolingSpec(methods, include_prompt=bool(config.get("include_prompt", True)))


def _parse_pooling_name(name: str, source: Path) -> PoolingMethod:
    if name in _POOLING_ALIASES:
        return _POOLING_ALIASES[name]
    try:
        return PoolingMethod(name)
    except ValueError:
        known = ", ".join(method.value for method in PoolingMethod)
        raise ValueError(f"{source}: unsupported pooling {name!r}; supported: {known}") from None


def read_dense(folder: Path) -> DenseSpec:
    config_file = require(folder / "config.json")
    config = read_json(config_file)
    _check_sentence_level(config, config_file, "Dense")
    return DenseSpec(
        in_features=int(config["in_features"]),
        out_features=int(config["out_features"]),
        bias=bool(config.get("bias", True)),
        activation=_activation_name(config.get("activation_function"), config_file),
        residual=bool(config.get("use_residual", False)),
        weight_files=find_weights(folder),
    )


def _activation_name(path: str | None, source: Path) -> str:
    if path is None:
        return "Tanh"  # sentence-transformers' default
    name = path.rsplit(".", 1)[-1]
    if not path.startswith("torch.") or name not in DENSE_ACTIVATIONS:
        raise ValueError(
            f"{source}: activation_function {path!r} is not supported; supported: torch.nn's "
            + ", ".join(DENSE_ACTIVATIONS)
        )
    return name
