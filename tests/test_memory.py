"""engine/memory.py: CPU steps' token counts rounded up to a bounded set of sizes, the rows unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.memory import bucket_tokens, pad_to_bucket


def test_counts_are_exact_up_to_twice_per_doubling_and_never_rounded_down() -> None:
    assert [bucket_tokens(n, 16) for n in range(1, 33)] == list(range(1, 33))
    for n in range(1, 5000):
        padded = bucket_tokens(n, 16)
        assert n <= padded < n + n / 16


def test_bounded_number_of_counts() -> None:
    assert len({bucket_tokens(n, 16) for n in range(1, 1025)}) == 112
    assert len({bucket_tokens(n, 8) for n in range(1, 1025)}) == 64
    assert [bucket_tokens(n, 0) for n in (1, 33, 1000)] == [1, 33, 1000]


def test_pad_adds_one_sequence_of_pad_tokens() -> None:
    batch = Batch.pack([[5] * 30, [6] * 9], RowOptions(dimensions=8, normalize=False))  # 39 tokens -> 40
    padded = pad_to_bucket(batch, 16)
    assert padded.num_tokens == 40 and padded.num_seqs == 3
    np.testing.assert_array_equal(padded.input_ids[:39], batch.input_ids)
    np.testing.assert_array_equal(padded.cu_seqlens[:3], batch.cu_seqlens)
    assert pad_to_bucket(Batch.pack([[5] * 40]), 16).num_seqs == 1  # already a bucket: as it was


def test_engine_rows_are_the_same_with_and_without_buckets(minilm_fp32, minilm_tokenizer) -> None:
    assert EngineConfig.cpu_token_buckets == minilm_fp32.runner.token_buckets == 16
    texts = [f"text {i} " + "about embeddings " * (3 * i) for i in range(9)]
    while pad_to_bucket(batch := Batch.pack(minilm_tokenizer.encode(texts)), 16) is batch:
        texts[-1] += " more"  # until the count is not a bucket's, so the batch is padded
    mixed = Batch(**{**batch.__dict__, "dimensions": np.arange(9, dtype=np.int32) % 2 * 64})
    bucketed = [minilm_fp32.embed(batch), minilm_fp32.embed(mixed)]
    minilm_fp32.runner.token_buckets = 0
    try:
        exact = [minilm_fp32.embed(batch), minilm_fp32.embed(mixed)]
    finally:
        minilm_fp32.runner.token_buckets = 16
    for got, want in zip(bucketed, exact, strict=True):
        assert got.shape == want.shape == (9, 384)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [-1])
def test_negative_buckets_refused(minilm_path, value: int) -> None:
    with pytest.raises(ValueError, match="cpu_token_buckets"):
        EngineConfig(minilm_path, "cpu", "float32", cpu_token_buckets=value)
