"""Which int8 product a model's linears use on this CPU, by measurement (`--dtype int8`).

Two products compute the same integers (layers/int8_linear.py): `torch._int_mm`, oneDNN's GEMM on the plain int8
weight, and oneDNN's matmul primitive on a weight prepacked in its own layout, which runs on AMX tiles where the
CPU has them. Which is faster depends on the CPU and the shapes: on an Intel Xeon with AMX the prepacked matmul
was 1.4-2.9x `_int_mm` at a 1,024-token step and slower at a 16-token query on the smallest linear; on CPUs
without VNNI oneDNN has no fast s8 x s8 matmul at all (docs/benchmarks.md, "int8 on the CPU"). So, as for
attention: both are timed at start-up on the model's distinct linear shapes, a step's and a query's worth of
tokens, on the engine workers' thread count, and the one with the least total time is taken; the result is
cached per machine (CPU model and features, torch release, shapes, threads) like the attention table.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bouquet.kernels.openmp import on_passing_thread
from bouquet.layers.int8_linear import (
    FULL_WEIGHT_LIMIT,
    INT_MM_PRODUCT,
    ONEDNN_PRODUCT,
    int8_linear,
    onednn_product_available,
    pack_for_onednn,
    quantize_weight,
)
from bouquet.machine_cache import measurement_path, write_measurement

logger = logging.getLogger(__name__)

# A step's worth of tokens (the scheduler's CPU step budget) and a short query's.
MEASURED_TOKENS = (1024, 16)
# Timed turns per product and shape: the fastest of these is kept (other work on a shared machine only adds time).
_TURNS = 5
SLOW_PATH_FACTOR = 8

Shape = tuple[int, int]  # (in_features, out_features)


def available_products() -> list[str]:
    return [INT_MM_PRODUCT, ONEDNN_PRODUCT] if onednn_product_available() else [INT_MM_PRODUCT]


def choose_int8_product(shapes: list[Shape], threads: int) -> str:
    """The product for these linear shapes on `threads` intra-op threads: the only one available, the cached
    choice, or the faster one measured now (and cached)."""
    products = available_products()
    if len(products) == 1:
        return products[0]
    path = _cache_path(shapes, threads, products)
    seconds = _read_cache(path)
    source = f"cached in {path}"
    if seconds is None or set(seconds) != set(products):
        began = time.perf_counter()
        seconds = on_passing_thread(lambda: measure_products(products, shapes, threads))
        source = f"measured in {time.perf_counter() - began:.1f} s on {threads} thread(s), cached in {path}"
        _write_cache(path, seconds)
    chosen = min(seconds, key=seconds.__getitem__)
    timings = ", ".join(f"{name} {value * 1e3:.2f} ms" for name, value in sorted(seconds.items()))
    logger.info("int8 products: %s (%s; %s)", chosen, timings, source)
    return chosen


def measure_products(products: list[str], shapes: list[Shape], threads: int) -> dict[str, float]:
    """Seconds per forward of one linear of each shape at each of MEASURED_TOKENS, summed, per product
    (quantization and dequantization included: they are the same work for both, but the product's output type
    changes what the dequantization reads). Products are timed in turns, so that a slow spell falls on all."""
    torch.set_num_threads(threads)
    products = _without_slow_paths(products, shapes[0])
    calls = {product: [_linear_call(product, shape, tokens) for shape in shapes for tokens in MEASURED_TOKENS]
             for product in products}  # fmt: skip
    best = {product: [float("inf")] * len(cases) for product, cases in calls.items()}
    for _ in range(_TURNS):
        for product, cases in calls.items():
            for index, call in enumerate(cases):
                start = time.perf_counter()
                call()
                best[product][index] = min(best[product][index], time.perf_counter() - start)
    return {product: sum(times) for product, times in best.items()}


def _without_slow_paths(products: list[str], shape: Shape) -> list[str]:
    """Those within SLOW_PATH_FACTOR of the fastest on one query-sized call of `shape`. Where the CPU lacks an
    instruction set a product wants, oneDNN falls back to reference loops 50x slower or worse: timing those at
    a step's size would add minutes to the start."""
    seconds = {}
    for product in products:
        call = _linear_call(product, shape, MEASURED_TOKENS[-1])
        start = time.perf_counter()
        call()
        seconds[product] = time.perf_counter() - start
    fastest = min(seconds.values())
    return [product for product in products if seconds[product] <= SLOW_PATH_FACTOR * fastest]


def _linear_call(product: str, shape: Shape, tokens: int) -> Callable[[], object]:
    in_features, out_features = shape
    weight = quantize_weight(torch.randn(out_features, in_features), torch.randn(out_features), FULL_WEIGHT_LIMIT)
    if product == ONEDNN_PRODUCT:
        weight = pack_for_onednn(weight)
    x = torch.randn(tokens, in_features)

    def call() -> object:
        return int8_linear(x, weight)

    call()  # oneDNN builds its primitive for the shape on the first call
    return call


def _cache_path(shapes: list[Shape], threads: int, products: list[str]) -> Path:
    key = {"shapes": sorted(shapes), "tokens": MEASURED_TOKENS, "threads": threads, "products": products}
    return measurement_path("int8", key)


def _read_cache(path: Path) -> dict[str, float] | None:
    try:
        return {str(name): float(value) for name, value in json.loads(path.read_text())["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: Path, seconds: dict[str, float]) -> None:
    write_measurement(path, {"seconds": seconds})
