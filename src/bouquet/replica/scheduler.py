"""First come, first served batching by token budget, with up to two engine steps in flight.

One queue of requests, served in arrival order one sequence at a time: a request's sequences may span several
batches, and a later small request never overtakes an earlier large one. A batch is cut when the next sequence
would pass `max_batch_tokens` or `max_batch_seqs`; a sequence larger than the budget runs alone. Tokens are
counted as `Batch.cu_budget` counts them: a sequence's tokens, plus its patch images' patches (the vision tower's
tokens), in the budget, the queue and the step metrics alike; an image's sequence is counted at its tokens
whatever the model (CLIP's 1 + (H / p)(W / p)), and texts and images of one model share a step. Everything
here runs on the event loop's thread, so the queue needs no lock; only the engine's forward runs elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import heapq
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bouquet.batch import Batch, count_within_budget
from bouquet.config import SchedulerConfig
from bouquet.engine.lazy_tensor import LazyTensor
from bouquet.model_dir import ModelSpec, PoolingSpec
from bouquet.replica.metrics import ReplicaMetrics
from bouquet.replica.request import DeadlineExpired, Limits, QueueFull, Request, Unavailable
from bouquet.sparse_rows import SPARSE_STEP_BYTES, max_sparse_rows

logger = logging.getLogger(__name__)

Part = tuple[Request, int, int]  # (request, its first sequence in the batch, how many); rows follow this order


class StepEngine(Protocol):
    """What the scheduler needs of an Engine (tests wrap one to watch or hold its steps)."""

    # Read-only: an Engine's are attributes or properties.
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def dimension(self) -> int: ...  # a row's full width
    @property
    def sparse_dimension(self) -> int: ...  # a sparse row's width; 0: the model gives none
    @property
    def token_dimension(self) -> int: ...  # a multi-vector token row's width; 0: the model gives none
    @property
    def max_seq_length(self) -> int: ...
    @property
    def pooling(self) -> PoolingSpec: ...
    @property
    def family(self) -> str: ...
    @property
    def task(self) -> str: ...
    @property
    def workers(self) -> int: ...  # steps at once; a later one starts, in submission order, when one is done

    def step(self, batch: Batch) -> LazyTensor: ...


@dataclass
class Step:
    lazy: LazyTensor
    parts: list[Part]
    submitted: float  # perf_counter
    finished: float = 0.0  # perf_counter when its result came in; set by the thread that completed it


class Scheduler:
    def __init__(self, engine: StepEngine, config: SchedulerConfig, metrics: ReplicaMetrics | None = None):
        self.engine = engine
        self.config = config
        self.limits = Limits.from_engine(engine)
        self.metrics = metrics or ReplicaMetrics()
        self.queued_tokens = 0
        self.queued_seqs = 0
        self._queue: deque[Request] = deque()
        self._latest_finishes: list[float] = []  # heap: the engine's `workers` latest step finishes
        self._in_flight: deque[Step] = deque()  # submitted to the engine, rows not yet handed out; oldest first
        self._closed = False

    def close(self) -> None:
        """Fails whatever is queued or in flight with Unavailable; a step that finishes later is ignored."""
        self._closed = True
        error = Unavailable("replica is shutting down")
        while self._in_flight:
            self._fail_parts(self._in_flight.popleft().parts, error)
        self.metrics.steps_in_flight.set(0)
        while self._queue:
            self._fail(self._queue.popleft(), error)

    async def embed(
        self,
        batch: Batch,  # checked already: decoded at the replica's boundary, or packed by bouquet's own tokenizer
        deadline: float | None = None,  # event-loop time
        on_rows: Callable[[int], None] | None = None,  # told how many of its rows each finished step hands out
    ) -> np.ndarray:  # [rows (one per sequence, or per span), the batch's width] float32
        request = self._admit(batch, deadline, on_rows)
        try:
            return await request.future
        except asyncio.CancelledError:
            self._drop(request)  # the caller has gone: its queued sequences are never computed
            raise

    def _admit(self, batch: Batch, deadline: float | None, on_rows: Callable[[int], None] | None) -> Request:
        if self._closed:
            raise Unavailable("replica is shutting down")
        loop = asyncio.get_running_loop()
        if deadline is not None and loop.time() >= deadline:
            raise DeadlineExpired("deadline passed before the request was queued")
        tokens = batch.budget_tokens
        if self.queued_tokens + tokens > self.config.max_queue_tokens:
            raise QueueFull(
                f"queue full: {self.queued_tokens} of {self.config.max_queue_tokens} tokens are waiting and this "
                f"request has {tokens}; retry later or on another replica"
            )
        raw = batch.raw_spans is not None and bool(batch.raw_spans.any())
        vectors = batch.token_vectors is not None and bool(batch.token_vectors.any())
        # one request: all its sequences sparse or none, token vectors or none
        full_width = self.limits.full_width(raw, batch.any_sparse, vectors, batch.any_all_outputs)
        rows = np.empty((batch.num_rows, batch.width(full_width)), np.float32)
        request = Request(batch, deadline, loop.create_future(), rows, on_rows, rows_left=batch.num_rows)
        self._queue.append(request)
        self._count_queued(tokens, batch.num_seqs)
        self._submit_ready()
        return request

    def _count_queued(self, tokens: int, seqs: int) -> None:
        self.queued_tokens += tokens
        self.queued_seqs += seqs
        self.metrics.queue_tokens.set(self.queued_tokens)
        self.metrics.queue_seqs.set(self.queued_seqs)

    def _drop(self, request: Request) -> None:
        """Forgets the request's queued sequences; it leaves the deque lazily, when it reaches the head."""
        self._count_queued(-request.queued_tokens, -request.queued_seqs)
        request.next_seq = request.num_seqs

    def _fail(self, request: Request, error: Exception) -> None:
        self._drop(request)
        if not request.future.done():
            request.future.set_exception(error)

    def _submit_ready(self) -> None:
        """Cuts and submits batches while a step slot is free and work is queued.

        Called when a request arrives and when a step's rows have been handed out, so a batch is cut the moment
        there is both work and room: with two slots the engine is handed batch N+1 while it computes N, and no
        scheduling task has to wake up first (that hop is a measurable share of a short query's latency).
        """
        loop = asyncio.get_running_loop()
        while len(self._in_flight) < self.config.max_steps_in_flight and not self._closed:
            parts = self._cut()
            if not parts:
                return
            batch = Batch.concat([request.batch.slice(first, first + count) for request, first, count in parts])
            self.metrics.batch_tokens.observe(batch.budget_tokens)
            self.metrics.batch_seqs.observe(batch.num_seqs)
            try:
                lazy = self.engine.step(batch)
            except Exception as exc:  # the engine refused the batch: its requests fail, the replica goes on
                logger.exception("engine.step failed")
                self._fail_parts(parts, RuntimeError(f"engine step failed: {exc}"))
                continue
            step = Step(lazy, parts, time.perf_counter())
            self._in_flight.append(step)
            self.metrics.steps_in_flight.set(len(self._in_flight))
            lazy.add_done_callback(functools.partial(_on_step_done, loop, self._hand_out_finished, step))

    def _cut(self) -> list[Part]:
        """Takes sequences from the head of the queue, in order, until the next one would pass the budget."""
        now = asyncio.get_running_loop().time()
        max_tokens, max_seqs = self.config.max_batch_tokens, self.config.max_batch_seqs
        parts: list[Part] = []
        tokens = seqs = 0
        while self._queue and seqs < max_seqs:
            request = self._queue[0]
            if request.queued_seqs == 0:  # fully scheduled, or dropped by cancellation or failure
                self._queue.popleft()
                continue
            if request.expired(now):
                self._fail(self._queue.popleft(), DeadlineExpired("deadline passed while the request was queued"))
                continue
            if parts and request.batch.any_sparse != parts[0][0].batch.any_sparse:
                break  # a step is all sparse rows or none: mixed, every row would be vocabulary wide
            if request.batch.any_sparse:
                max_seqs = min(max_seqs, max_sparse_rows(self.limits.sparse_dimension, SPARSE_STEP_BYTES))
            first, cu_budget = request.next_seq, request.batch.cu_budget
            count = count_within_budget(cu_budget, first, max_tokens - tokens, max_seqs - seqs)
            if count == 0:
                if parts:
                    break
                count = 1  # longer than the whole budget: it runs alone rather than wait forever
            num_tokens = int(cu_budget[first + count] - cu_budget[first])
            parts.append((request, first, count))
            tokens, seqs = tokens + num_tokens, seqs + count
            request.next_seq += count
            self._count_queued(-num_tokens, -count)
            if request.queued_seqs:
                break  # its next sequence did not fit, and nothing behind it may overtake it
        return parts

    def _hand_out_finished(self) -> None:
        """On the event loop, once a step is done: hands out the rows of every finished step at the head, in
        submission order, then refills the engine.

        The engine's done-callback lands here directly: no task has to wake up and await the step first,
        one event-loop hop fewer per step (measured in docs/benchmarks.md).
        """
        while self._in_flight and self._in_flight[0].lazy.ready():
            step = self._in_flight.popleft()
            try:
                hand_out(step.parts, step.lazy.result())
            except Exception as exc:  # its requests fail, not hang: the step has left the queue
                logger.error("engine step failed: %s", exc, exc_info=exc)
                self._fail_parts(step.parts, RuntimeError(f"engine step failed: {exc}"))
            self._observe_step_seconds(step)
        self.metrics.steps_in_flight.set(len(self._in_flight))
        self._submit_ready()

    def _observe_step_seconds(self, step: Step) -> None:
        """The step's engine time: from when it started, on submission or when an engine worker came free if
        later, to its result. Steps start in submission order, and every earlier one has been handed out, so a
        worker came free at the `workers`-th latest of their finishes (with one worker: the previous step's)."""
        finished = step.finished or time.perf_counter()  # ready, and its done-callback not yet run
        workers = self.engine.workers
        free_at = self._latest_finishes[0] if len(self._latest_finishes) == workers else 0.0
        self.metrics.step_seconds.observe(finished - max(step.submitted, free_at))
        heapq.heappush(self._latest_finishes, finished)
        if len(self._latest_finishes) > workers:
            heapq.heappop(self._latest_finishes)

    def _fail_parts(self, parts: list[Part], error: Exception) -> None:
        for request, _, _ in parts:
            self._fail(request, error)


def _on_step_done(loop: asyncio.AbstractEventLoop, callback: Callable[[], None], step: Step, _: LazyTensor) -> None:
    """On the thread that completed the step: notes when, and wakes the event loop to hand out its rows."""
    step.finished = time.perf_counter()
    # RuntimeError: the loop has closed; the replica is gone and nobody waits for these rows.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback)


def hand_out(parts: list[Part], rows: np.ndarray) -> None:  # rows: [R, width] float32
    """Copies each part's rows into its request (truncated to its width); completes requests with all rows.
    A part's sequences give one row each, or one per span for a sequence with spans."""
    bounds = [_row_range(request.batch, first, count) for request, first, count in parts]
    num_rows = sum(stop - start for start, stop in bounds)
    if rows.shape[0] != num_rows:  # a real check, not an assert: `python -O` must not let rows be broadcast
        raise ValueError(f"the engine returned {rows.shape[0]} rows for {num_rows}")
    row = 0
    for (request, _, _), (start, stop) in zip(parts, bounds, strict=True):
        count = stop - start
        if not request.future.done():  # a cancelled, expired or failed request's rows are dropped
            request.rows[start:stop] = rows[row : row + count, : request.rows.shape[1]]
            request.rows_left -= count
            if request.on_rows is not None:
                request.on_rows(count)
            if request.rows_left == 0:
                request.future.set_result(request.rows)
        row += count


def _row_range(batch: Batch, first: int, count: int) -> tuple[int, int]:
    """[start, stop) of the rows of sequences first..first + count - 1."""
    if batch.cu_spans is None:
        return first, first + count
    cu_rows = batch.cu_rows
    return int(cu_rows[first]), int(cu_rows[first + count])
