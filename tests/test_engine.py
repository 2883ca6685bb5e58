"""Engine.step: a LazyTensor returned at once, awaitable, each step's own rows; CPU workers."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import torch
from conftest import embed_ids

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.engine.lazy_tensor import LazyTensor


def _batch(tokenizer, texts: list[str]) -> Batch:
    return Batch.pack(tokenizer.encode(texts))


def test_step_returns_lazy_float32_rows(minilm_fp32, minilm_tokenizer) -> None:
    lazy = minilm_fp32.step(_batch(minilm_tokenizer, ["first text", "second, longer text here"]))
    assert isinstance(lazy, LazyTensor)
    rows = lazy.result(timeout=60)
    assert lazy.ready()
    assert rows.dtype == np.float32 and rows.shape == (2, 384)
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)


def test_steps_in_flight_each_give_their_own_rows_when_awaited(minilm_fp32, minilm_tokenizer) -> None:
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


def _threads_on_a_new_thread() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


def _threads_once_all_busy(all_busy: threading.Barrier) -> int:
    all_busy.wait(30)
    return torch.get_num_threads()


def test_cpu_workers_split_the_threads_and_agree_with_one_worker(minilm_path, minilm_tokenizer) -> None:
    """Two workers compute steps at once on half the threads each; their rows equal a single worker's."""
    texts = [f"document {i}: " + "an embedding of this text " * (i % 7 + 1) for i in range(12)]
    batches = [_batch(minilm_tokenizer, texts[i : i + 3]) for i in range(0, len(texts), 3)]
    rows = {}
    for workers in (1, 2):
        config = EngineConfig(minilm_path, "cpu", "float32", num_threads=2, cpu_workers=workers)
        engine = Engine(config)
        try:
            assert (engine.workers, engine.threads_per_worker) == (workers, 2 // workers)
            all_busy = threading.Barrier(workers)  # each worker holds one job, so each reports its own count
            jobs = [engine._workers.submit(_threads_once_all_busy, all_busy) for _ in range(workers)]
            assert {job.result(60) for job in jobs} == {2 // workers}  # every worker thread runs with its share
            # torch's default for threads that start later is left as it was.
            assert _threads_on_a_new_thread() == torch.get_num_threads()
            rows[workers] = np.concatenate([lazy.result(60) for lazy in [engine.step(b) for b in batches]])
        finally:
            engine.close()
    np.testing.assert_allclose(rows[2], rows[1], rtol=1e-5, atol=1e-6)
