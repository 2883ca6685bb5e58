"""OpenMP's runtime as torch loads it: finding its per-thread count setter, and running multi-threaded work on a
thread that exits afterwards (engine/cpu_threads.py says why the engine needs both). Imports nothing above it,
so kernels/ and engine/ can both use it."""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

import torch

T = TypeVar("T")


def on_passing_thread(fn: Callable[[], T]) -> T:
    """`fn()` on a new thread that exits when it returns, taking any OpenMP helper threads it started."""
    with ThreadPoolExecutor(1, thread_name_prefix="bouquet-load") as executor:
        return executor.submit(fn).result()


def find_thread_setter() -> Callable[[int], None] | None:
    """`omp_set_num_threads` of the OpenMP runtime torch itself links, or None (no such runtime, or a platform
    without `RTLD_NOLOAD`).

    It sets the calling thread's count only. `torch.set_num_threads` would also rewrite torch's process-wide
    default, which threads that first use torch later inherit, and the lead switching counts every step
    would leave that default at whatever it set last. Looked up through torch's own library, whose lookups
    search its dependencies, so that another OpenMP runtime some other package loaded is never the one found.
    """
    no_load = getattr(os, "RTLD_NOLOAD", None)
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if no_load is None or not library.exists():
        return None
    try:
        setter = ctypes.CDLL(str(library), mode=no_load | os.RTLD_LAZY).omp_set_num_threads
    except (OSError, AttributeError):
        return None
    setter.argtypes, setter.restype = [ctypes.c_int], None
    return setter
