"""The `auto` attention backend: per max-sequence-length bucket, the backend measured fastest on this device.

The table comes from a JSON file (`--attention-table`: bench/gpu_check.py's on a GPU, a cached one on the CPU),
or is measured at start-up on the model's own attention shape (timing.py; on the CPU cached per machine and
shape); either way the choice is logged. On the CPU the candidates are cpu_varlen (where it can run: a C
compiler, float32 or bfloat16, head_dim a multiple of 16, no position bias) and SDPA.
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar, TypeVar

import torch

from bouquet.layers.attention_backends import AttentionBackend, AttentionShape, cpu_varlen, create_attention_backend
from bouquet.layers.attention_backends.base import BackendUnavailableError, describe_needs
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.attention_backends.timing import (
    CPU_BATCH_TOKENS,
    CPU_MAX_MEASURED_LENGTH,
    cpu_cache_path,
    cpu_lengths,
    measure_timings,
    read_cached_timings,
    write_cached_table,
)
from bouquet.layers.context import ForwardContext

T = TypeVar("T")
logger = logging.getLogger(__name__)

GPU_BACKENDS = ("flash_attn", "flashinfer", "sdpa")
MEASURED_LENGTHS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class BackendTable:
    """Rows (max_seqlen upper bound, backend), ascending; the last row also covers anything longer."""

    rows: tuple[tuple[int, str], ...]

    def __post_init__(self) -> None:
        bounds = [bound for bound, _ in self.rows]
        if not self.rows or bounds != sorted(set(bounds)):
            raise ValueError(f"backend table needs strictly increasing max_seqlen bounds, got {bounds}")

    def choose(self, max_seqlen: int) -> str:
        i = bisect.bisect_left([bound for bound, _ in self.rows], max_seqlen)
        return self.rows[min(i, len(self.rows) - 1)][1]

    @classmethod
    def from_timings(cls, timings: dict[int, dict[str, float]]) -> BackendTable:
        """The fastest backend at each measured length (seconds per call; missing backends left out, and a
        length where every backend failed left out too)."""
        rows = [(length, min(times, key=times.__getitem__)) for length, times in sorted(timings.items()) if times]
        return cls(tuple(rows))

    def restricted_to(self, names: set[str], fallback: str) -> BackendTable:
        return BackendTable(tuple((bound, name if name in names else fallback) for bound, name in self.rows))

    def to_json(self) -> str:
        return json.dumps({"rows": [{"max_seqlen": bound, "backend": name} for bound, name in self.rows]}, indent=1)

    @classmethod
    def load(cls, path: Path) -> BackendTable:
        rows = json.loads(path.read_text())["rows"]
        return cls(tuple((int(row["max_seqlen"]), str(row["backend"])) for row in rows))


@dataclass(frozen=True)
class _Choice:
    backend: AttentionBackend
    ctx: ForwardContext  # the batch's context carrying the chosen backend's own metadata


class AutoBackend(AttentionBackend):
    """Dispatches each batch to the table's backend for its max_seqlen. A CUDA graph records the backend itself
    (`graph_backend`, by the batch's own longest sequence), and only for the lengths where that one can be
    captured: the others run eagerly rather than turning graphs off for every length."""

    name: ClassVar[str] = "auto"

    def __init__(self, backends: dict[str, AttentionBackend], table: BackendTable):
        self.backends = backends
        self.table = table
        self.supports_cuda_graphs = any(b.supports_cuda_graphs for b in backends.values())  # type: ignore[misc]

    def bind(self, shape: AttentionShape) -> None:
        self.shape = shape  # each backend it dispatches to checks that it can run the model
        for backend in self.backends.values():
            backend.bind(shape)

    def prepare(self, ctx: ForwardContext) -> _Choice:
        backend = self.backends[self.table.choose(ctx.max_seqlen)]
        return _Choice(backend, replace(ctx, attn_metadata=backend.prepare(ctx)))

    def backend_for(self, max_seqlen: int) -> str:
        return self.backends[self.table.choose(max_seqlen)].name

    def graph_backend(self, max_seqlen: int) -> AttentionBackend | None:
        return self.backends[self.table.choose(max_seqlen)].graph_backend(max_seqlen)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        choice: _Choice = ctx.attn_metadata
        return choice.backend.forward(q, k, v, choice.ctx, causal, scale, window, bias)


def load_backends(names: tuple[str, ...]) -> tuple[dict[str, AttentionBackend], dict[str, str]]:
    """The backends that load here, and why each other one did not (whatever it raised: `auto` and the GPU
    check go on with the others)."""
    loaded, missing = {}, {}
    for name in names:
        try:
            loaded[name] = create_attention_backend(name)
        except BackendUnavailableError as error:
            missing[name] = str(error)
        except Exception as error:
            missing[name] = f"{type(error).__name__}: {error}"
    return loaded, missing


def create_auto_backend(
    device: torch.device,
    shape: AttentionShape,
    table_path: Path | None = None,
    max_seq_length: int = CPU_MAX_MEASURED_LENGTH,
    threads: int = 1,
) -> AttentionBackend:
    """The table's backend per length: from `table_path`, else (CPU) this machine's cached table, else measured
    now. On the CPU the timings run on `threads` intra-op threads (an engine worker's share) at the buckets up
    to `max_seq_length`."""
    if device.type == "cpu":
        backends, missing = _cpu_backends(shape)
    else:
        backends, missing = load_backends(GPU_BACKENDS)
    for name, backend in list(backends.items()):
        if not backend.can_run(shape):
            missing[name] = f"cannot run {describe_needs(shape)}"
            del backends[name]
    for name, reason in missing.items():
        logger.info("attention auto: %s not available: %s", name, reason)
    if table_path is not None:
        table, source = BackendTable.load(table_path).restricted_to(set(backends), SdpaBackend.name), str(table_path)
        timings = {}
    elif device.type == "cpu" and len(backends) > 1:
        table, timings, source = _cpu_table(backends, shape, max_seq_length, threads)
    elif len(backends) == 1:
        table, timings, source = BackendTable(((max_seq_length, next(iter(backends))),)), {}, "the only one"
    else:
        timings = measure_timings(backends, shape, device, MEASURED_LENGTHS)
        table, source = BackendTable.from_timings(timings), "measured"
    logger.info("attention auto (%s): %s", source, describe_table(table, timings))
    used = {name for _, name in table.rows}
    if len(used) == 1:  # one backend at every length: no dispatch per batch
        return backends[used.pop()]
    return AutoBackend({name: backends[name] for name in used}, table)


def describe_table(table: BackendTable, timings: dict[int, dict[str, float]]) -> str:
    """Each row's choice, with every backend's milliseconds where they were measured."""

    def row(bound: int, name: str) -> str:
        times = timings.get(bound, {})
        shown = ", ".join(
            f"{other} {seconds * 1e3:.3g} ms" for other, seconds in sorted(times.items(), key=lambda kv: kv[1])
        )
        return f"<={bound}: {name}" + (f" ({shown})" if shown else "")

    return "; ".join(row(bound, name) for bound, name in table.rows)


def _cpu_table(
    backends: dict[str, AttentionBackend], shape: AttentionShape, max_seq_length: int, threads: int
) -> tuple[BackendTable, dict[int, dict[str, float]], str]:
    lengths = cpu_lengths(max_seq_length)
    path = cpu_cache_path(shape, lengths, threads, sorted(backends))
    timings = read_cached_timings(path)
    if timings is not None:
        return BackendTable.from_timings(timings), timings, f"cached in {path}"
    began = time.perf_counter()
    cpu = torch.device("cpu")
    timings = _with_threads(threads, lambda: measure_timings(backends, shape, cpu, lengths, CPU_BATCH_TOKENS, True))
    table = BackendTable.from_timings(timings)
    write_cached_table(path, table.to_json(), timings)
    source = f"measured in {time.perf_counter() - began:.1f} s on {threads} thread(s), cached in {path}"
    return table, timings, source


def _with_threads(threads: int, work: Callable[[], T]) -> T:
    """`work` with this thread's intra-op count at `threads`, then the count as it was."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return work()
    finally:
        torch.set_num_threads(before)


def _cpu_backends(shape: AttentionShape) -> tuple[dict[str, AttentionBackend], dict[str, str]]:
    backends: dict[str, AttentionBackend] = {SdpaBackend.name: SdpaBackend()}
    if not cpu_varlen.supports(shape):
        return backends, {"cpu_varlen": "it needs float32 or bfloat16, head_dim a multiple of 16 and no position bias"}
    try:
        backends[CpuVarlenBackend.name] = CpuVarlenBackend()
    except BackendUnavailableError as error:  # no C compiler: said loudly, it costs speed
        logger.warning("attention auto: cpu_varlen is unavailable, SDPA only: %s", error)
        return backends, {}
    return backends, {}
