"""A step's result that is not ready yet: wait for it from a thread, or await it from an event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
import weakref
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any, Protocol

import numpy as np
import torch


class LazyTensor:
    """Float32 embeddings [B, dim] in host memory, available once the engine has finished the step.

    On the CPU the future completes when the engine thread's forward returns; on CUDA, when the event
    recorded after the pinned-buffer copy has fired.
    """

    def __init__(self, future: Future[np.ndarray]):
        self._future = future

    def ready(self) -> bool:
        return self._future.done()

    def result(self, timeout: float | None = None) -> np.ndarray:
        return self._future.result(timeout)

    def add_done_callback(self, callback: Callable[[LazyTensor], None]) -> None:
        """Calls `callback(self)` once the result or error is in, on the thread that completed it (at once if
        it already has). A replica turns this into one `call_soon_threadsafe`: the cheapest way back to its
        event loop, which matters for a short query's latency."""
        self._future.add_done_callback(lambda _: callback(self))

    def __await__(self) -> Generator[Any, None, np.ndarray]:
        return asyncio.wrap_future(self._future).__await__()


class Synchronizable(Protocol):
    def synchronize(self) -> None: ...


class EventWaiter:
    """One thread that waits on recorded events in order and completes each one's future.

    The engine thread only records events and moves on to the next step; waiting happens here, so neither
    the engine thread nor the replica's event loop ever blocks on the device. Events on one stream complete
    in order, so waiting for them first in, first out is never later than necessary.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Watched | None] = queue.SimpleQueue()
        self._held: list[tuple[torch.Tensor, threading.Event]] = []  # the owner's thread only
        self._thread = threading.Thread(target=self._wait_loop, name="bouquet-readback", daemon=True)
        self._thread.start()

    def watch(
        self,
        event: Synchronizable,
        value: Callable[[], np.ndarray],
        future: Future[np.ndarray],
        done: threading.Event | None = None,
    ) -> None:
        """Completes `future` with `value()` once `event` has fired; then sets `done`, by which time this
        thread holds nothing of the step any more."""
        self._queue.put((event, value, future, done))

    def hold(self, buffer: torch.Tensor) -> threading.Event:
        """Keeps `buffer` alive on the calling thread's behalf until the returned flag is set; the caller's
        next `hold()` (or `close()`) drops it there, so that thread is the one that frees it."""
        self.release_finished()
        done = threading.Event()
        self._held.append((buffer, done))
        return done

    def release_finished(self) -> None:
        self._held = [(buffer, done) for buffer, done in self._held if not done.is_set()]

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._held.clear()

    def _wait_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            event, value, future, done = item
            item = None
            self._complete(event, value, future)
            event = value = future = None  # type: ignore[assignment]
            if done is not None:
                done.set()

    @staticmethod
    def _complete(event: Synchronizable, value: Callable[[], np.ndarray], future: Future[np.ndarray]) -> None:
        try:
            event.synchronize()
            future.set_result(value())
        except BaseException as error:  # the step's caller gets the error, the waiter lives on
            future.set_exception(error)


_Watched = tuple[Synchronizable, Callable[[], np.ndarray], Future, threading.Event | None]


def start_cuda_readback(
    rows: torch.Tensor,  # [B, dim] float32 on the device, written by work already on `stream`
    stream: torch.cuda.Stream,
    waiter: EventWaiter,
    future: Future[np.ndarray],
) -> None:
    """A non-blocking copy into pinned host memory and an event after it; `future` completes when it fires.

    Called on the engine thread. The step's caller gets a copy of the rows, never the pinned buffer: freeing
    a pinned block records an event on each stream that used it, and were that done by another thread (the
    replica's event loop dropping its rows) while the engine thread captures a CUDA graph on this stream,
    the event would be captured and the host allocator's next query of it would raise. The buffer is owned
    by the engine thread (`waiter.hold`) and freed there, between steps, never during a capture.
    Only written for CUDA; it has not run on a GPU yet (bench/gpu_check.py and tests/test_gpu.py check it).
    """
    # Pinned blocks come from torch's caching host allocator, which keeps a block until the copies that
    # use it have finished, so a block is never handed to a later step while this copy is in flight.
    host = torch.empty(rows.shape, dtype=torch.float32, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(rows, non_blocking=True)
        # blocking=True: the waiter thread sleeps in the driver instead of spinning a CPU core.
        event = torch.cuda.Event(blocking=True)
        event.record(stream)
    waiter.watch(event, read_copy(host), future, done=waiter.hold(host))


def read_copy(host: torch.Tensor) -> Callable[[], np.ndarray]:
    """Reads a copy of `host` through a weak reference: the reader never owns the buffer, so it never
    frees it, whatever thread it runs on."""
    buffer = weakref.ref(host)

    def read() -> np.ndarray:
        pinned = buffer()
        assert pinned is not None, "a pinned readback buffer was freed before it was read"
        return pinned.numpy().copy()

    return read
