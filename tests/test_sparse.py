"""Sparse rows against their references, on tiny random-weight models (tests/sparse_models.py): SPLADE against
sentence-transformers' SparseEncoder.encode (BERT's and XLM-RoBERTa's masked LMs; max and sum pooling; relu and
log1p_relu; the 5.x MLMTransformer module and today's fill-mask Transformer), and bge-m3's token weights against
FlagEmbedding's formula on transformers' forward. Every batch packs sequences of several lengths, more tokens than
one SPLADE block, and runs again with blocks of 7 tokens so blocks end inside sequences. Also: the embedding of a
model with a sparse head is unchanged beside sparse rows, refusals, and `sparsify`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from corpus import documents
from sparse_models import LIMIT, build_bge_m3, build_splade

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.layers.sparse import SPARSE_BLOCK_ELEMENTS
from bouquet.model_dir import SpladeSpec, TokenWeightSpec, read_model_dir
from bouquet.sparse_rows import densify, sparsify

TEXTS = [*documents(14), "a", "🙂 café"]  # the emoji: the tokenizer's [UNK]
FLOAT32_BOUND = 1e-4  # on every value: absolute up to 1, relative above (sum pooling's values reach about 100)
# bfloat16: each row's distance from the float32 reference relative to its length. The random weights are wide, so
# the bfloat16 encoder's token states move the logits (the head in float32 changes nothing); transformers' own
# bfloat16 forward of the same models is as far off or further (printed beside bouquet's with -rP).
BFLOAT16_BOUND = 6e-2
SPLADE_CASES = {
    "bert max relu (MLMTransformer)": ("bert", "MLMTransformer", "max", "relu"),
    "bert sum log1p_relu (fill-mask Transformer)": ("bert", "Transformer", "sum", "log1p_relu"),
    "xlm-roberta max relu (fill-mask Transformer)": ("xlm-roberta", "Transformer", "max", "relu"),
}
SMALL_BLOCK = 7


def _engine(model_dir: Path, dtype: str = "float32") -> Engine:
    return Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype, cpu_warmup_tokens=0))


@pytest.fixture(scope="module", params=list(SPLADE_CASES))
def splade(request, tmp_path_factory, minilm_path: Path) -> tuple[Path, list[list[int]], dict[str, np.ndarray]]:
    """The SparseEncoder's directory, the texts' token ids as it tokenizes them, and its rows in each dtype."""
    from sentence_transformers import SparseEncoder

    model_dir = build_splade(tmp_path_factory.mktemp("splade"), minilm_path, *SPLADE_CASES[request.param])
    reference = SparseEncoder(str(model_dir), device="cpu")
    features = {key: reference.tokenize(TEXTS)[key] for key in ("input_ids", "attention_mask")}
    ids = [row[mask.bool()].tolist() for row, mask in zip(*features.values(), strict=True)]
    expected = {"float32": reference.encode(TEXTS, convert_to_tensor=True).to_dense().numpy()}
    reference = SparseEncoder(str(model_dir), device="cpu", model_kwargs={"dtype": torch.bfloat16})
    expected["bfloat16"] = reference.encode(TEXTS, convert_to_tensor=True).to_dense().float().numpy()
    return model_dir, ids, expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_splade_rows_match_sparse_encoder(splade, dtype: str) -> None:
    model_dir, ids, references = splade
    expected = references["float32"]
    engine = _engine(model_dir, dtype)
    try:
        assert (engine.task, engine.dimension, engine.sparse_dimension) == ("sparse", 30522, 30522)
        head = engine.pooler.sparse_head
        assert sum(map(len, ids)) > head.block_tokens == SPARSE_BLOCK_ELEMENTS // 30522  # blocks end mid-batch
        rows = engine.embed(Batch.pack(ids))  # every row sparse, though the batch does not ask
        head.block_tokens = SMALL_BLOCK
        small_blocks = engine.embed(Batch.pack(ids, RowOptions(sparse=True)))
    finally:
        engine.close()
    assert_sparse_rows_match(rows, expected, dtype)
    # float32: the head's blocks of SMALL_BLOCK rows run on the short-step kernel (layers/f32_short.py), the larger
    # ones on oneDNN: their sums round apart (up to 1.5e-5 after the log1p and the max over a text's tokens)
    float32 = dtype == "float32"
    np.testing.assert_allclose(small_blocks, rows, atol=5e-5 if float32 else 2e-2, rtol=1e-5 if float32 else 0)
    if dtype == "bfloat16":
        print(f"transformers' own: {_relative_distances(references['bfloat16'], expected).max():.2e}")


def assert_sparse_rows_match(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    assert rows.shape == expected.shape and rows.dtype == np.float32
    active = (expected > 0).sum(1)
    assert (active > 10).all() and (active < 0.5 * expected.shape[1]).all()  # sparse, and not empty
    if dtype == "float32":
        difference = np.abs(rows - expected) / np.maximum(1.0, expected)
        print(f"max difference {difference.max():.2e}, of values up to {expected.max():.2f}")  # shown with -rP
        assert difference.max() <= FLOAT32_BOUND
        # The same nonzero entries, but for values too small to tell apart.
        assert np.maximum(rows, expected)[(rows > 0) != (expected > 0)].max(initial=0.0) <= FLOAT32_BOUND
        return
    relative = _relative_distances(rows, expected)
    print(f"max relative distance {relative.max():.2e}")  # shown with -rP
    assert relative.max() <= BFLOAT16_BOUND


def _relative_distances(rows: np.ndarray, expected: np.ndarray) -> np.ndarray:  # [R]
    return np.linalg.norm(rows - expected, axis=1) / np.linalg.norm(expected, axis=1)


def test_an_mlm_checkpoint_saved_for_embeddings_still_embeds(tmp_path, minilm_path: Path) -> None:
    """A masked LM under Transformer and Pooling is an encoder: its head is dropped, its rows are embeddings."""
    from family_models import save_sentence_transformer
    from sentence_transformers import SentenceTransformer

    build_splade(tmp_path, minilm_path)
    model_dir = save_sentence_transformer(tmp_path / "embed", tmp_path / "hf", "mean", max_seq_length=LIMIT)
    engine = _engine(model_dir)
    try:
        assert (engine.task, engine.sparse_dimension) == ("embed", 0)
        rows = engine.embed(Batch.pack(_tokenize(model_dir, TEXTS)))
    finally:
        engine.close()
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(rows, expected, atol=1e-5)


@pytest.fixture(scope="module")
def bge_m3(tmp_path_factory, minilm_path: Path) -> tuple[Path, torch.nn.Linear]:
    return build_bge_m3(tmp_path_factory.mktemp("bge-m3"), minilm_path)


def _tokenize(model_dir: Path, texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))(texts, truncation=True, max_length=LIMIT)["input_ids"]


def flag_embedding_rows(model_dir: Path, sparse_linear: torch.nn.Linear, ids: list[list[int]]) -> np.ndarray:
    """FlagEmbedding's M3 lexical weights as vocabulary-wide rows: relu(sparse_linear(last_hidden_state)) per
    token, the largest positive weight per token id, the cls, eos, pad and unk ids left out
    (`_process_token_weights`), on transformers' forward of one sequence at a time."""
    from transformers import AutoTokenizer, XLMRobertaModel

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    unused = {tokenizer.cls_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    model = XLMRobertaModel.from_pretrained(str(model_dir), add_pooling_layer=False).eval()
    rows = np.zeros((len(ids), model.config.vocab_size), np.float32)
    with torch.no_grad():
        for row, sequence in zip(rows, ids, strict=True):
            hidden = model(torch.tensor([sequence])).last_hidden_state[0]
            for weight, token_id in zip(torch.relu(sparse_linear(hidden)).squeeze(-1).tolist(), sequence, strict=True):
                if token_id not in unused and weight > row[token_id]:
                    row[token_id] = weight
    return rows


def test_bge_m3_directory_declares_its_sparse_head(bge_m3) -> None:
    model_dir, _ = bge_m3
    spec = read_model_dir(model_dir)
    assert spec.task == "embed" and isinstance(spec.sparse, TokenWeightSpec)
    assert spec.sparse.weight_file == model_dir / "sparse_linear.pt"
    assert spec.sparse.skip_token_ids == (0, 100, 101, 102)  # [PAD], [UNK], [CLS], and [SEP] as the eos token
    assert isinstance(read_model_dir(model_dir.parent / "hf").sparse, type(None))  # no sparse_linear.pt there


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bge_m3_sparse_rows_match_flag_embedding(bge_m3, dtype: str) -> None:
    model_dir, sparse_linear = bge_m3
    ids = _tokenize(model_dir, TEXTS)
    assert any(100 in sequence for sequence in ids)  # the unknown token, left out of the rows
    engine = _engine(model_dir, dtype)
    try:
        assert (engine.task, engine.dimension, engine.sparse_dimension) == ("embed", 64, 30522)
        rows = engine.embed(Batch.pack(ids, RowOptions(sparse=True)))
    finally:
        engine.close()
    expected = flag_embedding_rows(model_dir, sparse_linear, ids)
    assert ((rows > 0).sum(1) == (expected > 0).sum(1)).all() or dtype == "bfloat16"
    assert_token_weights_match(rows, expected, dtype)


def assert_token_weights_match(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    assert rows.shape == expected.shape and (rows[:, [0, 100, 101, 102]] == 0).all()
    scale = np.abs(expected).max(axis=1, keepdims=True)
    difference = np.abs(rows - expected) / (1.0 if dtype == "float32" else scale)
    print(f"max difference {difference.max():.2e} ({'absolute' if dtype == 'float32' else 'of the row max'})")
    assert difference.max() <= (FLOAT32_BOUND if dtype == "float32" else BFLOAT16_BOUND)


def test_embeddings_beside_sparse_rows_are_unchanged(bge_m3) -> None:
    """Sequences asking for sparse rows interleaved with ones asking for embeddings in one step: each row is what
    a batch of its own kind gives (the embedding zero-padded to the sparse width), and the embeddings are
    sentence-transformers' (bge-m3's dense output, normalised)."""
    from sentence_transformers import SentenceTransformer

    model_dir, _ = bge_m3
    ids = _tokenize(model_dir, TEXTS)
    wants_sparse = np.arange(len(ids)) % 3 == 1
    mixed = Batch.concat([Batch.pack([seq], RowOptions(sparse=bool(wants_sparse[i]))) for i, seq in enumerate(ids)])
    engine = _engine(model_dir)
    try:
        dense, sparse = engine.embed(Batch.pack(ids)), engine.embed(Batch.pack(ids, RowOptions(sparse=True)))
        rows = engine.embed(mixed)
    finally:
        engine.close()
    np.testing.assert_allclose(dense, SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS), atol=1e-5)
    assert rows.shape == (len(ids), 30522)
    np.testing.assert_allclose(rows[wants_sparse], sparse[wants_sparse], atol=1e-6)
    np.testing.assert_allclose(rows[~wants_sparse, :64], dense[~wants_sparse], atol=1e-6)
    assert not rows[~wants_sparse, 64:].any()


def test_sparse_rows_are_refused_without_a_sparse_head(minilm_fp32: Engine) -> None:
    assert minilm_fp32.sparse_dimension == 0
    with pytest.raises(ValueError, match="this model gives no sparse rows"):
        minilm_fp32.embed(Batch.pack([[101, 2023, 102]], RowOptions(sparse=True)))


def test_a_sparse_sequence_with_spans_is_refused(bge_m3) -> None:
    batch = Batch.pack([[101, 2023, 2003, 102]], RowOptions(sparse=True), spans=[[(1, 3)]])
    engine = _engine(bge_m3[0])
    try:
        with pytest.raises(ValueError, match="both a sparse row and pooling spans"):
            engine.embed(batch)
    finally:
        engine.close()


def test_splade_layouts_it_cannot_run_are_refused(tmp_path, minilm_path: Path) -> None:
    model_dir = build_splade(tmp_path / "built", minilm_path)
    assert read_model_dir(model_dir).sparse == SpladeSpec("max", "relu")
    modules_file = model_dir / "modules.json"
    modules = json.loads(modules_file.read_text())
    for edit, message in [
        (lambda m: m[:1], r"a fill-mask Transformer needs a SpladePooling module after it"),
        (lambda m: [m[0], {**m[1], "type": "sentence_transformers.models.Pooling"}], r"expected SpladePooling"),
        (
            lambda m: [*m, {"idx": 2, "path": "", "type": "sentence_transformers.models.Normalize"}],
            r"module 2 .*Normalize.*nothing may follow SpladePooling",
        ),
    ]:
        modules_file.write_text(json.dumps(edit(modules)))
        with pytest.raises(ValueError, match=message):
            read_model_dir(model_dir)
    modules_file.write_text(json.dumps(modules))
    (model_dir / "1_SpladePooling" / "config.json").write_text(json.dumps({"pooling_strategy": "mean"}))
    with pytest.raises(ValueError, match=r"SpladePooling with pooling_strategy 'mean'"):
        read_model_dir(model_dir)


def test_splade_on_an_encoder_without_a_head_is_refused(tmp_path, minilm_path: Path) -> None:
    model_dir = build_splade(tmp_path / "built", minilm_path)
    config_file = model_dir / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "architectures": ["BertModel"]}))
    with pytest.raises(ValueError, match="a SPLADE model needs a masked LM with its head, not 'BertModel'"):
        _engine(model_dir).close()


def test_sparsify_keeps_the_nonzero_entries_row_by_row() -> None:
    generator = np.random.default_rng(0)
    rows = generator.standard_normal((5, 40)).astype(np.float32) * (generator.random((5, 40)) < 0.2)
    rows[2] = 0.0  # a row with no entry
    sparse = sparsify(rows)
    assert (sparse.cu_offsets.dtype, sparse.indices.dtype, sparse.values.dtype) == (np.int32, np.int32, np.float32)
    assert sparse.cu_offsets.tolist() == [0, *np.cumsum((rows != 0).sum(1)).tolist()]
    for index in range(5):
        indices, values = sparse.row(index)
        assert indices.tolist() == np.flatnonzero(rows[index]).tolist()  # ascending
        assert values.tolist() == rows[index][indices].tolist()
    np.testing.assert_array_equal(densify(sparse, 40), rows)
    empty = sparsify(np.zeros((0, 40), np.float32))
    assert (empty.cu_offsets.tolist(), len(empty.indices)) == ([0], 0)


def test_sparse_flags_survive_slicing_and_concatenation() -> None:
    first = Batch.pack([[1, 2], [3]], RowOptions(sparse=True))
    second = Batch.pack([[4, 5, 6]])
    joined = Batch.concat([first, second])
    assert joined.sparse.tolist() == [True, True, False]
    assert joined.slice(1, 3).sparse.tolist() == [True, False] and joined.slice(2, 3).sparse.tolist() == [False]
    assert first.options() == RowOptions(sparse=True) and second.sparse is None and not second.any_sparse
    assert first.slice(1, 2).options() == RowOptions(sparse=True)  # a chunk keeps its request's options
    with pytest.raises(ValueError, match="different row options"):  # a step mixing requests is no request
        joined.options()


def test_the_directory_without_sparse_linear_has_no_sparse_head(tmp_path, bge_m3) -> None:
    model_dir = tmp_path / "m3"
    shutil.copytree(bge_m3[0], model_dir)
    (model_dir / "sparse_linear.pt").unlink()
    assert read_model_dir(model_dir).sparse is None
