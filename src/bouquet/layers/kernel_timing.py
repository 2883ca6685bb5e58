"""Timing a linear kernel of bouquet's own against oneDNN's on a model's shapes, for the choices made at load
(layers/f32_short.py, layers/bf16_amx.py): the same calls, the two alternated turn by turn so that a busy spell on
a shared machine weighs on both alike."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

Linears = list[tuple[torch.Tensor, torch.Tensor]]  # (packed weight, bias) per shape


def onednn_linears(inputs: list[torch.Tensor], packed: Linears) -> None:
    """One call of oneDNN's linear on each packed weight (`torch.ops.mkldnn._reorder_linear_weight`'s)."""
    for x, (weight, bias) in zip(inputs, packed, strict=True):
        torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def alternated_seconds(
    *works: Callable[[], object], turns: int = 7, summary: Callable[[list[float]], float] = statistics.median
) -> list[float]:
    """Each work's time over `turns` alternated runs, summarised (the median, or `min`: the least disturbed run),
    after one untimed run each (oneDNN builds its primitive for a shape on its first call)."""
    for work in works:
        work()
    times: list[list[float]] = [[] for _ in works]
    for _ in range(turns):
        for work, kept in zip(works, times, strict=True):
            start = time.perf_counter()
            work()
            kept.append(time.perf_counter() - start)
    return [summary(kept) for kept in times]
