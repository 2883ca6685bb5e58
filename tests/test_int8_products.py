"""The two int8 products (`torch._int_mm` and oneDNN's matmul on a prepacked weight) give the same integers, and
the one a model uses is measured, cached per machine, and never timed at length where oneDNN would run its
reference loops."""

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
def test_the_product_is_measured_once_then_read_from_the_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(machine_cache, "cache_dir", lambda: tmp_path / "kernels")
    shapes = [(64, 96), (96, 64)]
    measured = int8_products.choose_int8_product(shapes, threads=1)
    (path,) = (tmp_path / "int8").glob("cpu-*.json")
    seconds = json.loads(path.read_text())["seconds"]
    assert measured == min(seconds, key=seconds.__getitem__)
    assert set(seconds) <= set(int8_products.available_products())
    if len(seconds) == 2:  # a cached measurement is what the next start takes: make the other product the faster
        other = next(name for name in seconds if name != measured)
        path.write_text(json.dumps({"seconds": {measured: 2.0, other: 1.0}}))
        assert int8_products.choose_int8_product(shapes, threads=1) == other
        assert int8_products.choose_int8_product(shapes, threads=2) == measured  # another key: measured again


def test_a_cpu_with_one_product_measures_nothing(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(machine_cache, "cache_dir", lambda: tmp_path / "kernels")
    monkeypatch.setattr(int8_products, "available_products", lambda: [INT_MM_PRODUCT])
    assert int8_products.choose_int8_product([(64, 96)], threads=1) == INT_MM_PRODUCT
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
