"""Timing attention backends on the model's own attention shape, and the CPU's measured tables, cached.

`auto` picks a backend per max-sequence-length bucket from such timings on every device. On a GPU the table
comes from bench/gpu_check.py or a measurement at start-up; on the CPU it is measured at start-up on the
engine workers' own thread count and cached per machine (CPU model and the probe's features), torch release,
kernel build and attention shape, so a replica measures once and later starts read the file. A cached table
is also what `--attention-table FILE` takes.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch

from bouquet.layers.attention_backends.base import AttentionBackend, AttentionShape
from bouquet.layers.context import ForwardContext
from bouquet.machine_cache import measurement_path, write_measurement

logger = logging.getLogger(__name__)

# The CPU's max_seqlen buckets: doublings from one query tile up to the model's length limit, at most this (a
# longer sequence uses the last row: measuring 8k tokens on a core would take the replica's start-up minutes).
CPU_MIN_LENGTH, CPU_MAX_MEASURED_LENGTH = 16, 2048
CPU_BATCH_TOKENS = 1024  # the scheduler's CPU step budget: a step of short sequences holds about this many
# Timed turns per length: at least 3, then until this much time has passed or 10 were taken. The fastest call is
# kept: on a shared machine other work only ever adds time, and a median of a few calls flipped close buckets.
_MIN_CALLS, _MAX_CALLS, _SECONDS_PER_CASE = 3, 10, 0.3


def cpu_lengths(max_seq_length: int) -> tuple[int, ...]:
    """The measured buckets for a model whose sequences hold up to `max_seq_length` tokens."""
    top = min(max(max_seq_length, CPU_MIN_LENGTH), CPU_MAX_MEASURED_LENGTH)
    lengths = [CPU_MIN_LENGTH]
    while lengths[-1] < top:
        lengths.append(lengths[-1] * 2)
    return tuple(lengths)


def bucket_seq_lens(seq_len: int, batch_tokens: int, mixed: bool) -> list[int]:
    """A batch for the bucket `seq_len`: max(1, batch_tokens // seq_len) sequences of `seq_len` tokens, or
    (`mixed`) of lengths spread over (seq_len / 2, seq_len], the longest first, as a real step's are."""
    count = max(1, batch_tokens // seq_len)
    if not mixed:
        return [seq_len] * count
    return [seq_len - (i * seq_len) // (2 * count) for i in range(count)]


def prepare_call(
    backend: AttentionBackend,
    shape: AttentionShape,
    seq_len: int,
    device: torch.device,
    batch_tokens: int = 8192,
    mixed: bool = False,
) -> Callable[[], object]:
    """One forward of `backend` on a bucket's batch (`bucket_seq_lens`), run once here (a first call compiles or
    warms up, and a backend that cannot run the case fails here)."""
    seq_lens = bucket_seq_lens(seq_len, batch_tokens, mixed)
    total = sum(seq_lens)
    q = torch.randn(total, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    k = torch.randn(total, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    v = torch.randn_like(k)
    cu_seqlens = torch.tensor([0, *torch.tensor(seq_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    ctx = ForwardContext(cu_seqlens, max(seq_lens), seq_lens)
    ctx.attn_metadata = backend.prepare(ctx)

    def call() -> object:
        return backend.forward(q, k, v, ctx, shape.causal, shape.scale)

    call()
    return call


def time_calls(calls: dict[str, Callable[[], object]], device: torch.device) -> dict[str, float]:
    """Seconds per call of each, taken in turns (so that a slow spell of a shared machine falls on all of them):
    the fastest of 3 to 10 turns; a call that raises leaves its backend out."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    began = time.perf_counter()
    for turn in range(_MAX_CALLS):
        for name, call in calls.items():
            if name not in times:
                continue
            try:
                _synchronize(device)
                start = time.perf_counter()
                call()
                _synchronize(device)
            except Exception as error:
                logger.warning("attention backend %s failed: %s", name, error)
                del times[name]
                continue
            times[name].append(time.perf_counter() - start)
        if turn + 1 >= _MIN_CALLS and time.perf_counter() - began > _SECONDS_PER_CASE:
            break
    return {name: min(seconds) for name, seconds in times.items()}


def measure_timings(
    backends: dict[str, AttentionBackend],
    shape: AttentionShape,
    device: torch.device,
    lengths: tuple[int, ...],
    batch_tokens: int = 8192,
    mixed: bool = False,
) -> dict[int, dict[str, float]]:
    """Seconds per call, per length and backend; a backend that fails at a length is left out there."""
    timings: dict[int, dict[str, float]] = {}
    for length in lengths:
        calls = {}
        for name, backend in backends.items():
            backend.bind(shape)
            try:
                calls[name] = prepare_call(backend, shape, length, device, batch_tokens, mixed)
            except Exception as error:  # e.g. a kernel without this head size or GPU generation
                logger.warning("attention backend %s failed at %d tokens: %s", name, length, error)
        timings[length] = time_calls(calls, device)
    return timings


def cpu_cache_path(shape: AttentionShape, lengths: tuple[int, ...], threads: int, backends: list[str]) -> Path:
    """Where this machine's table for `shape` lives: keyed by everything that changes the timings."""
    key = {
        "shape": {name: str(value) for name, value in asdict(shape).items()},
        "lengths": lengths,
        "threads": threads,
        "backends": backends,
    }
    return measurement_path("attention", key)


def read_cached_timings(path: Path) -> dict[int, dict[str, float]] | None:
    """The timings a cache file holds, or None if it is missing or unreadable (then they are measured again)."""
    try:
        document = json.loads(path.read_text())
        return {int(length): dict(times) for length, times in document["timings"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def write_cached_table(path: Path, table_json: str, timings: dict[int, dict[str, float]]) -> None:
    """The table and its timings (machine_cache.write_measurement: written atomically, a failure only logged)."""
    write_measurement(path, {**json.loads(table_json), "timings": timings})


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
