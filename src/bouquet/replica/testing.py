"""An in-process replica for tests and benchmarks: the real server on a background event loop, and an engine
wrapper that records every batch and can hold steps back so a test can line up a queue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

from bouquet import event_loop
from bouquet.batch import Batch
from bouquet.config import SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.engine.lazy_tensor import LazyTensor
from bouquet.replica.scheduler import Scheduler
from bouquet.replica.server import ReplicaServer

T = TypeVar("T")


class RecordingEngine:
    """Delegates to a real Engine, in order, on a thread of its own; `hold()` keeps steps from starting."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.spec = engine.spec
        self.dimension = engine.dimension
        self.sparse_dimension = engine.sparse_dimension
        self.token_dimension = engine.token_dimension
        self.max_seq_length = engine.max_seq_length
        self.pooling = engine.pooling
        self.family = engine.family
        self.task = engine.task
        self.image_shape = engine.image_shape
        self.image_tokens = engine.image_tokens
        self.image_patches = engine.image_patches
        self.zero_shot_logit = engine.zero_shot_logit
        self.workers = 1  # its one thread runs the steps in order
        self.batches: list[Batch] = []  # in submission order
        self._open = threading.Event()
        self._open.set()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="recording-engine")

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def step(self, batch: Batch) -> LazyTensor:
        self.batches.append(batch)
        return LazyTensor(self._executor.submit(self._run, batch))

    def _run(self, batch: Batch) -> np.ndarray:
        self._open.wait()
        return self.engine.embed(batch)

    def close(self) -> None:
        self.release()
        self._executor.shutdown(wait=True)


class ReplicaThread:
    """A ReplicaServer on 127.0.0.1 (any free port), or at `listen` (unix:PATH: with its local lane), with its own
    event loop on a daemon thread."""

    def __init__(
        self, engine: RecordingEngine | Engine, config: SchedulerConfig, attach: bool = True,
        listen: str = "127.0.0.1:0", token: str | None = None,
    ):  # fmt: skip
        self.engine = engine
        self.config = config
        self._listen, self._token = listen, token
        self.loop = event_loop.new_event_loop()  # the loop `bouquet replica` runs on
        self._thread = threading.Thread(target=self.loop.run_forever, name="replica-loop", daemon=True)
        self._thread.start()
        self.server: ReplicaServer = self.call(self._start())
        self.address = listen if listen.startswith("unix:") else f"127.0.0.1:{self.server.port}"
        if attach:
            self.attach()

    async def _start(self) -> ReplicaServer:
        server = ReplicaServer(self._listen, token=self._token)
        await server.start()
        return server

    def attach(self) -> None:
        self.call(self.server.attach(self.engine, self.config, "float32", "cpu"))

    @property
    def scheduler(self) -> Scheduler:
        assert self.server.scheduler is not None, "attach() first"
        return self.server.scheduler

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Runs `coro` on the replica's loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.server.stop(grace=1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def marked(marker: int, length: int = 6) -> list[int]:
    """A synthetic sequence whose second token names it, so a test can find it in the engine's batches."""
    return [101, marker, *range(2000, 2000 + length - 3), 102]


def markers_in_order(batches: list[Batch]) -> list[int]:
    """The marker of every sequence the engine was given, in the order it was given them."""
    return [int(batch.input_ids[start + 1]) for batch in batches for start in batch.cu_seqlens[:-1]]


def wait_until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"condition not reached in {timeout} s")
        time.sleep(0.005)
