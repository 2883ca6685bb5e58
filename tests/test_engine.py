"""Engine.step: a LazyTensor returned at once, awaitable, results in submission order."""

from __future__ import annotations

import asyncio

import numpy as np
from conftest import embed_ids

from bouquet.engine.batch import Batch
from bouquet.engine.lazy_tensor import LazyTensor
from bouquet.tokenizer import pack


def _batch(tokenizer, texts: list[str]) -> Batch:
    packed = pack(tokenizer.encode(texts))
    return Batch.from_packed(packed.input_ids, packed.cu_seqlens)


def test_step_returns_lazy_float32_rows(minilm_fp32, minilm_tokenizer) -> None:
    lazy = minilm_fp32.step(_batch(minilm_tokenizer, ["first text", "second, longer text here"]))
    assert isinstance(lazy, LazyTensor)
    rows = lazy.result(timeout=60)
    assert lazy.ready()
    assert rows.dtype == np.float32 and rows.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)


def test_steps_in_flight_complete_in_order_and_await(minilm_fp32, minilm_tokenizer) -> None:
    texts = [f"query number {i} about embeddings" for i in range(6)]
    expected = embed_ids(minilm_fp32, minilm_tokenizer.encode(texts))

    async def run() -> list[np.ndarray]:
        lazies = [minilm_fp32.step(_batch(minilm_tokenizer, [text])) for text in texts]
        return [await lazy for lazy in lazies]

    rows = np.concatenate(asyncio.run(run()))
    np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=1e-6)


def test_unnormalized_rows_keep_their_norm(minilm_fp32, minilm_tokenizer) -> None:
    ids = minilm_tokenizer.encode(["an unnormalised mean-pooled vector"])
    raw = embed_ids(minilm_fp32, ids, normalize=False)
    assert abs(np.linalg.norm(raw) - 1.0) > 0.01
