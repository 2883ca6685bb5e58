"""LazyTensor semantics and the readback waiter, with stand-in events where CUDA would record real ones."""

from __future__ import annotations

import asyncio
import threading
import weakref
from concurrent.futures import Future, TimeoutError

import numpy as np
import pytest
import torch

from bouquet.engine.lazy_tensor import EventWaiter, LazyTensor, read_copy


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


def _readback(
    waiter: EventWaiter, event: _Event, freed_on: list[str]
) -> tuple[Future[np.ndarray], weakref.ref, threading.Event]:
    """What start_cuda_readback does, with a CPU tensor standing in for the pinned buffer."""
    host = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    weakref.finalize(host, lambda: freed_on.append(threading.current_thread().name))
    future: Future[np.ndarray] = Future()
    done = waiter.hold(host)
    waiter.watch(event, read_copy(host), future, done=done)
    return future, weakref.ref(host), done


def test_readback_buffer_is_freed_by_its_owner_not_by_the_waiter_or_the_caller() -> None:
    """Freeing a pinned buffer records a CUDA event; done off the engine thread during a graph capture, that
    event would be captured. So the waiter reads a copy and only the owner's next hold() frees the buffer."""
    waiter = EventWaiter()
    freed_on: list[str] = []
    event = _Event()
    future, buffer, done = _readback(waiter, event, freed_on)
    waiter.release_finished()
    assert buffer() is not None  # the copy is still in flight: kept
    event.fire()
    rows = LazyTensor(future).result(timeout=10)
    assert rows.tolist() == [[0, 1, 2], [3, 4, 5]] and not np.shares_memory(rows, buffer().numpy())
    del rows, future
    assert done.wait(10)  # the waiter is through with the step
    assert buffer() is not None and freed_on == []  # neither the caller nor the waiter freed it
    second = _Event()
    _readback(waiter, second, freed_on)  # the owner's next step releases the finished buffer, on its thread
    assert buffer() is None and freed_on == [threading.current_thread().name]
    second.fire()
    waiter.close()
    assert len(freed_on) == 2


def test_readback_buffer_of_a_failed_step_is_released_too() -> None:
    waiter = EventWaiter()
    freed_on: list[str] = []
    event = _Event(fail=True)
    future, buffer, _ = _readback(waiter, event, freed_on)
    event.fire()
    with pytest.raises(RuntimeError, match="device error"):
        LazyTensor(future).result(timeout=10)
    del future
    waiter.close()
    assert buffer() is None and freed_on == [threading.current_thread().name]
