"""A layer's four MiniLM int8 linears with their epilogues, as a document step runs them: QKV (384 -> 1,152),
attention output + residual + LayerNorm (384 -> 384), intermediate + GELU (384 -> 1,536), output + residual +
LayerNorm (1,536 -> 384), all on `--product` (default: bouquet's VNNI kernel), random weights at MiniLM's shapes.
Prints a layer's median time over `--turns` turns of `--repeats` layers, ms, per row count: on one thread the
thread's CPU time (a busy machine's preemptions left out), on more the wall time. One thread count a process (a
team grown after a one-thread run measured 3x slower). To compare two trees, alternate invocations with each tree's
src on PYTHONPATH.

    PYTHONPATH=src .venv/bin/python bench/int8_layer.py [--rows 256,1024] [--threads 2] [--product vnni]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from bouquet.layers.int8_linear import Int8Weight, int8_linear, int8_linear_add_norm, quantize_weight, with_products

HIDDEN, INTERMEDIATE = 384, 1536


def _weight(generator: torch.Generator, k: int, n: int, product: str) -> Int8Weight:
    dense = torch.randn(n, k, generator=generator) * 0.05
    return with_products(quantize_weight(dense, torch.randn(n, generator=generator) * 0.1), product, product)


def _layer(product: str) -> tuple[list[Int8Weight], nn.LayerNorm]:
    generator = torch.Generator().manual_seed(0)
    shapes = ((HIDDEN, 3 * HIDDEN), (HIDDEN, HIDDEN), (HIDDEN, INTERMEDIATE), (INTERMEDIATE, HIDDEN))
    return [_weight(generator, k, n, product) for k, n in shapes], nn.LayerNorm(HIDDEN)


def run_layer(hidden: torch.Tensor, weights: list[Int8Weight], norm: nn.LayerNorm) -> torch.Tensor:
    qkv, attention_out, up, down = weights
    int8_linear(hidden, qkv)
    attended = int8_linear_add_norm(hidden, attention_out, hidden, norm)  # the context stands in for attention's
    return int8_linear_add_norm(int8_linear(attended, up, "gelu"), down, attended, norm)


def layer_ms(rows: int, threads: int, product: str, repeats: int, turns: int) -> float:
    torch.set_num_threads(threads)
    weights, norm = _layer(product)
    hidden = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        run_layer(hidden, weights, norm)
        clock = time.thread_time if threads == 1 else time.perf_counter
        times = []
        for _ in range(turns):
            start = clock()
            for _ in range(repeats):
                run_layer(hidden, weights, norm)
            times.append((clock() - start) / repeats * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="256,1024", help="comma-separated row counts")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--product", default="vnni", help="vnni, amx, int_mm or onednn")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        ms = layer_ms(rows, args.threads, args.product, args.repeats, args.turns)
        print(f"rows {rows:5d} threads {args.threads}: {ms:.3f} ms a layer", flush=True)


if __name__ == "__main__":
    main()
