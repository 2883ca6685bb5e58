"""Gives memory back once the gateway is idle. A burst of large requests (parsed bodies, tokenizer buffers on the
tokenizing threads) leaves glibc's heap and per-thread arenas holding freed memory that it returns to the system
only at their tops; after an overload the gateway's RSS stayed at several times its start. `malloc_trim` returns
every free page; it is called once the gateway has been idle for a moment after answering work, never while a
request is being answered, and costs a few milliseconds."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

_IDLE_CHECK_S = 0.5


def _malloc_trim() -> Callable[[], None] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        trim = libc.malloc_trim if libc is not None else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim this way
        return None
    if trim is None:
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


async def trim_when_idle(in_flight: Callable[[], int], answered: Callable[[], int]) -> None:
    """Runs for the gateway's life: once work was answered and then nothing for a whole check interval (and none is
    in flight), collects and trims once. Not at a mere lull between requests: a collection and a trim take
    milliseconds that a request arriving meanwhile would wait."""
    trim = _malloc_trim()
    if trim is None:
        logger.info("malloc_trim is not available here; freed memory stays with the allocator")
        return
    trimmed_at = seen = answered()
    while True:
        await asyncio.sleep(_IDLE_CHECK_S)
        done = answered()
        if done == seen != trimmed_at and in_flight() == 0:
            gc.collect()  # refused requests' exceptions hold their frames, parsed bodies included, in cycles
            trim()
            trimmed_at = done
        seen = done
