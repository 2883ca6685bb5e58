"""all-MiniLM-L6-v2 with its real weights and tokenizer against sentence-transformers."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import embed_ids, row_cosines
from corpus import parity_texts


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return parity_texts()


@pytest.fixture(scope="module")
def reference(sentence_transformer, texts: list[str]) -> np.ndarray:
    return sentence_transformer.encode(texts, batch_size=32, normalize_embeddings=True)


def test_corpus_is_mixed(texts: list[str], minilm_tokenizer) -> None:
    lengths = [len(ids) for ids in minilm_tokenizer.encode(texts)]
    assert len(texts) >= 200
    assert sum(length == 256 for length in lengths) >= 20, "needs texts truncated at the model's limit"
    assert min(lengths) == 3, "needs one-word texts ([CLS] word [SEP])"
    assert sum(any(ord(c) > 127 for c in text) for text in texts) >= 20


def test_tokenizer_ignores_exported_padding_and_truncation(minilm_tokenizer) -> None:
    # The package's tokenizer.json pads to 128 and truncates at 128; the model's real limit is 256.
    assert len(minilm_tokenizer.encode(["hi"])[0]) == 3
    assert len(minilm_tokenizer.encode(["word " * 1000])[0]) == 256
    assert len(minilm_tokenizer.encode(["word " * 1000], truncate=False)[0]) == 1002


def test_float32_matches_sentence_transformers(minilm_fp32, minilm_tokenizer, texts, reference) -> None:
    ours = embed_ids(minilm_fp32, minilm_tokenizer.encode(texts))
    assert row_cosines(ours, reference).min() >= 0.99999


def test_bfloat16_matches_float32_reference(minilm_bf16, minilm_tokenizer, texts, reference) -> None:
    ours = embed_ids(minilm_bf16, minilm_tokenizer.encode(texts))
    cosines = row_cosines(ours, reference)
    assert cosines.min() >= 0.999, f"min cosine {cosines.min():.6f}"
    assert np.median(cosines) >= 0.9999, f"median cosine {np.median(cosines):.6f}"


# bfloat16 matrix products round differently as the batch's shape changes, hence its looser bound.
@pytest.mark.parametrize(("engine_name", "bound"), [("minilm_fp32", 0.999999), ("minilm_bf16", 0.9999)])
def test_packed_batch_equals_one_at_a_time(request, engine_name, bound, minilm_tokenizer, texts) -> None:
    engine = request.getfixturevalue(engine_name)
    ids = minilm_tokenizer.encode(texts[::4])
    packed = embed_ids(engine, ids)
    single = np.concatenate([embed_ids(engine, [seq]) for seq in ids])
    assert row_cosines(packed, single).min() >= bound


def test_dimensions_truncate_then_normalize(minilm_fp32, minilm_tokenizer, texts) -> None:
    ids = minilm_tokenizer.encode(texts[:8])
    full = embed_ids(minilm_fp32, ids, normalize=False)
    short = embed_ids(minilm_fp32, ids, normalize=True, dimensions=64)
    expected = full[:, :64] / np.linalg.norm(full[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(short[:, :64], expected, rtol=1e-5, atol=1e-6)
    assert not short[:, 64:].any()
