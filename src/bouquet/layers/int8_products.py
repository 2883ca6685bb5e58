"""Which int8 product a model's linears use on this CPU, at each call size, by measurement (`--dtype int8`).

Up to four products compute the same integers (layers/int8_linear.py): `torch._int_mm`, oneDNN's GEMM on the plain
int8 weight; oneDNN's matmul primitive on a weight prepacked in its own layout, which runs on AMX tiles where the
CPU has them; on CPUs with AMX, bouquet's own AMX kernel (layers/amx_product.py); and on CPUs with AVX512-VNNI,
bouquet's own VNNI kernel (layers/vnni_product.py). Which is fastest depends on the
CPU, the shapes and the number of rows: on an Intel Xeon with AMX the prepacked matmul was 1.4-2.9x `_int_mm` at a
1,024-token step while a 16-token query ran 1.7x faster through `_int_mm`, and the AMX kernel beat both at every
size; on CPUs without VNNI oneDNN has no fast s8 x s8 matmul at all (docs/benchmarks.md, "int8 on the CPU"). So,
as for attention: the available products are timed at start-up on the model's distinct linear shapes at a query's
to a step's worth of tokens, on the engine workers' thread count, and the plan is one product below a row count
and one from it (the same where one wins throughout), keeping each weight in the layouts those two need; the
result is cached per machine (CPU model and features, torch release, shapes, threads) like the attention table.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bouquet.kernels.openmp import on_passing_thread
from bouquet.layers.amx_product import AMX_PRODUCT, amx_available
from bouquet.layers.int8_linear import (
    INT_MM_PRODUCT,
    ONEDNN_PRODUCT,
    int8_linear,
    onednn_product_available,
    quantize_weight,
    with_products,
)
from bouquet.layers.vnni_product import VNNI_PRODUCT, vnni_available
from bouquet.machine_cache import measurement_path, write_measurement

logger = logging.getLogger(__name__)

# A short query's worth of tokens to a step's (the scheduler's CPU step budget).
MEASURED_TOKENS = (16, 64, 256, 1024)
# Timed turns per product and shape: the fastest of these is kept (other work on a shared machine only adds time).
_TURNS = 5
SLOW_PATH_FACTOR = 8
# bouquet's own kernels run a linear's epilogue (add + LayerNorm) on each chunk of rows while it is in cache, which
# the measurement (a plain linear) leaves out: served documents on the VNNI kernel were ~10% faster than on `_int_mm`
# where its plain linear measured 1-6% ahead (docs/benchmarks.md, 2026-12-05). So they win within this factor.
OWN_KERNEL_MARGIN = 1.05
OWN_KERNELS = frozenset({AMX_PRODUCT, VNNI_PRODUCT})

Shape = tuple[int, int]  # (in_features, out_features)
Seconds = dict[str, dict[int, float]]  # product -> tokens -> seconds for one call of each shape, summed


@dataclass(frozen=True)
class Int8Plan:
    """Calls of fewer than `from_rows` rows run `small`, the others `large` (`from_rows` 0: `large` only)."""

    small: str
    large: str
    from_rows: int = 0

    @property
    def products(self) -> list[str]:
        return [self.large] if self.from_rows == 0 or self.small == self.large else [self.small, self.large]

    def describe(self) -> str:
        if len(self.products) == 1:
            return self.products[0]
        return f"{self.small} below {self.from_rows} rows, {self.large} from there"


def available_products() -> list[str]:
    products = [INT_MM_PRODUCT]
    if onednn_product_available():
        products.append(ONEDNN_PRODUCT)
    if amx_available():
        products.append(AMX_PRODUCT)
    if vnni_available():
        products.append(VNNI_PRODUCT)
    return products


def choose_int8_plan(shapes: list[Shape], threads: int) -> Int8Plan:
    """The products for these linear shapes on `threads` intra-op threads: the only one available, the cached
    choice, or the one measured now (and cached)."""
    products = available_products()
    if len(products) == 1:
        return Int8Plan(products[0], products[0])
    path = _cache_path(shapes, threads, products)
    seconds = _read_cache(path)
    source = f"cached in {path}"
    if seconds is None or not set(seconds) <= set(products):
        began = time.perf_counter()
        seconds = on_passing_thread(lambda: measure_products(products, shapes, threads))
        source = f"measured in {time.perf_counter() - began:.1f} s on {threads} thread(s), cached in {path}"
        _write_cache(path, seconds)
    plan = plan_from(seconds)
    timings = "; ".join(
        f"{name} " + " ".join(f"{value * 1e3:.2f}" for _, value in sorted(by_tokens.items()))
        for name, by_tokens in sorted(seconds.items())
    )
    sizes = "/".join(str(tokens) for tokens in MEASURED_TOKENS)
    margin = f"bouquet's kernels ahead within {OWN_KERNEL_MARGIN - 1:.0%}"
    logger.info("int8 products: %s (ms at %s tokens: %s; %s; %s)", plan.describe(), sizes, timings, margin, source)
    return plan


def plan_from(seconds: Seconds) -> Int8Plan:
    """The plan that takes the least time over the measured sizes: one product throughout, or one below a
    crossover and another from it (one crossover, so that noise at one size cannot make the choice flip back and
    forth). A single product wins ties; bouquet's own kernels win within OWN_KERNEL_MARGIN."""
    seconds = {
        name: {n: value / OWN_KERNEL_MARGIN if name in OWN_KERNELS else value for n, value in by_tokens.items()}
        for name, by_tokens in seconds.items()
    }
    names = sorted(seconds)
    sizes = sorted(seconds[names[0]])
    best, best_cost = Int8Plan(names[0], names[0]), math.inf
    for name in names:  # single products first: a split must be strictly cheaper
        cost = sum(seconds[name][n] for n in sizes)
        if cost < best_cost:
            best, best_cost = Int8Plan(name, name), cost
    for small in names:
        for large in names:
            for split in range(1, len(sizes)) if small != large else ():
                cost = sum(seconds[small][n] for n in sizes[:split]) + sum(seconds[large][n] for n in sizes[split:])
                if cost < best_cost:  # the geometric middle of the two sizes
                    best, best_cost = Int8Plan(small, large, math.isqrt(sizes[split - 1] * sizes[split])), cost
    return best


def measure_products(products: list[str], shapes: list[Shape], threads: int) -> Seconds:
    """Seconds per forward of one linear of each shape, summed, per product and number of tokens (quantization
    and dequantization included: they are the same work for both, but the product's output type changes what the
    dequantization reads). Products are timed in turns, so that a slow spell falls on all."""
    torch.set_num_threads(threads)
    products = without_slow_paths(products, shapes[0])
    calls = {product: {tokens: [_linear_call(product, shape, tokens) for shape in shapes] for tokens in MEASURED_TOKENS}
             for product in products}  # fmt: skip
    best = {product: {tokens: [float("inf")] * len(shapes) for tokens in MEASURED_TOKENS} for product in products}
    for _ in range(_TURNS):
        for product, by_tokens in calls.items():
            for tokens, cases in by_tokens.items():
                for index, call in enumerate(cases):
                    start = time.perf_counter()
                    call()
                    best[product][tokens][index] = min(best[product][tokens][index], time.perf_counter() - start)
    return {product: {tokens: sum(times) for tokens, times in by_tokens.items()} for product, by_tokens in best.items()}


def without_slow_paths(products: list[str], shape: Shape) -> list[str]:
    """Those within SLOW_PATH_FACTOR of the fastest on one query-sized call of `shape`. Where the CPU lacks an
    instruction set a product wants, oneDNN falls back to reference loops 50x slower or worse: timing those at
    a step's size would add minutes to the start."""
    seconds = {}
    for product in products:
        call = _linear_call(product, shape, MEASURED_TOKENS[0])
        start = time.perf_counter()
        call()
        seconds[product] = time.perf_counter() - start
    fastest = min(seconds.values())
    return [product for product in products if seconds[product] <= SLOW_PATH_FACTOR * fastest]


def _linear_call(product: str, shape: Shape, tokens: int) -> Callable[[], object]:
    in_features, out_features = shape
    weight = quantize_weight(torch.randn(out_features, in_features), torch.randn(out_features))
    weight = with_products(weight, product, product)
    x = torch.randn(tokens, in_features)

    def call() -> object:
        return int8_linear(x, weight)

    call()  # oneDNN builds its primitive for the shape on the first call
    return call


def _cache_path(shapes: list[Shape], threads: int, products: list[str]) -> Path:
    key = {"shapes": sorted(shapes), "tokens": MEASURED_TOKENS, "threads": threads, "products": products}
    return measurement_path("int8", key)


def _read_cache(path: Path) -> Seconds | None:
    try:
        seconds = json.loads(path.read_text())["seconds"]
        return {
            str(name): {int(tokens): float(value) for tokens, value in by_tokens.items()}
            for name, by_tokens in seconds.items()
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: Path, seconds: Seconds) -> None:
    write_measurement(path, {"seconds": seconds})
