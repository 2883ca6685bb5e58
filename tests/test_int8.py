"""`--dtype int8` on the CPU: the kernels against exact references, the quantization's rules (per-channel weights,
per-token activations, weights narrowed where the CPU's products saturate), and the quality gate, loosely: every
family's rows against its own float32 rows by cosine (bench/int8_quality.py prints the full gate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import embed_ids, row_cosines
from corpus import documents, queries
from family_models import FAMILIES, build_family
from sparse_models import build_splade

from bouquet.config import EngineConfig
from bouquet.cpu_features import cpu_features
from bouquet.engine.cpu_graphs import SHORT_QUERY_TOKENS
from bouquet.engine.engine import Engine
from bouquet.gateway.testing import Process, free_port, start_serve
from bouquet.layers import int8_linear as int8_linear_module
from bouquet.layers.int8_linear import (
    FULL_RANGE,
    INT_MM_PRODUCT,
    PAIRED_RANGE,
    REDUCED_RANGE,
    Int8Rows,
    Int8Weight,
    dequantize,
    input_rotation,
    int8_linear,
    int8_linear_add_norm,
    quantize_rows,
    quantize_weight,
    weight_range,
)
from bouquet.layers.int8_products import Int8Plan
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.tokenizer import TextTokenizer

REFERENCE_ACTIVATIONS = {
    "none": lambda y: y,
    "gelu": F.gelu,
    "gelu_new": lambda y: F.gelu(y, approximate="tanh"),
    "relu": F.relu,
}


def _reference_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric per row: [min(row, 0), max(row, 0)] onto [-128, 127], x ~ scale * (q - zero)."""
    lo, hi = x.amin(dim=1).clamp(max=0), x.amax(dim=1).clamp(min=0)
    scales = (hi - lo) / 255
    inverse = torch.where(hi > lo, 255 / (hi - lo), torch.zeros_like(hi))
    zeros = (-lo * inverse).round() - 128
    q = ((x * inverse[:, None]).round() + zeros[:, None]).clamp(-128, 127)
    return q.to(torch.int8), scales, zeros.to(torch.int32)


def test_rows_quantize_per_token_like_the_reference() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(70, 97, generator=generator) * torch.rand(70, 1, generator=generator) * 10
    x[3] = 0.0  # an all-zero row: scale 0, every value at the zero point
    x[5, 7] = 500.0  # an outlier token keeps its own scale; the others keep theirs
    x[6] = x[6].abs() + 1  # a row of one sign still holds 0 in its range
    strided = torch.cat([x, torch.randn(70, 5)], dim=1)[:, :97]  # rows one stride apart, as a view
    rows = quantize_rows(strided)
    expected_q, expected_scales, expected_zeros = _reference_rows(x)
    torch.testing.assert_close(rows.scales, expected_scales)
    assert (rows.zeros - expected_zeros).abs().max() <= 1  # a half may round the other way: one step at most
    assert (rows.values.int() - expected_q.int()).abs().max() <= 1
    assert (rows.values != expected_q).float().mean() < 0.01
    assert torch.all(rows.values[3].int() == rows.zeros[3]) and rows.scales[3] == 0  # q - zero = 0
    assert rows.zeros[6] == -128 and rows.values[6].min() > -128
    error = (rows.scales[:, None] * (rows.values.float() - rows.zeros[:, None]) - x).abs()
    assert (error <= rows.scales[:, None] * 0.5001 + 1e-6).all()  # within half a step of each row's own scale


AVX2_CPU = "sse4_1,avx,avx2,fma,f16c,bmi1,bmi2"  # what the probe says of an AVX2-only CPU


@pytest.fixture(params=["avx512", "avx2"])
def passes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The passes' loops a CPU of that kind takes: AVX-512's own (where this CPU has it), or, with the probe
    overridden to an AVX2 CPU, the clones' plain C (the erf GELU, GCC's codes), as on that CPU."""
    if request.param == "avx2":
        monkeypatch.setenv("BOUQUET_CPU_FEATURES", AVX2_CPU)
    elif not cpu_features().has("avx512f"):
        pytest.skip("needs a CPU with avx512f")
    cpu_features.cache_clear()
    int8_linear_module._library.cache_clear()
    assert int8_linear_module._library().bouquet_passes_avx512() == (request.param == "avx512")
    yield request.param
    monkeypatch.delenv("BOUQUET_CPU_FEATURES", raising=False)
    cpu_features.cache_clear()
    int8_linear_module._library.cache_clear()
    int8_linear_module._library()  # the real probe's answer back in the kernel


@pytest.mark.usefixtures("passes")
def test_rows_quantize_to_the_references_codes_exactly_at_every_width() -> None:
    """The quantizing pass's codes (AVX-512's own loop, kernels/int8_linear_codes.h, or the plain C) are the float32
    reference's bit for bit: rounded half to even, clamped; every row width up to 40 (each partial group of lanes),
    MiniLM's, rows with values at halves of a step, NaN to -128 (through the clamp's operand order)."""
    generator = torch.Generator().manual_seed(3)
    for width in [*range(1, 41), 97, 384, 1536]:
        x = torch.randn(9, width, generator=generator) * torch.rand(9, 1, generator=generator) * 10
        x[1] = 0.0
        x[2] = torch.arange(width) * 0.5 - width / 4  # halves of a step where the scale is 1/255 of the range
        codes, _, zeros = _reference_rows(x)
        rows = quantize_rows(x)
        assert torch.equal(rows.values, codes) and torch.equal(rows.zeros, zeros), width
    x = torch.tensor([[1.0, float("nan"), -2.0, 3.0]])
    assert quantize_rows(x).values[0, 1] == -128


@pytest.mark.usefixtures("passes")
@pytest.mark.parametrize("activation", list(REFERENCE_ACTIVATIONS))
def test_dequantize_applies_zero_points_scales_bias_and_activation_in_place(activation: str) -> None:
    generator = torch.Generator().manual_seed(1)
    products = torch.randint(-200_000, 200_000, (33, 70), dtype=torch.int32, generator=generator)
    rows = quantize_rows(torch.randn(33, 16, generator=generator))
    weight = quantize_weight(torch.randn(70, 16, generator=generator), torch.randn(70, generator=generator))
    centred = products.double() - rows.zeros[:, None].double() * weight.sums.double()
    expected = centred * rows.scales[:, None].double() * weight.scales.double() + weight.bias.double()
    expected = REFERENCE_ACTIVATIONS[activation](expected).float()
    out = dequantize(products, rows, weight, activation)
    assert out.data_ptr() == products.data_ptr()  # the int32 buffer, now float32
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


def _dequantized_gelu(x: torch.Tensor, float_products: bool) -> torch.Tensor:
    """GELU of x by the dequantizing pass: products 0 at zero point 0, unit scales, x as the bias."""
    channels = x.numel()
    weight = Int8Weight(torch.empty(0, 0, dtype=torch.int8), torch.ones(channels),
                        torch.zeros(channels, dtype=torch.int32), x.clone(), 1)  # fmt: skip
    rows = Int8Rows(torch.zeros(1, 1, dtype=torch.int8), torch.ones(1), torch.zeros(1, dtype=torch.int32))
    products = torch.zeros(1, channels, dtype=torch.float32 if float_products else torch.int32)
    return dequantize(products, rows, weight, "gelu")[0]


@pytest.mark.usefixtures("passes")
@pytest.mark.parametrize("float_products", [False, True])
def test_the_int8_gelu_is_within_5e_7_of_gelu_everywhere(float_products: bool) -> None:
    """The pass's GELU (a table of polynomials in AVX-512, kernels/int8_linear_gelu.h; erf elsewhere) on a dense grid
    of float32 values and its edges: within 5e-7 of float64's GELU, 1.5e-6 of torch's float32 one (itself 1.2e-6
    from float64's), exactly 0 and x past the table's range, NaN only for NaN and -inf."""
    grid = torch.linspace(-12, 12, 2_400_007)  # steps of 1e-5; a length off the 16-lane groups
    edges = torch.tensor([5.4, -5.4, 5.3999, -5.3999, 0.0, 1e-30, -1e-30, 100.0, -100.0, 3e38, -3e38])
    out = _dequantized_gelu(torch.cat([grid, edges]), float_products)
    exact = grid.double() * 0.5 * torch.erfc(-grid.double() / 2**0.5)
    assert (out[: grid.numel()].double() - exact).abs().max() <= 5e-7
    assert (out[: grid.numel()] - F.gelu(grid)).abs().max() <= 1.5e-6
    assert not out.isnan().any()
    assert torch.equal(out[-4:], torch.tensor([100.0, 0.0, 3e38, 0.0]))
    special = _dequantized_gelu(torch.tensor([float("nan"), float("inf"), float("-inf")]), float_products)
    assert special[0].isnan() and special[1] == float("inf") and special[2].isnan()


def test_an_int8_linear_is_exact_integer_arithmetic_and_close_to_float32() -> None:
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(40, 384, generator=generator)
    w = torch.randn(1152, 384, generator=generator) * 0.05
    b = torch.randn(1152, generator=generator)
    codes = weight_range()  # narrowed where this CPU's products would saturate at full range
    weight = quantize_weight(w, b, codes, rotate=False)
    assert weight.transposed.dtype == torch.int8 and weight.transposed.shape == (384, 1152)
    if codes.full:
        assert torch.equal(weight.scales, w.abs().amax(dim=1) / codes.limit)  # per output channel
    assert torch.equal(weight.sums, weight.transposed.sum(dim=0, dtype=torch.int32))
    rows = quantize_rows(x)
    centred = rows.values.long() - rows.zeros[:, None].long()
    exact = (centred @ weight.transposed.long()).double() * rows.scales[:, None].double() * weight.scales.double()
    y = int8_linear(x[None], weight)[0]  # leading dimensions kept
    torch.testing.assert_close(y, (exact + b.double()).float(), rtol=1e-5, atol=1e-5)
    reference = F.linear(x, w, b)
    assert (y - reference).norm() / reference.norm() < (0.02 if codes.full else 0.03)


@pytest.mark.parametrize("width", [384, 1536, 24, 7])
def test_the_input_rotation_is_orthogonal_and_the_quantizing_pass_applies_it(width: int) -> None:
    rotation = input_rotation(width)
    assert width % rotation.block == 0 and rotation.block <= 128
    matrix = rotation.apply(torch.eye(width))
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(width), atol=1e-6, rtol=0)
    torch.testing.assert_close(matrix.abs().max(), torch.tensor(rotation.block**-0.5))  # each value spread evenly
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(30, width, generator=generator)
    x[:, 0] *= 40  # an outlier channel, as a normalised residual stream has
    strided = torch.cat([x, torch.randn(30, 3)], dim=1)[:, :width]
    rows = quantize_rows(strided, rotation)
    rotated = x @ matrix
    error = (rows.scales[:, None] * (rows.values.float() - rows.zeros[:, None]) - rotated).abs()
    assert (error <= rows.scales[:, None] * 0.5001 + 1e-4).all()  # within half a step of the rotated row's scale


def _float_product(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The float32 product of x (rotated as the weight is) with the weight's int8 values dequantized: all of the
    int8 linear but the activation rows' rounding."""
    rotated = x if weight.rotation is None else weight.rotation.apply(x)
    return F.linear(rotated, weight.transposed.t().float() * weight.scales[:, None], weight.bias)


def test_a_rotated_int8_linear_computes_the_same_product_closer_to_float32() -> None:
    """The rotation acts on the activation rows' rounding (fixed outlier channels no longer set every token's
    scale), so that part is measured apart: the weights' own rounding, narrowed where the CPU has no VNNI, is as
    large with or without it and would otherwise hide the rows' gain in the total."""
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(64, 384, generator=generator)
    x[:, [5, 99, 223]] *= 15  # fixed outlier channels set every token's scale unless rotated away
    w = torch.randn(1152, 384, generator=generator) * 0.05
    b = torch.randn(1152, generator=generator)
    codes = weight_range()
    rotated = quantize_weight(w, b, codes)
    assert rotated.rotation is not None and rotated.rotation.block == 128
    reference = F.linear(x, w, b)
    errors, row_errors = {}, {}
    for name, weight in (("rotated", rotated), ("plain", quantize_weight(w, b, codes, rotate=False))):
        y = int8_linear(x, weight)
        errors[name] = float((y - reference).norm() / reference.norm())
        row_errors[name] = float((y - _float_product(x, weight)).norm() / reference.norm())
    assert row_errors["rotated"] < 0.4 * row_errors["plain"], row_errors
    assert errors["rotated"] < errors["plain"], errors


@pytest.mark.parametrize(("rows", "in_features", "out_features"), [(3, 384, 384), (200, 1536, 384), (17, 64, 96)])
def test_the_fused_add_and_layernorm_match_torchs_after_the_int8_linear(
    rows: int, in_features: int, out_features: int
) -> None:
    """A post-norm block's end in one pass (kernels/int8_linear.c): the same as the int8 linear, torch's add and
    torch's LayerNorm, to float32 rounding; and Linear.add_norm takes the fused path only in int8."""
    generator = torch.Generator().manual_seed(rows)
    weight = quantize_weight(torch.randn(out_features, in_features, generator=generator), torch.randn(out_features),
                             weight_range())  # fmt: skip
    x = torch.randn(rows, in_features, generator=generator)
    residual = torch.randn(rows, out_features, generator=generator) * 3
    norm = torch.nn.LayerNorm(out_features, eps=1e-12)
    torch.nn.init.normal_(norm.weight, generator=generator)
    torch.nn.init.normal_(norm.bias, generator=generator)
    expected = norm(residual + int8_linear(x, weight))
    torch.testing.assert_close(int8_linear_add_norm(x, weight, residual, norm), expected, atol=1e-5, rtol=1e-5)
    linear = Linear(in_features, out_features)
    float32 = linear.add_norm(x, residual, norm)
    torch.testing.assert_close(float32, norm(residual + linear(x)))
    linear.quantize_int8(weight_range(), Int8Plan(INT_MM_PRODUCT, INT_MM_PRODUCT))
    torch.testing.assert_close(linear.add_norm(x, residual, norm), norm(residual + linear(x)), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(linear.add_norm(x, residual, norm), float32, atol=1e-6)  # int8 ran


def test_the_weight_range_is_full_where_products_are_exact() -> None:
    if not cpu_features().vnni:
        pytest.skip(f"this CPU has no VNNI (avx512_vnni or avx_vnni): {cpu_features().describe()}")
    assert weight_range() == FULL_RANGE


@pytest.mark.parametrize("in_features", [384, 1536, 65])
def test_paired_weights_keep_each_pair_within_its_bound_and_round_finer_than_7_bits(in_features: int) -> None:
    """PAIRED_RANGE (CPUs without VNNI): every channel's adjacent pairs sum to 128 or less in magnitude, the bound
    reached in each channel (the scale is its largest pair's, or its largest weight's at 127), and the weight's
    rounding error is below 7-bit weights' on a rotated weight like a model's."""
    generator = torch.Generator().manual_seed(in_features)
    w = torch.randn(256, in_features, generator=generator) * 0.05
    paired = quantize_weight(w, None, PAIRED_RANGE)
    codes = paired.transposed.t().long()
    even = in_features // 2 * 2
    pair_sums = codes[:, :even].abs().view(256, -1, 2).sum(dim=2)
    assert pair_sums.max() <= 128 and codes.abs().max() <= 127
    assert bool(((pair_sums.amax(dim=1) >= 127) | (codes.abs().amax(dim=1) == 127)).all())
    assert torch.equal(paired.sums, codes.sum(dim=1).int())
    rotated = paired.rotation.apply(w) if paired.rotation is not None else w
    errors = {}
    for name, weight in (("paired", paired), ("7-bit", quantize_weight(w, None, REDUCED_RANGE))):
        errors[name] = float((weight.transposed.t().float() * weight.scales[:, None] - rotated).norm())
    assert errors["paired"] < 0.85 * errors["7-bit"], errors


NO_VNNI = """
import logging
import numpy as np
from bouquet.batch import Batch
from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.layers.int8_linear import weight_range
from bouquet.layers.linear import QKVLinear
logging.basicConfig(level=logging.INFO)
codes = weight_range()
print(codes.limit, codes.pair_sum)
ids = [[101, 7592, 2088, 102], [101, 2023, 2003, 1037, 3231, 1997, 1996, 2173, 102]]
rows = {}
for dtype in ("int8", "float32"):
    engine = Engine(EngineConfig(default_model_path(), "cpu", dtype, cpu_warmup_tokens=32))
    rows[dtype] = engine.embed(Batch.pack(ids))
    if dtype == "int8":
        qkv = [m for m in engine.model.modules() if isinstance(m, QKVLinear)]
        print(len(qkv), sum(m.int8 is None for m in qkv))
    engine.close()
a, b = rows["int8"], rows["float32"]
print(float(((a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)).min()))
"""


# AVX2's case in the default run; AVX-512 without VNNI in CI's long tier (the default run's ~10 minutes)
@pytest.mark.parametrize("isa", [pytest.param("AVX512_CORE", marks=pytest.mark.long), "AVX2"])
@pytest.mark.process
def test_a_cpu_without_vnni_takes_paired_weights_and_keeps_quality(tmp_path, isa: str) -> None:
    """Without VNNI oneDNN multiplies by vpmaddubsw, whose pair sums saturate at full-range weights: measured at
    load, each adjacent pair of weights then sums to 128 at most, the QKV projections stay float32, and the rows
    stay within the gate; a
    lone query's steps are still captured as CPU graphs at start (oneDNN's float32 linear recorded as a call)."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": isa, "BOUQUET_CACHE_DIR": str(tmp_path)}
    if isa == "AVX2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    env.pop("BOUQUET_CPU_FEATURES", None)
    result = subprocess.run([sys.executable, "-c", NO_VNNI], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    limit, pair_sum, qkv, kept_float, cosine = result.stdout.split()
    assert (limit, pair_sum) == ("127", "128") and "adjacent pairs' |w| summed <= 128" in result.stderr
    assert qkv == kept_float == "6"  # the QKV projections stay float32 with narrowed weights
    assert float(cosine) >= 0.99
    shapes = min(SHORT_QUERY_TOKENS, 32)  # the script's warm-up
    assert f"CPU graphs: {shapes} of a lone query's shapes captured at start" in result.stderr


def _family_rows(model_path: Path, dtype: str, texts: list[str]) -> tuple[np.ndarray, Engine]:
    engine = Engine(EngineConfig(model_path=model_path, device="cpu", dtype=dtype, cpu_warmup_tokens=0))
    try:
        ids = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length).encode(texts)
        return embed_ids(engine, ids), engine
    finally:
        engine.close()


def test_minilm_in_int8_meets_the_quality_gate(minilm_path: Path) -> None:
    texts = [*documents(24), *queries(24)]  # documents run past the 256-token limit: truncated
    int8_rows, engine = _family_rows(minilm_path, "int8", texts)
    float_rows, _ = _family_rows(minilm_path, "float32", texts)
    cosines = row_cosines(int8_rows, float_rows)
    assert cosines.min() >= 0.99 and cosines.mean() >= 0.997
    linears = [module for module in engine.model.modules() if isinstance(module, Linear)]
    float_qkv = not weight_range().full  # narrowed weights: the QKV projections stay float32
    quantized = [linear for linear in linears if not (float_qkv and isinstance(linear, QKVLinear))]
    assert len(linears) == 6 * 4 and len(quantized) == (18 if float_qkv else 24)
    assert all(linear.int8 is not None for linear in quantized)
    assert all(linear.weight.numel() == 0 and linear.packed_weight is None for linear in quantized)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_in_int8_stays_close_to_its_float32(tmp_path, minilm_path: Path, family: str) -> None:
    model_path = build_family(family, tmp_path, minilm_path, tiny=True)
    texts = [*documents(6), *queries(6)]
    int8_rows, _ = _family_rows(model_path, "int8", texts)
    float_rows, _ = _family_rows(model_path, "float32", texts)
    assert row_cosines(int8_rows, float_rows).min() >= 0.98  # random tiny weights: looser than a trained model


def test_a_sparse_model_keeps_its_vocabulary_head_in_float32(tmp_path, minilm_path: Path) -> None:
    model_path = build_splade(tmp_path, minilm_path)
    engine = Engine(EngineConfig(model_path=model_path, device="cpu", dtype="int8", cpu_warmup_tokens=0))
    try:
        head = engine.pooler.sparse_head
        head_linears = [module for module in head.modules() if isinstance(module, Linear)]
        assert head_linears and all(linear.int8 is None for linear in head_linears)
        body = [m for m in engine.model.modules() if isinstance(m, Linear) and all(m is not h for h in head_linears)]
        if not weight_range().full:  # narrowed weights: the QKV projections stay float32
            body = [linear for linear in body if not isinstance(linear, QKVLinear)]
        assert body and all(linear.int8 is not None for linear in body)
    finally:
        engine.close()


def test_int8_is_cpu_only() -> None:
    with pytest.raises(ValueError, match="int8 runs on the CPU only"):
        EngineConfig(model_path=Path("."), device="cuda", dtype="int8")


@pytest.mark.process
def test_a_served_int8_model_says_so_and_embeds(minilm_path: Path) -> None:
    port = free_port()
    process: Process = start_serve(port, "--device", "cpu", "--dtype", "int8")
    try:
        process.wait_ready()
        base = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(f"{base}/info", timeout=60) as reply:
            assert json.loads(reply.read())["model_dtype"] == "int8"
        with urllib.request.urlopen(f"{base}/v1/models", timeout=60) as reply:
            assert [card["dtype"] for card in json.loads(reply.read())["data"]] == ["int8"]
        body = json.dumps({"input": ["a query", "a document"], "model": minilm_path.name}).encode()
        request = urllib.request.Request(f"{base}/v1/embeddings", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            rows = np.array([item["embedding"] for item in json.loads(reply.read())["data"]])
        float_rows, _ = _family_rows(minilm_path, "float32", ["a query", "a document"])
        assert row_cosines(rows, float_rows).min() >= 0.99
    finally:
        assert process.stop() == 0


def test_small_calls_reuse_their_threads_buffers_without_mixing_results() -> None:
    """Calls of up to 64 rows quantize into buffers kept per thread and shape: two threads running the same shapes
    at once, and one thread alternating shapes, each get exactly what a fresh call gives."""
    import threading

    generator = torch.Generator().manual_seed(11)
    codes = weight_range()
    weights = [quantize_weight(torch.randn(96, width, generator=generator), None, codes) for width in (64, 128)]
    inputs = [[torch.randn(rows, weight.in_features, generator=generator) for rows in (3, 16, 64, 65)]
              for weight in weights]  # fmt: skip
    expected = [[int8_linear(x, weight).clone() for x in xs] for weight, xs in zip(weights, inputs, strict=True)]
    wrong: list[str] = []

    def run(order: int) -> None:
        for turn in range(100):
            for w in range(2):
                index = (w + order + turn) % 2
                for x, want in zip(inputs[index], expected[index], strict=True):
                    if not torch.equal(int8_linear(x, weights[index]), want):
                        wrong.append(f"thread {order}, weight {index}, {x.shape[0]} rows")

    threads = [threading.Thread(target=run, args=(order,)) for order in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not wrong, wrong[:5]
    from bouquet.layers import int8_linear as module

    kept: list[object] = []
    for _ in range(2):  # each thread its own buffers, the same ones on every call of that shape
        thread = threading.Thread(target=lambda: kept.extend(module._scratch_rows(16, 64) for _ in range(2)))
        thread.start()
        thread.join()
    assert kept[0] is kept[1] and kept[2] is kept[3] and kept[0] is not kept[2]
    assert module._scratch_rows(65, 64) is not module._scratch_rows(65, 64)  # past 64 rows: fresh every call
