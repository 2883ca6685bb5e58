"""The two int8 products (`torch._int_mm` and oneDNN's matmul on a prepacked weight) give the same integers; which
one a call uses, by its number of rows, is measured, cached per machine, and never timed at length where oneDNN
would run its reference loops."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bouquet import machine_cache
from bouquet.cpu_features import cpu_features
from bouquet.layers import int8_products
from bouquet.layers.int8_linear import (
    INT_MM_PRODUCT,
    ONEDNN_PRODUCT,
    int8_linear,
    int8_product,
    onednn_product_available,
    pack_for_onednn,
    quantize_weight,
    weight_limit,
)

needs_onednn = pytest.mark.skipif(not onednn_product_available(), reason="torch without oneDNN's int8 matmul")


@needs_onednn
def test_both_products_give_the_same_integers() -> None:
    generator = torch.Generator().manual_seed(0)
    limit = min(weight_limit(INT_MM_PRODUCT), weight_limit(ONEDNN_PRODUCT))
    weight = quantize_weight(torch.randn(1152, 384, generator=generator), torch.randn(1152, generator=generator), limit)
    packed = pack_for_onednn(weight)
    assert packed.transposed.numel() == 0 and packed.in_features == 384  # one copy of the weight is kept
    codes = torch.randint(-128, 128, (37, 384), dtype=torch.int8, generator=generator)
    codes[0], codes[1] = 127, -128  # rows at the extremes
    plain = int8_product(codes, weight)
    onednn = int8_product(codes, packed)
    assert plain.dtype == torch.int32 and onednn.dtype == torch.float32
    assert torch.equal(onednn.to(torch.int64), plain.to(torch.int64))
    x = torch.randn(2, 19, 384, generator=generator)
    for activation in ("none", "gelu", "relu"):
        torch.testing.assert_close(int8_linear(x, packed, activation), int8_linear(x, weight, activation))


@needs_onednn
def test_a_weight_with_both_copies_takes_the_plain_product_below_its_crossover() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = quantize_weight(torch.randn(96, 64, generator=generator), None, weight_limit(ONEDNN_PRODUCT))
    both = pack_for_onednn(weight, from_rows=32)
    assert both.transposed.numel() == 64 * 96 and both.packed is not None
    short, long = (torch.randint(-128, 128, (rows, 64), dtype=torch.int8, generator=generator) for rows in (31, 32))
    assert int8_product(short, both).dtype == torch.int32  # `_int_mm`'s output
    assert int8_product(long, both).dtype == torch.float32  # oneDNN's matmul's
    for codes in (short, long):
        assert torch.equal(int8_product(codes, both).to(torch.int64), int8_product(codes, weight).to(torch.int64))


def _seconds(plain: list[float], packed: list[float]) -> dict[str, dict[int, float]]:
    return {
        INT_MM_PRODUCT: dict(zip(int8_products.MEASURED_TOKENS, plain, strict=True)),
        ONEDNN_PRODUCT: dict(zip(int8_products.MEASURED_TOKENS, packed, strict=True)),
    }


def test_the_plan_is_one_crossover_at_the_least_total_time() -> None:
    plan_from, Int8Plan = int8_products.plan_from, int8_products.Int8Plan
    assert int8_products.MEASURED_TOKENS == (16, 64, 256, 1024)
    # AMX (measured): `_int_mm` ahead on a query, the packed matmul from a few hundred tokens.
    assert plan_from(_seconds([1.0, 2.0, 6.0, 20.0], [1.5, 2.5, 4.0, 10.0])) == Int8Plan(128)
    assert plan_from(_seconds([1.0, 2.0, 6.0, 20.0], [1.5, 1.9, 4.0, 10.0])) == Int8Plan(32)
    assert plan_from(_seconds([1.0, 2.0, 3.0, 9.0], [1.5, 2.5, 4.0, 10.0])) == Int8Plan(None)
    assert plan_from(_seconds([2.0, 3.0, 6.0, 20.0], [1.5, 2.5, 4.0, 10.0])) == Int8Plan(0)
    # Noise at one size does not make the choice flip back: one crossover, the least time in all.
    assert plan_from(_seconds([1.0, 2.6, 3.5, 20.0], [1.5, 2.5, 4.0, 10.0])) == Int8Plan(512)
    only_plain = {INT_MM_PRODUCT: {16: 1.0}}
    assert plan_from(only_plain) == Int8Plan(None) and plan_from({ONEDNN_PRODUCT: {16: 1.0}}) == Int8Plan(0)
    assert Int8Plan(128).products == [INT_MM_PRODUCT, ONEDNN_PRODUCT] and Int8Plan(0).products == [ONEDNN_PRODUCT]
    assert "below 128 rows" in Int8Plan(128).describe()


@needs_onednn
def test_the_plan_is_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(machine_cache, "cache_dir", lambda: tmp_path / "kernels")
    shapes = [(64, 96), (96, 64)]
    measured = int8_products.choose_int8_plan(shapes, threads=1)
    (path,) = (tmp_path / "int8").glob("cpu-*.json")
    seconds = {
        name: {int(n): value for n, value in by.items()} for name, by in json.loads(path.read_text())["seconds"].items()
    }
    assert measured == int8_products.plan_from(seconds)
    assert set(seconds) <= set(int8_products.available_products())
    assert all(set(by_tokens) == set(int8_products.MEASURED_TOKENS) for by_tokens in seconds.values())
    if len(seconds) == 2:  # a cached measurement is what the next start takes: make it say "always packed"
        path.write_text(json.dumps({"seconds": _seconds([2.0, 3.0, 6.0, 20.0], [1.5, 2.5, 4.0, 10.0])}))
        assert int8_products.choose_int8_plan(shapes, threads=1) == int8_products.Int8Plan(0)
        int8_products.choose_int8_plan(shapes, threads=2)  # another key: measured again, into a file of its own
        assert len(list((tmp_path / "int8").glob("cpu-*.json"))) == 2


def test_a_cpu_with_one_product_measures_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(machine_cache, "cache_dir", lambda: tmp_path / "kernels")
    monkeypatch.setattr(int8_products, "available_products", lambda: [INT_MM_PRODUCT])
    assert int8_products.choose_int8_plan([(64, 96)], threads=1) == int8_products.Int8Plan(None)
    assert not (tmp_path / "int8").exists()


SLOW_PATH = """
from bouquet.layers.int8_products import available_products, measure_products
print(sorted(measure_products(available_products(), [(384, 1536), (1536, 384)], 1)))
"""


@needs_onednn
@pytest.mark.process
def test_a_reference_loop_product_is_left_out_before_a_step_sized_timing() -> None:
    """Under oneDNN's AVX-512 VNNI cap (no AMX), its s8 x s8 matmul is a reference loop (25 s for one 1,024-token
    product on one core, measured): the short probe must leave it out, or the start would take minutes."""
    if not cpu_features().has("avx512_vnni"):
        pytest.skip(f"the cap emulates a VNNI CPU only on one that has avx512_vnni: {cpu_features().describe()}")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
    result = subprocess.run([sys.executable, "-c", SLOW_PATH], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[-2] == str([INT_MM_PRODUCT])
