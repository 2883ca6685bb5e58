"""The scheduler's completion path on its own: steps finishing out of order still hand out rows in order.

The engine here is a stand-in whose steps the test completes by hand, from another thread as the real
engine does; everything else (the scheduler, its queue and its hand-out) is the real code.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest

from bouquet.batch import Batch, RowOptions
from bouquet.config import SchedulerConfig
from bouquet.engine.lazy_tensor import LazyTensor
from bouquet.model_dir import ModelSpec, PoolingMethod, PoolingSpec
from bouquet.replica.metrics import ReplicaMetrics
from bouquet.replica.scheduler import Scheduler


class _HandCompletedEngine:
    def __init__(self) -> None:
        config = {"architectures": ["BertModel"], "vocab_size": 100, "hidden_size": 4}
        self.spec = ModelSpec(
            Path("."), "stand-in", config, (), Path("."), PoolingSpec((PoolingMethod.MEAN,)), True, 16
        )
        self.dimension = 4
        self.sparse_dimension = 0
        self.max_seq_length = 16
        self.pooling = self.spec.pooling
        self.task = "embed"
        self.steps: list[tuple[Batch, Future[np.ndarray]]] = []
        self.workers = 2  # steps computed at once, as the CPU engine's default

    def step(self, batch: Batch) -> LazyTensor:
        future: Future[np.ndarray] = Future()
        self.steps.append((batch, future))
        return LazyTensor(future)

    def finish(self, index: int) -> None:
        """Completes step `index` from another thread: each row is its sequence's first token id."""
        batch, future = self.steps[index]
        rows = np.repeat(batch.input_ids[batch.cu_seqlens[:-1]].astype(np.float32)[:, None], 4, axis=1)
        threading.Thread(target=future.set_result, args=(rows,)).start()


async def _out_of_order() -> tuple[list[float], list[float]]:
    engine = _HandCompletedEngine()
    scheduler = Scheduler(engine, SchedulerConfig(max_batch_tokens=4, max_batch_seqs=1, max_steps_in_flight=2))
    first = asyncio.ensure_future(scheduler.embed(Batch.pack([[7, 7]])))
    second = asyncio.ensure_future(scheduler.embed(Batch.pack([[9, 9]])))
    await asyncio.sleep(0)
    assert len(engine.steps) == 2  # both in flight at once
    engine.finish(1)  # the later step finishes first: its rows must wait for the earlier one
    await asyncio.sleep(0.05)
    assert not first.done() and not second.done()
    engine.finish(0)
    rows = await asyncio.wait_for(asyncio.gather(first, second), timeout=5)
    return [float(r[0, 0]) for r in rows], [float(v) for v in rows[0][0]]


def test_steps_hand_out_in_submission_order_even_when_they_finish_out_of_order() -> None:
    firsts, row = asyncio.run(_out_of_order())
    assert firsts == [7.0, 9.0]
    assert row == [7.0, 7.0, 7.0, 7.0]


async def _step_seconds(workers: int, finish_order: list[int]) -> tuple[float, float]:
    """Two steps in flight, finishing 0.2 s and 0.3 s after submission; (count, sum) of bouquet_step_seconds."""
    engine = _HandCompletedEngine()
    engine.workers = workers
    metrics = ReplicaMetrics()
    config = SchedulerConfig(max_batch_tokens=4, max_batch_seqs=1, max_steps_in_flight=2)
    scheduler = Scheduler(engine, config, metrics)
    calls = [asyncio.ensure_future(scheduler.embed(Batch.pack([[i, i]]))) for i in (7, 9)]
    await asyncio.sleep(0)
    for index, wait in zip(finish_order, (0.2, 0.1), strict=True):
        await asyncio.sleep(wait)
        engine.finish(index)
    await asyncio.wait_for(asyncio.gather(*calls), timeout=5)
    assert metrics.value("bouquet_steps_in_flight") == 0
    return metrics.value("bouquet_step_seconds_count"), metrics.value("bouquet_step_seconds_sum")


def test_step_seconds_count_each_step_from_when_an_engine_worker_took_it() -> None:
    """Two workers start both steps at once: 0.2 s + 0.3 s of engine time, whichever finishes first (not the
    time since the previous hand-out). One worker starts the second step when the first is done: 0.2 + 0.1 s."""
    for finish_order in ([0, 1], [1, 0]):
        count, total = asyncio.run(_step_seconds(2, finish_order))
        assert count == 2 and 0.45 < total < 0.75, (finish_order, total)
    count, total = asyncio.run(_step_seconds(1, [0, 1]))
    assert count == 2 and 0.25 < total < 0.45, total


async def _short_rows() -> None:
    engine = _HandCompletedEngine()
    scheduler = Scheduler(engine, SchedulerConfig(max_batch_tokens=8, max_batch_seqs=2, max_steps_in_flight=2))
    call = asyncio.ensure_future(scheduler.embed(Batch.pack([[7, 7], [9, 9]])))
    await asyncio.sleep(0)
    _, future = engine.steps[0]
    threading.Thread(target=future.set_result, args=(np.zeros((1, 4), np.float32),)).start()  # 1 row for 2 seqs
    await asyncio.wait_for(call, timeout=5)


def test_rows_that_cannot_be_handed_out_fail_their_requests_instead_of_losing_them() -> None:
    with pytest.raises(RuntimeError, match="engine step failed"):
        asyncio.run(_short_rows())


async def _steps_of_sparse_and_dense() -> list[list[bool]]:
    engine = _HandCompletedEngine()
    engine.sparse_dimension = 4
    scheduler = Scheduler(engine, SchedulerConfig(max_batch_tokens=64, max_batch_seqs=8, max_steps_in_flight=2))
    sparse = RowOptions(normalize=False, sparse=True)
    kinds = [RowOptions(), sparse, RowOptions(), sparse, RowOptions()]
    calls = [asyncio.ensure_future(scheduler.embed(Batch.pack([[7, 7]], kind))) for kind in kinds]
    await asyncio.sleep(0)
    for index in range(len(kinds)):  # the first two are cut at once; the rest queue and are cut as steps finish
        while len(engine.steps) <= index:
            await asyncio.sleep(0.01)
        engine.finish(index)
    await asyncio.wait_for(asyncio.gather(*calls), timeout=5)
    return [[batch.any_sparse] * batch.num_seqs for batch, _ in engine.steps]


def test_a_step_never_mixes_sparse_and_dense_rows() -> None:
    """Mixed, every row of the step would be vocabulary wide (bge-m3: 1 MB a row): a step ends where the queue
    switches between sparse and dense requests."""
    steps = asyncio.run(_steps_of_sparse_and_dense())
    assert steps == [[False], [True], [False], [True], [False]]
