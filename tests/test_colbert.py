"""ColBERT per-token vectors in the engine against the models' own libraries' formulas: PyLate's layout (queries
expanded with [MASK] and hidden from attention or attended to, documents without their skiplist), Stanford's
HF_ColBERT, jina-colbert-v2's (HF_ColBERT over Jina's rotary XLM-R, against transformers' JinaEmbeddingsV3Model)
and bge-m3's colbert_linear.pt (FlagEmbedding's), float32 and bfloat16, through the same layout the gateway sends
(gateway/late_interaction.py) and the replica's Info."""

from __future__ import annotations

import string
from pathlib import Path

import numpy as np
import pytest
import torch
from colbert_models import (
    DOCUMENT_LENGTH,
    JINA_DIMENSION,
    JINA_MARKERS,
    PREFIXES,
    PYLATE_PREFIXES,
    QUERY_LENGTH,
    WEIGHT_SCALE,
    XLM_R_PREFIXES,
    build_hf_colbert,
    build_jina_colbert,
    build_pylate,
    pylate_encode,
)
from corpus import documents
from safetensors.torch import load_file, save_file
from sparse_models import build_bge_m3

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.late_interaction import lay_out, pack, token_limit
from bouquet.model_dir import read_model_dir
from bouquet.replica.server import multi_vector_info
from bouquet.tokenizer import TextTokenizer

TEXTS = [*documents(6), "a", "Hello, world! (yes): it's #1.", "short query?"]
FLOAT32_COSINE = 0.99999
BFLOAT16_BOUND = 1e-2  # 1 - cosine, per token vector


def _engine(model_dir: Path, dtype: str = "float32") -> Engine:
    return Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, cpu_warmup_tokens=0))


def _projection(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
    return linear.eval()


def engine_vectors(engine: Engine, texts: list[str], is_query: bool) -> list[np.ndarray]:
    """What the gateway asks the replica for: the texts tokenized to the layout's limit, laid out, packed."""
    info = multi_vector_info(engine.spec.multi_vector, engine.max_seq_length)
    assert info is not None
    tokenizer = TextTokenizer(engine.spec.tokenizer_file, max_length=token_limit(info, is_query))
    layout = lay_out(tokenizer.encode(texts), info, is_query)
    # a step's rows are as wide as its widest kind (the sequence rows it also pools); the replica keeps a request's
    rows = engine.embed(pack(layout, RowOptions(token_vectors=True)))[:, : engine.token_dimension]
    return np.split(rows, np.cumsum([len(spans) for spans in layout.spans])[:-1])


def assert_vectors_match(ours: list[np.ndarray], theirs: list[torch.Tensor], dtype: str) -> None:
    worst = 1.0
    for mine, reference in zip(ours, theirs, strict=True):
        expected = reference.numpy()
        assert mine.shape == expected.shape
        cosines = (mine * expected).sum(1) / np.linalg.norm(mine, axis=1) / np.linalg.norm(expected, axis=1)
        np.testing.assert_allclose(np.linalg.norm(mine, axis=1), 1.0, atol=1e-5)
        worst = min(worst, float(cosines.min()))
    print(f"least cosine per token vector: {worst:.7f} ({dtype})")
    assert worst >= (FLOAT32_COSINE if dtype == "float32" else 1 - BFLOAT16_BOUND)


@pytest.fixture(scope="module")
def pylate_dirs(tmp_path_factory, minilm_path: Path) -> dict[bool, Path]:
    """By attend_to_expansion_tokens: PyLate's default (False: expansion tokens hidden from attention) and True."""
    return {
        attend: build_pylate(tmp_path_factory.mktemp(f"pylate-{attend}"), minilm_path, attend)
        for attend in (False, True)
    }


def test_pylate_directory_reads_its_settings(pylate_dirs) -> None:
    spec = read_model_dir(pylate_dirs[False])
    assert spec.task == "multi_vector" and spec.multi_vector is not None and spec.dense == ()
    layout = spec.multi_vector
    assert (layout.query_prefix, layout.document_prefix) == ((1,), (2,))  # [unused0], [unused1]
    assert (layout.query_length, layout.document_length, layout.expansion_id) == (QUERY_LENGTH, DOCUMENT_LENGTH, 103)
    assert layout.expand_queries and not layout.attend_to_expansion and layout.dimension == 24
    assert 1010 in layout.skiplist and 1012 in layout.skiplist and len(layout.skiplist) == len(string.punctuation)
    assert spec.max_seq_length == DOCUMENT_LENGTH  # not sentence_bert_config.json's, which PyLate sets per call


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("attend", [False, True])
@pytest.mark.parametrize("is_query", [True, False])
def test_pylate_vectors_match(pylate_dirs, dtype: str, attend: bool, is_query: bool) -> None:
    ours = _against_pylate(pylate_dirs[attend], dtype, is_query, attend, PREFIXES)
    if is_query:
        assert all(len(vectors) == QUERY_LENGTH for vectors in ours)  # [MASK] expansion kept as vectors


def _against_pylate(
    model_dir: Path, dtype: str, is_query: bool, attend: bool, prefixes: tuple[str, str]
) -> list[np.ndarray]:
    """The engine's token vectors of TEXTS, checked against PyLate's formula; returned."""
    projection = _projection(load_file(str(model_dir / "1_Dense" / "model.safetensors"))["linear.weight"])
    engine = _engine(model_dir, dtype)
    try:
        assert (engine.task, engine.token_dimension) == ("multi_vector", 24)
        ours = engine_vectors(engine, TEXTS, is_query)
    finally:
        engine.close()
    assert_vectors_match(ours, pylate_encode(model_dir, projection, TEXTS, is_query, attend, prefixes), dtype)
    return ours


@pytest.fixture(scope="module")
def other_encoder_dirs(tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    """PyLate checkpoints on ModernBERT (GTE-ModernColBERT's) and XLM-R, expansion tokens hidden (the default)."""
    return {
        encoder: build_pylate(tmp_path_factory.mktemp(f"pylate-{encoder}"), minilm_path, encoder=encoder)
        for encoder in ("modernbert", "xlm-roberta")
    }


# bfloat16 on documents only: the queries' case adds nothing the BERT tests above do not cover, and time.
@pytest.mark.parametrize(("dtype", "is_query"), [("float32", True), ("float32", False), ("bfloat16", False)])
@pytest.mark.parametrize("encoder", ["modernbert", "xlm-roberta"])
def test_pylate_vectors_on_other_encoders_match(other_encoder_dirs, encoder: str, is_query: bool, dtype: str) -> None:
    prefixes = XLM_R_PREFIXES if encoder == "xlm-roberta" else PREFIXES
    _against_pylate(other_encoder_dirs[encoder], dtype, is_query, False, prefixes)


@pytest.fixture(scope="module")
def added_prefixes_dir(tmp_path_factory, minilm_path: Path) -> Path:
    return build_pylate(tmp_path_factory.mktemp("pylate-added-prefixes"), minilm_path, added_prefixes=True)


@pytest.mark.parametrize("is_query", [True, False])
def test_pylate_added_prefix_tokens_match(added_prefixes_dir: Path, is_query: bool) -> None:
    """PyLate's own prefixes, "[Q] " and "[D] ", as it saves them: tokens added past the vocabulary (a space in
    each), the word embeddings resized."""
    model_dir = added_prefixes_dir
    layout = read_model_dir(model_dir).multi_vector
    assert layout is not None and (layout.query_prefix, layout.document_prefix) == ((30522,), (30523,))
    _against_pylate(model_dir, "float32", is_query, False, PYLATE_PREFIXES)


def test_hidden_expansion_tokens_change_the_query_vectors(pylate_dirs) -> None:
    """The key mask is not a no-op: attending to the expansion tokens gives other vectors for the same weights."""
    engine = _engine(pylate_dirs[False])
    try:
        hidden = engine_vectors(engine, TEXTS[-1:], True)[0]
        info = multi_vector_info(engine.spec.multi_vector, engine.max_seq_length)
        tokenizer = TextTokenizer(engine.spec.tokenizer_file, max_length=token_limit(info, True))
        layout = lay_out(tokenizer.encode(TEXTS[-1:]), info, True)
        attended = engine.embed(Batch.pack(layout.sequences, RowOptions(token_vectors=True), spans=layout.spans))
        attended = attended[:, : engine.token_dimension]
    finally:
        engine.close()
    assert layout.key_lens is not None and layout.key_lens[0] < QUERY_LENGTH
    assert np.abs(hidden - attended).max() > 1e-3


@pytest.mark.parametrize(("weights", "dtype"), [("model.safetensors", "float32"), ("model.safetensors", "bfloat16"),
                                               ("pytorch_model.bin", "float32")])  # fmt: skip
def test_hf_colbert_vectors_match(tmp_path, minilm_path: Path, weights: str, dtype: str) -> None:
    """Stanford's layout; also as colbertv2.0 was released (2022, before safetensors was transformers' default): one
    pytorch_model.bin, the projection's width from artifact.metadata's dim."""
    model_dir = build_hf_colbert(tmp_path / "colbert", minilm_path)
    state = load_file(str(model_dir / "model.safetensors"))
    if weights == "pytorch_model.bin":
        (model_dir / "model.safetensors").unlink()
        torch.save(state, model_dir / weights)
    spec = read_model_dir(model_dir)
    assert spec.task == "multi_vector" and spec.architecture == "BertModel" and spec.multi_vector is not None
    assert spec.multi_vector.source == "model" and spec.multi_vector.query_prefix == (1,)
    projection = _projection(state["linear.weight"])
    engine = _engine(model_dir, dtype)
    try:
        ours = {is_query: engine_vectors(engine, TEXTS, is_query) for is_query in (True, False)}
    finally:
        engine.close()
    for is_query in (True, False):
        assert_vectors_match(ours[is_query], pylate_encode(model_dir, projection, TEXTS, is_query), dtype)


def flag_embedding_colbert(
    model_dir: Path, colbert_linear: torch.nn.Linear, ids: list[list[int]]
) -> list[torch.Tensor]:
    """FlagEmbedding's M3 `_colbert_embedding` and `encode`: colbert_linear on every state but the first ([CLS]),
    normalised, one sequence at a time (no padding)."""
    from transformers import XLMRobertaModel

    model = XLMRobertaModel.from_pretrained(str(model_dir), add_pooling_layer=False).eval()
    with torch.no_grad():
        states = [model(torch.tensor([sequence])).last_hidden_state[0] for sequence in ids]
        return [torch.nn.functional.normalize(colbert_linear(state[1:]), dim=-1) for state in states]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bge_m3_colbert_vectors_match_flag_embedding(tmp_path, minilm_path: Path, dtype: str) -> None:
    model_dir, _ = build_bge_m3(tmp_path / "bge-m3", minilm_path)
    colbert_linear = _projection(WEIGHT_SCALE * torch.randn(64, 64, generator=torch.Generator().manual_seed(5)),
                                 0.1 * torch.randn(64, generator=torch.Generator().manual_seed(6)))  # fmt: skip
    torch.save(colbert_linear.state_dict(), model_dir / "colbert_linear.pt")
    spec = read_model_dir(model_dir)
    assert spec.task == "embed" and spec.multi_vector is not None and spec.multi_vector.skip_leading == 1
    engine = _engine(model_dir, dtype)
    try:
        assert (engine.task, engine.token_dimension) == ("embed", 64)
        ours = engine_vectors(engine, TEXTS, is_query=False)
        ids = TextTokenizer(spec.tokenizer_file, max_length=engine.max_seq_length).encode(TEXTS)
        dense = engine.embed(Batch.pack(ids))  # the dense rows are still there, unchanged
    finally:
        engine.close()
    assert dense.shape == (len(TEXTS), 64)
    assert_vectors_match(ours, flag_embedding_colbert(model_dir, colbert_linear, ids), dtype)


def test_token_vectors_survive_the_wire_slicing_and_concatenation() -> None:
    from bouquet.replica.client import embed_request
    from bouquet.replica.request import Limits, decode_request

    options = RowOptions(token_vectors=True)
    batch = Batch.pack([[101, 5, 6, 103], [101, 7, 102]], options, spans=[[(0, 1), (1, 2)], [(2, 3)]], key_lens=[3, 3])
    limits = Limits(30522, 2, 64, 384, token_dimension=24)
    decoded = decode_request(embed_request(batch), limits)
    assert decoded.token_vectors is not None and decoded.token_vectors.all()
    assert decoded.key_lens is not None and decoded.key_lens.tolist() == [3, 3]
    joined = Batch.concat([decoded.slice(1, 2), Batch.pack([[101, 9, 102]]), decoded.slice(0, 1)])
    assert joined.key_lens is not None and joined.key_lens.tolist() == [3, 3, 3]
    assert joined.token_vectors is not None and joined.token_vectors.tolist() == [True, False, True]
    bad = Batch.pack([[101, 5, 102]], options, spans=[[(0, 1)]], key_lens=[4])
    with pytest.raises(ValueError, match="key_lens"):
        decode_request(embed_request(bad), limits)
    with pytest.raises(ValueError, match="multi-vector"):
        decode_request(embed_request(batch), Limits(30522, 2, 64, 384))


@pytest.fixture(scope="module")
def jina_colbert(tmp_path_factory, minilm_path: Path) -> tuple[Path, torch.nn.Module]:
    return build_jina_colbert(tmp_path_factory.mktemp("jina-colbert-v2"), minilm_path)


def test_jina_colbert_reads_its_layout(jina_colbert) -> None:
    """HF_ColBERT over Jina's rotary XLM-R: the markers added after the vocabulary (artifact.metadata names none:
    jina-colbert-v2's card passes them to PyLate), queries attending to their expansion, its projection."""
    spec = read_model_dir(jina_colbert[0])
    assert spec.task == "multi_vector" and spec.architecture == "XLMRobertaModel" and spec.multi_vector is not None
    layout = spec.multi_vector
    assert (layout.query_prefix, layout.document_prefix, layout.source) == ((30522,), (30523,), "model")
    assert layout.attend_to_expansion and layout.expand_queries and layout.dimension == JINA_DIMENSION
    assert (layout.query_length, layout.document_length) == (QUERY_LENGTH, DOCUMENT_LENGTH)


def test_jina_colbert_metadata_may_hide_the_expansion(tmp_path, jina_colbert) -> None:
    """artifact.metadata's attend_to_mask_tokens still decides, as PyLate reads it (Jina's says true)."""
    import json
    import shutil

    model_dir = Path(shutil.copytree(jina_colbert[0], tmp_path / "hidden"))
    metadata = json.loads((model_dir / "artifact.metadata").read_text())
    (model_dir / "artifact.metadata").write_text(json.dumps({**metadata, "attend_to_mask_tokens": False}))
    layout = read_model_dir(model_dir).multi_vector
    assert layout is not None and not layout.attend_to_expansion and layout.query_prefix == (30522,)


@pytest.mark.parametrize(("dtype", "is_query"), [("float32", True), ("float32", False), ("bfloat16", True),
                                                 ("bfloat16", False)])  # fmt: skip
def test_jina_colbert_vectors_match(jina_colbert, dtype: str, is_query: bool) -> None:
    """Against transformers' JinaEmbeddingsV3Model forward and the projection, laid out as PyLate does."""
    model_dir, encoder = jina_colbert
    projection = _projection(load_file(str(model_dir / "model.safetensors"))["linear.weight"])
    engine = _engine(model_dir, dtype)
    try:
        assert (engine.task, engine.token_dimension, engine.family) == ("multi_vector", JINA_DIMENSION,
                                                                        "jina_xlm_roberta")  # fmt: skip
        ours = engine_vectors(engine, TEXTS, is_query)
    finally:
        engine.close()
    theirs = pylate_encode(model_dir, projection, TEXTS, is_query, True, JINA_MARKERS, encoder)
    assert_vectors_match(ours, theirs, dtype)
    if is_query:
        assert all(len(vectors) == QUERY_LENGTH for vectors in ours)


def test_markers_past_the_configs_vocabulary_are_served(tmp_path, jina_colbert) -> None:
    """An HF_ColBERT whose config.json keeps the vocabulary before its markers were added (its table has them)."""
    import json
    import shutil

    model_dir = Path(shutil.copytree(jina_colbert[0], tmp_path / "markers"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": 30522}))
    spec = read_model_dir(model_dir)
    assert spec.vocab_size == 30524 and spec.multi_vector is not None and spec.multi_vector.query_prefix == (30522,)
    engine = _engine(model_dir)
    try:
        ours = engine_vectors(engine, TEXTS[:3], is_query=True)
    finally:
        engine.close()
    projection = _projection(load_file(str(model_dir / "model.safetensors"))["linear.weight"])
    assert_vectors_match(ours, pylate_encode(model_dir, projection, TEXTS[:3], True, True, JINA_MARKERS,
                                             jina_colbert[1]), "float32")  # fmt: skip


def test_jina_lora_adapters_are_refused(tmp_path, jina_colbert) -> None:
    """jina-embeddings-v3's LoRA parametrizations are not served as if the base weights were the model."""
    import shutil

    model_dir = Path(shutil.copytree(jina_colbert[0], tmp_path / "lora"))
    state = load_file(str(model_dir / "model.safetensors"))
    state["roberta.encoder.layers.0.mixer.Wqkv.parametrizations.weight.0.lora_A"] = torch.zeros(4, 4, 64)
    save_file(state, str(model_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="LoRA task adapters"):
        _engine(model_dir)
