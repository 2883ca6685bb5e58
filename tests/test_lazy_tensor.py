"""LazyTensor semantics and the readback waiter, with stand-in events where CUDA would record real ones."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future, TimeoutError

import numpy as np
import pytest

from bouquet.engine.lazy_tensor import EventWaiter, LazyTensor


class _Event:
    """A stand-in for torch.cuda.Event: synchronize() blocks until the test fires it."""

    def __init__(self, fail: bool = False):
        self._fired = threading.Event()
        self.fail = fail

    def fire(self) -> None:
        self._fired.set()

    def synchronize(self) -> None:
        assert self._fired.wait(10), "event never fired"
        if self.fail:
            raise RuntimeError("device error")


def test_result_waits_and_times_out() -> None:
    future: Future[np.ndarray] = Future()
    lazy = LazyTensor(future)
    assert not lazy.ready()
    with pytest.raises(TimeoutError):
        lazy.result(timeout=0.01)
    future.set_result(np.ones((1, 2), np.float32))
    assert lazy.ready() and lazy.result().shape == (1, 2)


def test_waiter_completes_in_order_and_the_event_loop_stays_free() -> None:
    waiter = EventWaiter()
    events = [_Event(), _Event()]
    lazies = []
    for i, event in enumerate(events):
        future: Future[np.ndarray] = Future()
        waiter.watch(event, lambda i=i: np.full((1, 2), i, np.float32), future)
        lazies.append(LazyTensor(future))

    async def run() -> list[np.ndarray]:
        ticks = 0
        waiting = asyncio.gather(*(asyncio.ensure_future(_await(lazy)) for lazy in lazies))
        while ticks < 5:  # the loop keeps running while both steps are pending
            await asyncio.sleep(0.001)
            ticks += 1
        assert not any(lazy.ready() for lazy in lazies)
        for event in events:
            event.fire()
        return await waiting

    rows = asyncio.run(run())
    assert [float(r[0, 0]) for r in rows] == [0.0, 1.0]
    waiter.close()


async def _await(lazy: LazyTensor) -> np.ndarray:
    return await lazy


def test_waiter_passes_device_errors_to_the_step_and_keeps_going() -> None:
    waiter = EventWaiter()
    bad, good = _Event(fail=True), _Event()
    futures: list[Future[np.ndarray]] = [Future(), Future()]
    waiter.watch(bad, lambda: np.zeros(1), futures[0])
    waiter.watch(good, lambda: np.ones(1), futures[1])
    bad.fire()
    good.fire()
    with pytest.raises(RuntimeError, match="device error"):
        LazyTensor(futures[0]).result(timeout=10)
    assert LazyTensor(futures[1]).result(timeout=10)[0] == 1.0
    waiter.close()


def test_done_callback_runs_on_the_completing_thread_or_at_once() -> None:
    future: Future[np.ndarray] = Future()
    lazy = LazyTensor(future)
    seen: list[tuple[LazyTensor, str]] = []
    lazy.add_done_callback(lambda done: seen.append((done, threading.current_thread().name)))
    assert seen == []
    completer = threading.Thread(target=future.set_result, args=(np.zeros((1, 2), np.float32),), name="engine")
    completer.start()
    completer.join()
    assert seen == [(lazy, "engine")]
    lazy.add_done_callback(lambda done: seen.append((done, threading.current_thread().name)))
    assert seen[1] == (lazy, threading.current_thread().name)
