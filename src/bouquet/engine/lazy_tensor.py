"""A step's result that is not ready yet: wait for it from a thread, or await it from an event loop."""

from __future__ import annotations

import asyncio
import queue
import threading
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
        self._queue: queue.SimpleQueue[tuple[Synchronizable, Callable[[], np.ndarray], Future] | None]
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._wait_loop, name="bouquet-readback", daemon=True)
        self._thread.start()

    def watch(self, event: Synchronizable, value: Callable[[], np.ndarray], future: Future[np.ndarray]) -> None:
        self._queue.put((event, value, future))

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _wait_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            event, value, future = item
            try:
                event.synchronize()
                future.set_result(value())
            except BaseException as error:  # the step's caller gets the error, the waiter lives on
                future.set_exception(error)


def start_cuda_readback(
    rows: torch.Tensor,  # [B, dim] float32 on the device, written by work already on `stream`
    stream: torch.cuda.Stream,
    waiter: EventWaiter,
    future: Future[np.ndarray],
) -> None:
    """A non-blocking copy into pinned host memory and an event after it; `future` completes when it fires.

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
    waiter.watch(event, host.numpy, future)
