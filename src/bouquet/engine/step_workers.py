"""The threads that compute engine steps: a shared first-in, first-out queue, and a lead worker that takes
every step it is free for.

A `ThreadPoolExecutor` would do, except that which of its idle threads takes a job is left to chance. The
CPU engine needs a lone step on one known thread: only that thread may widen its OpenMP team to every
core (engine/cpu_threads.py explains why one thread only).
"""

from __future__ import annotations

import bisect
import queue
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_Job = tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]


class StepWorkers:
    """`count` threads, each computing one job at a time; an idle lead (worker 0) is always chosen first.

    The threads are daemons, as nothing may hold the interpreter open at exit: `shutdown()` is what finishes
    the steps already submitted (the engine's `close()`)."""

    def __init__(self, count: int, initializer: Callable[[int], None], name: str = "bouquet-engine"):
        """Starts the threads and returns once `initializer(index)` has run on each; raises the first error
        an initializer raised, after stopping the threads."""
        self._lock = threading.Lock()
        self._idle: list[int] = []  # sorted: the lead, when idle, is first
        self._pending: deque[_Job] = deque()  # jobs submitted while every worker was busy
        self._inboxes: list[queue.SimpleQueue[_Job | None]] = [queue.SimpleQueue() for _ in range(count)]
        self._closed = False
        self._init_errors: list[BaseException] = []
        started = threading.Barrier(count + 1)
        self._threads = [
            threading.Thread(target=self._serve, args=(i, initializer, started), name=f"{name}-{i}", daemon=True)
            for i in range(count)
        ]
        for thread in self._threads:
            thread.start()
        started.wait()
        if self._init_errors:
            self.shutdown()
            raise self._init_errors[0]

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        future: Future[Any] = Future()
        job = (future, fn, args)
        with self._lock:  # the put too: a shutdown's stop marker must never overtake an accepted job
            if self._closed:
                raise RuntimeError("submit after shutdown")
            if self._idle:
                self._inboxes[self._idle.pop(0)].put(job)
            else:
                self._pending.append(job)
        return future

    def shutdown(self) -> None:
        """Finishes every job already submitted, then stops the threads."""
        with self._lock:
            self._closed = True
            for inbox in self._inboxes:
                inbox.put(None)
        for thread in self._threads:
            thread.join()

    def _serve(self, index: int, initializer: Callable[[int], None], started: threading.Barrier) -> None:
        try:
            initializer(index)
        except BaseException as error:
            self._init_errors.append(error)
        with self._lock:
            bisect.insort(self._idle, index)
        started.wait()
        while (job := self._inboxes[index].get()) is not None:
            while job is not None:
                outcome = _compute(job)
                # Idle (or holding the next job) before the result goes out: the caller's done-callbacks run
                # here and often submit the next step, which should find the lead free.
                job = self._next_or_idle(index)
                _settle(outcome)

    def _next_or_idle(self, index: int) -> _Job | None:
        with self._lock:
            if self._pending:
                return self._pending.popleft()
            bisect.insort(self._idle, index)
            return None


_Outcome = tuple[Future[Any], Any, BaseException | None]


def _compute(job: _Job) -> _Outcome | None:
    future, fn, args = job
    if not future.set_running_or_notify_cancel():
        return None
    try:
        return future, fn(*args), None
    except BaseException as error:  # handed to whoever waits on the step, as an executor would
        return future, None, error


def _settle(outcome: _Outcome | None) -> None:
    if outcome is None:
        return
    future, result, error = outcome
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
