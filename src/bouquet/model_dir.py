"""Reads a local Hugging Face / sentence-transformers model directory into a `ModelSpec`.

Only JSON, file listing and a vocabulary lookup happen here, never torch, so the gateway can use it to learn prompts,
limits and labels. `st_layout.py` reads the sentence-transformers modules; this file the rest (config, tokenizer,
limits, prompts, a classifier's labels and activation, whether a causal LM is served as a reranker, and a sparse
head beside the model).

Sparse rows (a weight per vocabulary entry) come from one of two heads. A SPLADE model (a SparseEncoder: a masked
LM, then SpladePooling) gives nothing else: its task is "sparse". bge-m3 keeps FlagEmbedding's sparse head in
`sparse_linear.pt` at the root of its directory, beside the dense model: its task stays "embed" (the dense rows are
the default) and sparse rows are an extra output a request asks for.

Per-token (ColBERT, "multi-vector") vectors come from a projection of each token's state (`MultiVectorSpec`), in
one of three layouts: PyLate's (Dense modules after the Transformer, its query and document settings in
config_sentence_transformers.json; task "multi_vector"), Stanford's `HF_ColBERT` (colbertv2.0,
answerai-colbert-small: `linear.weight` beside the encoder in one checkpoint, settings in artifact.metadata, read
as PyLate reads them; task "multi_vector"), and bge-m3's `colbert_linear.pt` beside its dense model (task "embed",
the token vectors an extra output). docs/late-interaction.md.
"""

from __future__ import annotations

import json
import string
import struct
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
    StLayout,
    find_weights,
    read_json,
    read_optional_json,
    read_st_layout,
    require,
)
from bouquet.st_messages import StMessages, read_st_messages
from bouquet.tokenizer_class import class_rules, tokenizer_file

__all__ = [
    "UNSET_MODEL_MAX_LENGTH", "DenseSpec", "ModelSpec", "MultiVectorSpec", "PoolingMethod", "PoolingSpec",
    "SpladeSpec", "TokenWeightSpec", "num_labels", "read_model_dir",
]  # fmt: skip

# transformers' "no limit" model_max_length (int(1e30)) and anything like it.
UNSET_MODEL_MAX_LENGTH = 10**12
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


COLBERT_LINEAR_FILE = "colbert_linear.pt"
_STANFORD_METADATA = "artifact.metadata"
# The encoder class inside an HF_ColBERT checkpoint, by config.json's model_type.
_HF_COLBERT_ENCODERS = {"bert": "BertModel", "xlm-roberta": "XLMRobertaModel", "roberta": "RobertaModel"}
# jina-colbert-v2 (an HF_ColBERT over Jina's rotary XLM-RoBERTa), as its model card has PyLate load it and fastembed
# runs it: its added marker tokens, and queries that attend to their <mask> expansion unless artifact.metadata says
# otherwise (its own says attend_to_mask_tokens: true).
_JINA_MARKERS = {"query_prefix": "[QueryMarker]", "document_prefix": "[DocumentMarker]"}
# PyLate's defaults where its config does not say (pylate.models.ColBERT.__init__).
_PYLATE_DEFAULTS = {"query_prefix": "[Q] ", "document_prefix": "[D] ", "query_length": 32, "document_length": 180,
                    "do_query_expansion": True, "attend_to_expansion_tokens": False}  # fmt: skip


@dataclass(frozen=True)
class MultiVectorSpec:
    """How a model gives one vector per token (ColBERT): its projection, then L2 normalisation; and how its
    queries and documents are laid out, as the model's own library tokenizes them (PyLate's `tokenize`: the prefix
    id put after the first token, a query padded with the expansion token to `query_length`, a document's
    skiplist tokens left out)."""

    projection: tuple[DenseSpec, ...]  # applied in order to each token's state
    source: str = "dense"  # the projection's tensors: "dense" (each module's own files, Dense's names), "model"
    # (`linear.*` inside the model's checkpoint: HF_ColBERT), "linear" (a bare Linear's file: bge-m3)
    query_prefix: tuple[int, ...] = ()
    document_prefix: tuple[int, ...] = ()
    query_length: int = 0  # 0: the model's limit
    document_length: int = 0
    expand_queries: bool = False
    expansion_id: int = 0
    attend_to_expansion: bool = False
    skiplist: tuple[int, ...] = ()
    skip_leading: int = 0  # leading tokens without a vector (bge-m3: its [CLS])

    @property
    def dimension(self) -> int:
        return self.projection[-1].out_features


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
    # lower-case text before tokenizing: sentence_bert_config.json says so, or transformers' tokenizer class does
    do_lower_case: bool = False
    task: str | None = None  # "embed", "score" or "sparse" as sentence-transformers' files say; None: the model class
    score_activation: str = "Identity"  # a score model's: what sentence-transformers' CrossEncoder applies
    sparse: SpladeSpec | TokenWeightSpec | None = None  # how it gives sparse rows (vocab_size wide); None: it does not
    multi_vector: MultiVectorSpec | None = None  # how it gives per-token (ColBERT) vectors; None: it does not
    st_text_padding: str | None = None  # a model that pools itself: how sentence-transformers pads its texts
    st_messages: StMessages | None = None  # images among chat messages: how sentence-transformers formats inputs

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
    hf_config = _dual_tower(read_json(require(transformer / "config.json")))
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
    task = layout.task
    multi_vector = _multi_vector(root, transformer, layout, hf_config, st_config)
    max_seq_length = _read_max_seq_length(transformer, hf_config, sbert_config)
    if multi_vector is not None and hf_config["architectures"][0] == "HF_ColBERT":
        hf_config, task = _hf_colbert_encoder(hf_config, transformer), "multi_vector"
    if multi_vector is not None and task == "multi_vector":  # PyLate sets the Transformer's limit per call
        lengths = [multi_vector.query_length, multi_vector.document_length]
        max_seq_length = _within_positions(max(lengths), hf_config)
    return ModelSpec(
        path=root,
        name=name or root.name,
        hf_config=hf_config,
        weight_files=find_weights(transformer),
        tokenizer_file=tokenizer_file(transformer),
        pooling=layout.pooling,
        # Without sentence-transformers metadata nothing says; normalised rows are what servers return by default.
        normalize=True if layout.normalize is None else layout.normalize,
        max_seq_length=max_seq_length,
        prompts=dict(st_config.get("prompts") or {}),
        default_prompt_name=st_config.get("default_prompt_name"),
        dense=layout.dense,
        do_lower_case=bool(sbert_config.get("do_lower_case", False)) or class_rules(transformer).lowercase,
        task=task,
        score_activation=_score_activation(st_config, hf_config),
        sparse=layout.splade or _token_weights(root, transformer, layout.task),
        multi_vector=multi_vector,
        st_text_padding=layout.text_padding,
        st_messages=read_st_messages(transformer),
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


def _multi_vector(
    root: Path, transformer: Path, layout: StLayout, hf_config: dict[str, Any], st_config: dict[str, Any]
) -> MultiVectorSpec | None:
    """The model's per-token projection and layout, in whichever of the three layouts it has; None: none."""
    if layout.token_dense:
        return _pylate(transformer, layout.token_dense, st_config)
    if hf_config["architectures"][0] == "HF_ColBERT":
        return _hf_colbert(transformer, hf_config)
    colbert_linear = root / COLBERT_LINEAR_FILE
    if colbert_linear.is_file() and layout.task in (None, "embed"):
        hidden = int(hf_config["hidden_size"])  # FlagEmbedding's colbert_dim -1: the hidden width
        projection = DenseSpec(hidden, hidden, True, "Identity", False, (colbert_linear,))
        return MultiVectorSpec((projection,), source="linear", skip_leading=1)
    return None


def _pylate(transformer: Path, token_dense: tuple[DenseSpec, ...], st_config: dict[str, Any]) -> MultiVectorSpec:
    """PyLate's settings (config_sentence_transformers.json), its defaults where a key is missing."""
    config = {**_PYLATE_DEFAULTS, **{k: v for k, v in st_config.items() if v is not None}}
    return _colbert_layout(transformer, token_dense, "dense", config)


def _hf_colbert(transformer: Path, hf_config: dict[str, Any]) -> MultiVectorSpec:
    """Stanford's layout read as PyLate reads it: artifact.metadata's query_maxlen, doc_maxlen,
    attend_to_mask_tokens and marker tokens ([unused0], [unused1] by default), the projection `linear.weight`."""
    metadata = read_optional_json(transformer / _STANFORD_METADATA) or {}
    weight_file = find_weights(transformer)[0]
    hidden = int(hf_config["hidden_size"])
    dimension = int(metadata.get("dim") or _safetensors_shape(weight_file, "linear.weight")[0])
    config = {**_PYLATE_DEFAULTS, "query_prefix": metadata.get("query_token_id", "[unused0]"),
              "document_prefix": metadata.get("doc_token_id", "[unused1]")}  # fmt: skip
    if hf_config.get("position_embedding_type") == "rotary":  # jina-colbert-v2: its card's PyLate settings
        config.update(_JINA_MARKERS, attend_to_expansion_tokens=True)
    for ours, theirs in (("query_length", "query_maxlen"), ("document_length", "doc_maxlen"),
                         ("attend_to_expansion_tokens", "attend_to_mask_tokens")):  # fmt: skip
        if metadata.get(theirs) is not None:
            config[ours] = metadata[theirs]
    projection = DenseSpec(hidden, dimension, False, "Identity", False, (weight_file,))
    return _colbert_layout(transformer, (projection,), "model", config)


def _colbert_layout(
    transformer: Path, projection: tuple[DenseSpec, ...], source: str, config: dict[str, Any]
) -> MultiVectorSpec:
    vocabulary = Tokenizer.from_file(str(require(transformer / "tokenizer.json")))
    expansion = _special_token_ids(transformer, ("mask_token",)) or _special_token_ids(transformer, ("eos_token",))
    expand = bool(config["do_query_expansion"])
    if expand and not expansion:
        raise ValueError(f"{transformer}: query expansion needs a mask (or EOS) token, and the tokenizer names none")
    words = config.get("skiplist_words") or list(string.punctuation)
    # transformers' convert_tokens_to_ids gives the unknown token's id for a word not in the vocabulary, and
    # PyLate puts whatever it gives in the skiplist.
    found = [vocabulary.token_to_id(word) for word in words]
    skiplist = {token for token in found if token is not None}
    if None in found:
        skiplist |= set(_special_token_ids(transformer, ("unk_token",)))
    return MultiVectorSpec(
        projection, source,
        query_prefix=_prefix_ids(vocabulary, config["query_prefix"], transformer),
        document_prefix=_prefix_ids(vocabulary, config["document_prefix"], transformer),
        query_length=int(config["query_length"]), document_length=int(config["document_length"]),
        expand_queries=expand, expansion_id=expansion[0] if expansion else 0,
        attend_to_expansion=expand and bool(config["attend_to_expansion_tokens"]),
        skiplist=tuple(sorted(skiplist)),
    )  # fmt: skip


def _prefix_ids(vocabulary: Tokenizer, prefix: str, folder: Path) -> tuple[int, ...]:
    """A prefix's one token id (PyLate adds "[Q] " and "[D] " to the vocabulary when it saves); "" has none."""
    if not prefix:
        return ()
    token_id = vocabulary.token_to_id(prefix)
    if token_id is None:
        raise ValueError(
            f"{folder / 'tokenizer.json'}: the prefix {prefix!r} is no token (PyLate adds it when it saves)"
        )
    return (token_id,)


def _hf_colbert_encoder(hf_config: dict[str, Any], folder: Path) -> dict[str, Any]:
    """HF_ColBERT's config names its wrapper; the encoder inside is its model_type's. Its vocabulary is the
    checkpoint's word-embedding table where that is larger than config.json says: the marker tokens added when it
    was trained ([QueryMarker], [DocumentMarker]) may lie past the config's vocab_size."""
    model_type = hf_config.get("model_type", "bert")
    if model_type not in _HF_COLBERT_ENCODERS:
        known = ", ".join(_HF_COLBERT_ENCODERS)
        raise ValueError(
            f"{folder / 'config.json'}: an HF_ColBERT over {model_type!r} is not supported; supported: {known}"
        )
    rows = _word_embedding_rows(find_weights(folder)[0])
    vocab_size = max(int(hf_config["vocab_size"]), rows)
    return {**hf_config, "architectures": [_HF_COLBERT_ENCODERS[model_type]], "vocab_size": vocab_size}


def _word_embedding_rows(path: Path) -> int:
    """The word-embedding table's rows, from a safetensors file's header; 0 where it cannot be read so."""
    if path.suffix != ".safetensors":
        return 0
    with path.open("rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(size))
    shapes = [entry["shape"] for name, entry in header.items() if name.endswith("embeddings.word_embeddings.weight")]
    return int(shapes[0][0]) if shapes else 0


def _dual_tower(hf_config: dict[str, Any]) -> dict[str, Any]:
    """A text-and-image model's config (CLIP's) nests one per tower: what the engine reads at the top (vocabulary,
    positions) is the text tower's, and `hidden_size` is the width of the rows both towers give, the shared space's.
    """
    text = hf_config.get("text_config")
    if not isinstance(text, dict) or "hidden_size" in hf_config:
        return hf_config
    width = hf_config.get("projection_dim") or text.get("projection_size") or text.get("hidden_size")
    tower = {key: text[key] for key in ("vocab_size", "max_position_embeddings") if key in text}
    return {**hf_config, **tower, "hidden_size": width}


def _safetensors_shape(path: Path, name: str) -> list[int]:
    """A tensor's shape from a safetensors file's JSON header, without torch."""
    if path.suffix != ".safetensors":
        raise ValueError(f"{path}: the projection's width is read from a safetensors file, or artifact.metadata's dim")
    with path.open("rb") as file:
        (size,) = struct.unpack("<Q", file.read(8))
        header = json.loads(file.read(size))
    if name not in header:
        raise ValueError(f"{path}: no {name} (an HF_ColBERT checkpoint holds its projection there)")
    return list(header[name]["shape"])


def _within_positions(length: int, hf_config: dict[str, Any]) -> int:
    positions = hf_config.get("max_position_embeddings")
    return min(length, int(positions)) if positions and int(positions) > 0 else length


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
    known = [int(value) for value in (model_max_length, positions) if value and value < UNSET_MODEL_MAX_LENGTH]
    if not known:
        raise ValueError(
            f"{transformer}: no max_seq_length (sentence_bert_config.json), model_max_length (tokenizer_config.json) "
            "or max_position_embeddings (config.json) to bound sequence length"
        )
    return min(known)
