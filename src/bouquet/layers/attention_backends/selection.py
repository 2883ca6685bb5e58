"""The `auto` attention backend: per max-sequence-length bucket, the backend measured fastest on this device.

The table comes from a JSON file bench/gpu_check.py writes, or is measured at start-up on the model's own
attention shape; either way the choice is logged. On the CPU `auto` is cpu_varlen, whose attention was faster
than SDPA's in every case measured (docs/benchmarks.md), or SDPA where it cannot run (no C compiler, float16,
or a head_dim that is not a multiple of 16).
"""

from __future__ import annotations

import bisect
import json
import logging
import time
from collections.abc import Hashable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import ClassVar

import torch

from bouquet.layers.attention_backends import AttentionBackend, AttentionShape, cpu_varlen, create_attention_backend
from bouquet.layers.attention_backends.base import BackendUnavailableError, describe_needs
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.context import ForwardContext

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
    """Dispatches each batch (or graph bucket) to the table's backend for its max_seqlen."""

    name: ClassVar[str] = "auto"

    def __init__(self, backends: dict[str, AttentionBackend], table: BackendTable):
        self.backends = backends
        self.table = table
        self.supports_cuda_graphs = all(b.supports_cuda_graphs for b in backends.values())  # type: ignore[misc]
        self._captured: dict[Hashable, AttentionBackend] = {}

    def bind(self, shape: AttentionShape) -> None:
        self.shape = shape  # each backend it dispatches to checks that it can run the model
        for backend in self.backends.values():
            backend.bind(shape)

    def prepare(self, ctx: ForwardContext) -> _Choice:
        backend = self.backends[self.table.choose(ctx.max_seqlen)]
        return _Choice(backend, replace(ctx, attn_metadata=backend.prepare(ctx)))

    def prepare_capture(self, ctx: ForwardContext, key: Hashable) -> _Choice:
        backend = self._captured[key] = self.backends[self.table.choose(ctx.max_seqlen)]
        return _Choice(backend, replace(ctx, attn_metadata=backend.prepare_capture(ctx, key)))

    def prepare_replay(self, ctx: ForwardContext, key: Hashable) -> None:
        self._captured[key].prepare_replay(ctx, key)

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


def time_backend(
    backend: AttentionBackend, shape: AttentionShape, seq_len: int, device: torch.device, batch_tokens: int = 8192
) -> float:
    """Seconds per call on max(1, batch_tokens // seq_len) sequences of `seq_len` tokens (median of 5)."""
    num_seqs = max(1, batch_tokens // seq_len)
    total = num_seqs * seq_len
    q = torch.randn(total, shape.num_heads, shape.head_dim, device=device, dtype=shape.dtype)
    k = torch.randn(total, shape.num_kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    v = torch.randn_like(k)
    cu_seqlens = torch.arange(0, total + 1, seq_len, dtype=torch.int32, device=device)
    ctx = ForwardContext(cu_seqlens, seq_len, [seq_len] * num_seqs)
    ctx.attn_metadata = backend.prepare(ctx)
    times = []
    for _ in range(6):  # the first call compiles or warms up and is dropped
        _synchronize(device)
        start = time.perf_counter()
        backend.forward(q, k, v, ctx, shape.causal, shape.scale)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[2]


def measure_timings(
    backends: dict[str, AttentionBackend], shape: AttentionShape, device: torch.device, lengths: tuple[int, ...]
) -> dict[int, dict[str, float]]:
    """Seconds per call, per length and backend; a backend that fails at a length is left out there."""
    timings: dict[int, dict[str, float]] = {}
    for length in lengths:
        timings[length] = {}
        for name, backend in backends.items():
            backend.bind(shape)
            try:
                timings[length][name] = time_backend(backend, shape, length, device)
            except Exception as error:  # e.g. a kernel without this head size or GPU generation
                logger.warning("attention backend %s failed at %d tokens: %s", name, length, error)
    return timings


def create_auto_backend(
    device: torch.device, shape: AttentionShape, table_path: Path | None = None
) -> AttentionBackend:
    """cpu_varlen (else SDPA) on the CPU; on a GPU, the table's (or a freshly measured table's) backend per
    length."""
    if device.type == "cpu":
        return _cpu_backend(shape)
    backends, missing = load_backends(GPU_BACKENDS)
    for name, backend in list(backends.items()):
        if not backend.can_run(shape):
            missing[name] = f"cannot run {describe_needs(shape)}"
            del backends[name]
    for name, reason in missing.items():
        logger.info("attention auto: %s not available: %s", name, reason)
    if table_path is not None:
        table = BackendTable.load(table_path).restricted_to(set(backends), SdpaBackend.name)
    else:
        table = BackendTable.from_timings(measure_timings(backends, shape, device, MEASURED_LENGTHS))
    logger.info("attention auto: %s", ", ".join(f"<={bound}: {name}" for bound, name in table.rows))
    used = {name for _, name in table.rows}
    return AutoBackend({name: backends[name] for name in used}, table)


def _cpu_backend(shape: AttentionShape) -> AttentionBackend:
    if not cpu_varlen.supports(shape):
        logger.info(
            "attention auto: sdpa (cpu_varlen needs float32 or bfloat16, head_dim a multiple of 16 and no position "
            "bias)"
        )
        return SdpaBackend()
    try:
        backend = CpuVarlenBackend()
    except BackendUnavailableError as error:
        logger.warning("attention auto: sdpa, as cpu_varlen is unavailable: %s", error)
        return SdpaBackend()
    dot = shape.dtype == torch.bfloat16 and cpu_varlen.has_bf16_dot()
    logger.info("attention auto: cpu_varlen%s", " (bfloat16 by AVX512-BF16 dot products)" if dot else "")
    return backend


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
