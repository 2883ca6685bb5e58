"""The float32 short-step kernel (layers/f32_short.py) against oneDNN's packed linear, one thread, at MiniLM's four
linear shapes and a query's row counts: each shape's weight alone (it stays in L2), and "a layer": the four shapes of
six distinct layers in turn, so that the weights stream from L3 as in the model. The two are alternated turn by turn;
medians of the turns in thread CPU time (a busy machine's preemptions left out), us a call (a layer: a set of its
four). The kernel runs in the ISA the CPU probe grants, so on an AVX-512 machine `ONEDNN_MAX_CPU_ISA=AVX2
ATEN_CPU_CAPABILITY=avx2` runs both sides' AVX2 code (not an AVX2 CPU's speed).

    ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python bench/f32_short.py [--rows 1,8,14,16,32,64]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from bouquet.cpu_features import cpu_features
from bouquet.layers import f32_short

SHAPES = ((384, 1152), (384, 384), (384, 1536), (1536, 384))  # (in, out): QKV, attention output, MLP in, MLP out
LAYERS = 6
Linear = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # ours packed, oneDNN's packed, bias


def make_linear(k: int, n: int) -> Linear:
    weight = torch.randn(n, k) * 0.05
    return f32_short.pack(weight), torch.ops.mkldnn._reorder_linear_weight(weight), torch.randn(n)


def ours(x: torch.Tensor, linear: Linear) -> None:
    f32_short.f32_linear(x, linear[0], linear[2].shape[0], linear[2])


def onednn(x: torch.Tensor, linear: Linear) -> None:
    torch.ops.mkldnn._linear_pointwise(x, linear[1], linear[2], "none", [], "")


def calls(run: Callable[[torch.Tensor, Linear], None], work: list[tuple[torch.Tensor, Linear]]) -> Callable[[], None]:
    def go() -> None:
        for x, linear in work:
            run(x, linear)

    return go


def alternated_us(works: list[Callable[[], None]], repeats: int, turns: int) -> list[float]:
    """Each work's median over `turns` alternated turns of `repeats` runs, us a run."""
    for work in works:
        work()
    times: list[list[float]] = [[] for _ in works]
    for _ in range(turns):
        for work, kept in zip(works, times, strict=True):
            start = time.thread_time()
            for _ in range(repeats):
                work()
            kept.append((time.thread_time() - start) / repeats * 1e6)
    return [statistics.median(kept) for kept in times]


def cell(pair: list[float]) -> str:
    return f"{pair[0]:,.1f} / {pair[1]:,.1f} ({pair[1] / pair[0]:.2f}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,8,14,16,32,64")
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    aten = torch.backends.cpu.get_cpu_capability()
    print(f"CPU: {cpu_features().describe()}; kernel ISA {f32_short.kernel_isa()}; ATen {aten}")
    layers = [[make_linear(k, n) for k, n in SHAPES] for _ in range(LAYERS)]
    print("us a call, ours / oneDNN's (oneDNN / ours)")
    print("| rows | " + " | ".join(f"{k}->{n}" for k, n in SHAPES) + " | a layer (from L3) |")
    print("|---" * (len(SHAPES) + 2) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = [torch.randn(rows, k) for k, _ in SHAPES]
        cells = []
        for x, linear in zip(inputs, layers[0], strict=True):
            work = [(x, linear)]
            cells.append(cell(alternated_us([calls(ours, work), calls(onednn, work)], args.repeats, args.turns)))
        stream = [(x, linear) for layer in layers for x, linear in zip(inputs, layer, strict=True)]
        both = alternated_us([calls(ours, stream), calls(onednn, stream)], max(1, args.repeats // LAYERS), args.turns)
        cells.append(cell([t / LAYERS for t in both]))
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
