"""A step's result that is not ready yet: wait for it from a thread, or await it from an event loop."""

from __future__ import annotations

import asyncio
from collections.abc import Generator
from concurrent.futures import Future
from typing import Any

import numpy as np


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

    def __await__(self) -> Generator[Any, None, np.ndarray]:
        return asyncio.wrap_future(self._future).__await__()
