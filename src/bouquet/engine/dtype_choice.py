"""`--dtype auto` on the CPU: bfloat16 only where its matrix products are measured faster than float32's.

The probe's features say where bfloat16 products are native (AVX512-BF16 dot products, AMX tiles), not that they
are faster: on an Intel Xeon (family 6 model 207) whose hypervisor hides AMX, oneDNN's bfloat16 linear ran at
0.6x float32's speed, while on an AMD Zen 5 it ran at 2x (docs/benchmarks.md). So where the probe allows it, the
model's widest linear is timed in both dtypes, as the engine runs it (oneDNN's linear on its prepacked weight), at
a query's and at steps' worth of rows on one thread (an engine worker's share), and bfloat16 is chosen only if the
three calls took less time in it (the step's size weighs most); cached per machine and shape like the attention
table and the int8 products.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bouquet.kernels.openmp import on_passing_thread
from bouquet.layers.linear import onednn_runs
from bouquet.machine_cache import measurement_path, write_measurement

logger = logging.getLogger(__name__)

MEASURED_ROWS = (16, 256, 1024)  # a short query's rows to a step's
_TURNS = 5  # timed turns per dtype and row count, in alternation: the fastest is kept
DTYPES = ("float32", "bfloat16")


@dataclass(frozen=True)
class DtypeTimings:
    """Seconds for one call of the linear, per dtype and row count, and where they came from."""

    seconds: dict[str, dict[int, float]]
    source: str

    @property
    def bfloat16_faster(self) -> bool:
        return sum(self.seconds["bfloat16"].values()) < sum(self.seconds["float32"].values())

    def describe(self) -> str:
        rows = "/".join(str(count) for count in MEASURED_ROWS)
        timings = "; ".join(
            f"{dtype} " + " ".join(f"{self.seconds[dtype][count] * 1e3:.2f}" for count in MEASURED_ROWS)
            for dtype in DTYPES
        )
        return f"ms at {rows} rows: {timings}; {self.source}"


def linear_timings(in_features: int, out_features: int) -> DtypeTimings:
    """The cached timings of an [in, out] linear in float32 and bfloat16 on this machine, or measured now."""
    path = timings_path(in_features, out_features)
    seconds = _read_cache(path)
    if seconds is not None:
        return DtypeTimings(seconds, f"cached in {path}")
    began = time.perf_counter()
    seconds = on_passing_thread(lambda: _measure(in_features, out_features))
    write_measurement(path, {"seconds": seconds})
    return DtypeTimings(seconds, f"measured in {time.perf_counter() - began:.2f} s, cached in {path}")


def timings_path(in_features: int, out_features: int) -> Path:
    """Where this machine's timings of an [in, out] linear are cached."""
    return measurement_path("dtype", {"shape": [in_features, out_features], "rows": MEASURED_ROWS, "threads": 1})


def _measure(in_features: int, out_features: int) -> dict[str, dict[int, float]]:
    torch.set_num_threads(1)
    calls = {dtype: {rows: _linear_call(dtype, in_features, out_features, rows) for rows in MEASURED_ROWS}
             for dtype in DTYPES}  # fmt: skip
    best = {dtype: dict.fromkeys(MEASURED_ROWS, float("inf")) for dtype in DTYPES}
    for _ in range(_TURNS):
        for dtype, by_rows in calls.items():
            for rows, call in by_rows.items():
                start = time.perf_counter()
                call()
                best[dtype][rows] = min(best[dtype][rows], time.perf_counter() - start)
    return best


def _linear_call(dtype: str, in_features: int, out_features: int, rows: int) -> Callable[[], object]:
    """The engine's linear in `dtype` (layers/linear.py): oneDNN's on its prepacked weight where oneDNN takes the
    dtype on this CPU, else ATen's."""
    torch_dtype = getattr(torch, dtype)
    weight = torch.randn(out_features, in_features).to(torch_dtype)
    bias = torch.randn(out_features).to(torch_dtype)
    x = torch.randn(rows, in_features).to(torch_dtype)
    if onednn_runs(weight):
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)

        def call() -> object:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    else:

        def call() -> object:
            return torch.nn.functional.linear(x, weight, bias)

    call()  # oneDNN builds its primitive for the shape on the first call
    return call


def _read_cache(path: Path) -> dict[str, dict[int, float]] | None:
    try:
        seconds = json.loads(path.read_text())["seconds"]
        parsed = {dtype: {int(rows): float(value) for rows, value in seconds[dtype].items()} for dtype in DTYPES}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return parsed if all(set(by_rows) == set(MEASURED_ROWS) for by_rows in parsed.values()) else None
