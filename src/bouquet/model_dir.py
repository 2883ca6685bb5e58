"""Reads a local Hugging Face / sentence-transformers model directory into a `ModelSpec`.

Only JSON, file listing and a vocabulary lookup happen here, never torch, so the gateway can use it to learn prompts,
limits and labels. `st_layout.py` reads the sentence-transformers modules; this file the rest (config, tokenizer,
limits, prompts, a classifier's labels and activation, whether a causal LM is served as a reranker, and a sparse
head beside the model).

Sparse rows (a weight per vocabulary entry) come from one of two heads. A SPLADE model (a SparseEncoder: a masked
LM, then SpladePooling) gives nothing else: its task is "sparse". bge-m3 keeps FlagEmbedding's sparse head in
`sparse_linear.pt` at the root of its directory, beside the dense model: its task stays "embed" (the dense rows are
the default) and sparse rows are an extra output a request asks for. Its `colbert_linear.pt` is not read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bouquet.scoring import SCORE_ACTIVATIONS
from bouquet.st_layout import (
    DenseSpec,
    LogitScoreSpec,
    PoolingMethod,
    PoolingSpec,
    SpladeSpec,
    find_weights,
    read_json,
    read_optional_json,
    read_st_layout,
    require,
)

__all__ = [
    "DenseSpec", "ModelSpec", "PoolingMethod", "PoolingSpec", "SpladeSpec", "TokenWeightSpec", "num_labels",
    "read_model_dir",
]  # fmt: skip

# transformers' "no limit" model_max_length (int(1e30)) and anything like it.
_UNSET_MODEL_MAX_LENGTH = 10**12
TOKEN_WEIGHTS_FILE = "sparse_linear.pt"
# The special tokens FlagEmbedding leaves out of bge-m3's sparse rows, by their tokenizer_config.json keys.
_UNWEIGHTED_TOKENS = ("cls_token", "eos_token", "pad_token", "unk_token")


@dataclass(frozen=True)
class TokenWeightSpec:
    """bge-m3's sparse head (FlagEmbedding's `sparse_linear`, Linear(hidden, 1)): a token's weight is
    relu(linear(its state)); a sequence's row holds, at each token id in it, the largest weight of that id's
    tokens, and zero at the special tokens' ids."""

    weight_file: Path
    skip_token_ids: tuple[int, ...]  # cls, eos, pad, unk: never weighted


@dataclass(frozen=True)
class ModelSpec:
    """Everything about a model directory that is not a weight."""

    path: Path
    name: str
    hf_config: dict[str, Any]
    weight_files: tuple[Path, ...]
    tokenizer_file: Path
    pooling: PoolingSpec | None  # None: no sentence-transformers Pooling; the family's default applies
    normalize: bool  # rows are L2-normalised when a request does not say
    max_seq_length: int  # sentence-transformers' limit; a family with a position offset may lower it
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    dense: tuple[DenseSpec, ...] = ()
    do_lower_case: bool = False  # sentence_bert_config.json: lower-case text before tokenizing
    task: str | None = None  # "embed", "score" or "sparse" as sentence-transformers' files say; None: the model class
    score_activation: str = "Identity"  # a score model's: what sentence-transformers' CrossEncoder applies
    sparse: SpladeSpec | TokenWeightSpec | None = None  # how it gives sparse rows (vocab_size wide); None: it does not

    @property
    def architecture(self) -> str:
        return self.hf_config["architectures"][0]

    @property
    def labels(self) -> tuple[str, ...]:
        """A classifier's label names by index: config.json's `id2label`, else transformers' LABEL_i."""
        names = {int(index): str(name) for index, name in (self.hf_config.get("id2label") or {}).items()}
        return tuple(names.get(index, f"LABEL_{index}") for index in range(num_labels(self.hf_config)))

    @property
    def hidden_size(self) -> int:
        return int(self.hf_config["hidden_size"])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])

    def prompt(self, prompt_name: str | None = None) -> str:
        """The text put before each input: `prompt_name`'s prompt, else the model's default, else none."""
        name = prompt_name or self.default_prompt_name
        if name is None:
            return ""
        if name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(f"unknown prompt_name {name!r}; this model's prompts: {known}")
        return self.prompts[name]


def read_model_dir(path: str | Path, name: str | None = None) -> ModelSpec:
    """Reads a model directory; raises FileNotFoundError or ValueError naming what is wrong."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model directory not found: {root}")
    layout = read_st_layout(root)
    transformer = layout.transformer_dir
    hf_config = read_json(require(transformer / "config.json"))
    if not hf_config.get("architectures"):
        raise ValueError(f"{transformer / 'config.json'} has no 'architectures' entry")
    missing = [key for key in ("hidden_size", "vocab_size") if key not in hf_config]
    if missing:  # e.g. a remote-code config that names them its own way (n_embd)
        raise ValueError(
            f"{transformer / 'config.json'} has no {' or '.join(repr(k) for k in missing)}: bouquet reads configs "
            "in the form transformers' own model classes save"
        )
    st_config = read_optional_json(root / "config_sentence_transformers.json") or {}
    sbert_config = read_optional_json(transformer / "sentence_bert_config.json") or {}
    hf_config = _as_reranker(hf_config, layout.logit_score, transformer)
    return ModelSpec(
        path=root,
        name=name or root.name,
        hf_config=hf_config,
        weight_files=find_weights(transformer),
        tokenizer_file=require(transformer / "tokenizer.json"),
        pooling=layout.pooling,
        # Without sentence-transformers metadata nothing says; normalised rows are what servers return by default.
        normalize=True if layout.normalize is None else layout.normalize,
        max_seq_length=_read_max_seq_length(transformer, hf_config, sbert_config),
        prompts=dict(st_config.get("prompts") or {}),
        default_prompt_name=st_config.get("default_prompt_name"),
        dense=layout.dense,
        do_lower_case=bool(sbert_config.get("do_lower_case", False)),
        task=layout.task,
        score_activation=_score_activation(st_config, hf_config),
        sparse=layout.splade or _token_weights(root, transformer, layout.task),
    )


def num_labels(hf_config: dict[str, Any]) -> int:
    """A classifier's label count by transformers' rule: `num_labels`, else as many as `id2label` names, else 2
    (transformers 5 saves no `id2label` for its default two labels)."""
    if hf_config.get("num_labels") is not None:
        return int(hf_config["num_labels"])
    return len(hf_config.get("id2label") or {0: "", 1: ""})


def _as_reranker(hf_config: dict[str, Any], logit_score: LogitScoreSpec | None, folder: Path) -> dict[str, Any]:
    """A causal LM that scores by its logits (Qwen3-Reranker: "yes" less "no" at the last token) is served as
    its family's one-label sequence classifier whose weight is that row of the LM head, as vLLM does. Said by
    sentence-transformers' LogitScore module, or by vLLM's override keys written into config.json."""
    logit_score = logit_score or _vllm_logit_score(hf_config, folder)
    if logit_score is None:
        return hf_config
    architecture = hf_config["architectures"][0]
    family = architecture.removesuffix("ForCausalLM").removesuffix("ForSequenceClassification")
    if family == architecture:
        raise ValueError(f"{folder / 'config.json'}: a score read from LM logits needs a causal LM, not {architecture}")
    token_ids = [logit_score.true_token_id, logit_score.false_token_id]
    return {**hf_config, "architectures": [f"{family}ForSequenceClassification"], "num_labels": 1,
            "id2label": {"0": "LABEL_0"}, "score_token_ids": token_ids}  # fmt: skip


def _vllm_logit_score(hf_config: dict[str, Any], folder: Path) -> LogitScoreSpec | None:
    """vLLM's `classifier_from_token`: one token (its logit is the score), or two, [false, true], with
    `is_original_qwen3_reranker` (or `method: from_2_way_softmax`): logit[true] - logit[false]."""
    tokens = hf_config.get("classifier_from_token")
    if not tokens:
        return None
    two_way = bool(hf_config.get("is_original_qwen3_reranker")) or hf_config.get("method") == "from_2_way_softmax"
    if len(tokens) != (2 if two_way else 1):
        raise ValueError(
            f"{folder / 'config.json'}: classifier_from_token {tokens!r} is not supported: give one token, or two "
            "([false, true]) with is_original_qwen3_reranker"
        )
    vocabulary = Tokenizer.from_file(str(require(folder / "tokenizer.json")))
    ids = [vocabulary.token_to_id(token) for token in tokens]
    if None in ids:
        raise ValueError(f"{folder / 'config.json'}: classifier_from_token {tokens[ids.index(None)]!r} is no token")
    return LogitScoreSpec(ids[-1], ids[0] if two_way else None)


def _token_weights(root: Path, transformer: Path, task: str | None) -> TokenWeightSpec | None:
    """bge-m3's sparse head, when `sparse_linear.pt` lies at the directory's root beside an embedding model."""
    weight_file = root / TOKEN_WEIGHTS_FILE
    if not weight_file.is_file() or task not in (None, "embed"):
        return None
    return TokenWeightSpec(weight_file, _special_token_ids(transformer, _UNWEIGHTED_TOKENS))


def _special_token_ids(folder: Path, keys: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the special tokens the tokenizer's files name under `keys` (tokenizer_config.json, else
    special_tokens_map.json); a key neither names, or a token not in the vocabulary, is left out."""
    named = {**(read_optional_json(folder / "special_tokens_map.json") or {}),
             **(read_optional_json(folder / "tokenizer_config.json") or {})}  # fmt: skip
    vocabulary = Tokenizer.from_file(str(require(folder / "tokenizer.json")))
    ids = set()
    for key in keys:
        token = named.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        token_id = vocabulary.token_to_id(token) if isinstance(token, str) else None
        if token_id is not None:
            ids.add(token_id)
    return tuple(sorted(ids))


def _score_activation(st_config: dict[str, Any], hf_config: dict[str, Any]) -> str:
    """CrossEncoder's rule: its saved `activation_fn` (sentence-transformers 4+; before,
    `sbert_ce_default_activation_function` in config.json), else a sigmoid for one label and none for several."""
    path = st_config.get("activation_fn") or hf_config.get("sbert_ce_default_activation_function")
    if path is None:
        return "Sigmoid" if num_labels(hf_config) == 1 else "Identity"
    name = str(path).rsplit(".", 1)[-1]
    if name not in SCORE_ACTIVATIONS:
        raise ValueError(f"score activation {path!r} is not supported; supported: {', '.join(SCORE_ACTIVATIONS)}")
    return name


def _read_max_seq_length(transformer: Path, hf_config: dict[str, Any], sbert_config: dict[str, Any]) -> int:
    """sentence-transformers' rule: sentence_bert_config.json's `max_seq_length` (2.x-4.x) wins; else the
    tokenizer's `model_max_length` (where 5.x and 6.x save it), capped by `max_position_embeddings`.
    tokenizer.json's own truncation (128 for all-MiniLM-L6-v2) is a leftover of export and never counts."""
    positions = hf_config.get("max_position_embeddings")
    positions = int(positions) if positions and int(positions) > 0 else None
    if sbert_config.get("max_seq_length"):
        limit = int(sbert_config["max_seq_length"])
        return min(limit, positions) if positions else limit
    tokenizer_config = read_optional_json(transformer / "tokenizer_config.json") or {}
    model_max_length = tokenizer_config.get("model_max_length")
    known = [int(value) for value in (model_max_length, positions) if value and value < _UNSET_MODEL_MAX_LENGTH]
    if not known:
        raise ValueError(
            f"{transformer}: no max_seq_length (sentence_bert_config.json), model_max_length (tokenizer_config.json) "
            "or max_position_embeddings (config.json) to bound sequence length"
        )
    return min(known)
