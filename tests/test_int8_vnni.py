"""The VNNI product (kernels/int8_linear_vnni.h) gives the other products' integers exactly, at every row count a
tile or a row block takes and at shapes off its blocks; a linear on it, in one kernel call, gives what the passes
around `torch._int_mm` give, bit for bit; a CPU without AVX512-VNNI (or one emulated so) is never offered it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from bouquet.cpu_features import cpu_features
from bouquet.kernels.recording import recording
from bouquet.layers import int8_products
from bouquet.layers.int8_linear import (
    INT_MM_PRODUCT,
    int8_linear,
    int8_linear_add_norm,
    int8_product,
    quantize_weight,
    weight_range,
    with_products,
)
from bouquet.layers.vnni_product import VNNI_PRODUCT, vnni_available

needs_vnni = pytest.mark.skipif(not vnni_available(), reason=f"no AVX512-VNNI here: {cpu_features().describe()}")

# MiniLM's shapes, and shapes whose inputs end inside a group of four and outputs inside a block of 32 (602: several
# input slices where there are several row blocks, then the partial group).
_SHAPES = [(384, 1152), (1536, 384), (37, 50), (5, 3), (130, 97), (1, 33), (602, 40)]


@pytest.fixture(params=[1, 2])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(1)


@needs_vnni
def test_the_vnni_kernel_gives_the_same_integers(threads: int) -> None:
    """Rows 1-64 (every tile, wide and narrow; one row block and several, sliced) and document-sized calls (rows
    split between threads, in chunks of 72 and remainders of 1, 2 and 4 rows), codes at their extremes against
    weights at theirs, checked against int64 sums and against `torch._int_mm`."""
    generator = torch.Generator().manual_seed(5)
    for in_features, out_features in _SHAPES:
        weight = quantize_weight(torch.randn(out_features, in_features, generator=generator), None, rotate=False)
        weight.transposed[0] = 127  # an input at the bound in every channel, both signs
        weight.transposed[-1, 1::2] = -127
        ours = with_products(weight, VNNI_PRODUCT, VNNI_PRODUCT)
        assert ours.vnni is not None and ours.transposed.numel() == 0 and ours.packed is None
        exact = weight.transposed.long()
        for rows in [*range(1, 30), 31, 32, 33, 47, 63, 64, 65, 145, 148, 289]:
            codes = torch.randint(-128, 128, (rows, in_features), dtype=torch.int8, generator=generator)
            codes[0] = -128
            codes[-1, ::2] = 127
            products = int8_product(codes, ours)
            assert products.dtype == torch.int32 and products.shape == (rows, out_features)
            assert torch.equal(products.long(), codes.long() @ exact), (in_features, out_features, rows)
            if in_features % 8 == 0 and out_features % 8 == 0:  # what `torch._int_mm` takes
                assert torch.equal(products, int8_product(codes, weight)), (in_features, out_features, rows)


@needs_vnni
def test_a_linear_on_vnni_is_the_plain_linear_in_one_call(threads: int) -> None:
    """Quantizing, the product and each column group's dequantizing in one kernel call give the three passes'
    floats bit for bit: every activation, the fused add and LayerNorm, strided rows, odd shapes, rows 1-64 and
    document-sized calls (rows split between threads, in chunks)."""
    generator = torch.Generator().manual_seed(6)
    for in_features, out_features in [(384, 1536), (1536, 384), (130, 97)]:
        dense = torch.randn(out_features, in_features, generator=generator)
        weight = quantize_weight(dense, torch.randn(out_features, generator=generator))
        ours = with_products(weight, VNNI_PRODUCT, VNNI_PRODUCT)
        norm = torch.nn.LayerNorm(out_features)
        torch.nn.init.normal_(norm.weight, generator=generator)
        torch.nn.init.normal_(norm.bias, generator=generator)
        for rows in (1, 2, 5, 14, 16, 29, 64, 145, 148):
            wide = torch.randn(rows, in_features + 8, generator=generator)
            x = wide[:, 4 : 4 + in_features]  # rows a stride apart
            for activation in ("none", "gelu", "gelu_new", "relu"):
                assert torch.equal(int8_linear(x, ours, activation), int8_linear(x, weight, activation))
            residual = torch.randn(rows, out_features, generator=generator)
            fused = int8_linear_add_norm(x, ours, residual, norm)
            assert torch.equal(fused, int8_linear_add_norm(x, weight, residual, norm)), (in_features, rows)


@needs_vnni
def test_a_linear_on_vnni_is_one_recorded_kernel_call() -> None:
    """A CPU graph records the linear as the one call, and replaying it computes the linear again."""
    generator = torch.Generator().manual_seed(7)
    weight = quantize_weight(torch.randn(96, 64, generator=generator), torch.randn(96, generator=generator))
    ours = with_products(weight, INT_MM_PRODUCT, VNNI_PRODUCT, from_rows=0)
    x = torch.randn(14, 64, generator=generator)
    with recording() as program:
        out = int8_linear(x, ours, "gelu")
    assert len(program.calls) == 1
    expected = int8_linear(x, weight, "gelu")
    out.zero_()
    program.replay()
    assert torch.equal(out, expected)


@needs_vnni
def test_short_calls_take_the_vnni_kernel_below_the_crossover() -> None:
    generator = torch.Generator().manual_seed(8)
    weight = quantize_weight(torch.randn(96, 64, generator=generator), None, weight_range(VNNI_PRODUCT))
    both = with_products(weight, VNNI_PRODUCT, INT_MM_PRODUCT, from_rows=32)
    assert both.vnni is not None and both.transposed.numel() == 64 * 96
    for rows in (1, 31, 32, 100):
        x = torch.randn(rows, 64, generator=generator)
        with recording() as program:
            int8_linear(x, both)
        assert len(program.calls) == (1 if rows < 32 else 3), rows  # one call, or quantize, `_int_mm`, dequantize


@needs_vnni
def test_weights_keep_their_full_range_on_the_vnni_product() -> None:
    assert weight_range(VNNI_PRODUCT).full


@pytest.mark.parametrize(
    "features",
    [
        "avx2,fma,avx512f,avx512bw,avx512vl,avx512dq",  # AVX-512 without VNNI: weights narrowed there
        "avx2,fma,avx_vnni",  # AVX2 with VNNI: no AVX-512
    ],
)
def test_a_cpu_without_avx512_vnni_offers_no_vnni_product(monkeypatch: pytest.MonkeyPatch, features: str) -> None:
    monkeypatch.setenv("BOUQUET_CPU_FEATURES", features)
    cpu_features.cache_clear()
    try:
        assert not vnni_available() and VNNI_PRODUCT not in int8_products.available_products()
    finally:
        monkeypatch.delenv("BOUQUET_CPU_FEATURES")
        cpu_features.cache_clear()


def test_onednn_capped_at_avx2_offers_no_vnni_product(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("BOUQUET_CPU_FEATURES", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    cpu_features.cache_clear()
    try:
        assert not vnni_available() and VNNI_PRODUCT not in int8_products.available_products()
    finally:
        monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
        cpu_features.cache_clear()
