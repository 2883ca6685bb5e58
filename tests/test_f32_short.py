"""float32 linears of short steps (layers/f32_short.py, kernels/int8_linear_f32.h): against float64 products within
float32's rounding, with each activation and the fused add and LayerNorm; the Linear's routing by rows; the choice
measured once per machine and shape, and never made on a CPU without AVX-512; MiniLM's lone query recorded whole
as a CPU graph. Skipped, saying why, on CPUs without AVX-512."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bouquet.batch import Batch
from bouquet.config import create_engine_config
from bouquet.cpu_features import cpu_features
from bouquet.engine.engine import Engine
from bouquet.kernels.recording import recording
from bouquet.layers import f32_short
from bouquet.layers.linear import Linear, LinearActivation, use_f32_short_linears

pytestmark = pytest.mark.skipif(not f32_short.available(), reason="needs AVX-512 (avx512f, bw, vl, dq)")

REFERENCE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "none": lambda y: y,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "relu": torch.relu,
}


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def within_float32_rounding(got: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor) -> bool:
    """|got - expected| within a few float32 ulps of the sum of the terms' magnitudes (a float32 dot product's bound,
    far inside what a wrong element or a lost term would be)."""
    return bool(((got.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all())


def on_threads(threads: int, work: Callable[[], torch.Tensor]) -> torch.Tensor:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return work()
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize("activation", sorted(REFERENCE_ACTIVATIONS))
@pytest.mark.parametrize(
    ("rows", "inputs", "outputs"),
    [(1, 384, 1152), (3, 384, 384), (14, 384, 1536), (16, 1536, 384), (5, 37, 50), (29, 100, 17), (64, 64, 96)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_products_are_float32_linears(activation: str, rows: int, inputs: int, outputs: int, threads: int) -> None:
    weight, bias, x = randn(outputs, inputs, seed=1, scale=0.05), randn(outputs, seed=2), randn(rows, inputs, seed=3)
    summed = F.linear(x.double(), weight.double(), bias.double())
    packed = f32_short.pack(weight)
    got = on_threads(threads, lambda: f32_short.f32_linear(x, packed, outputs, bias, activation))
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    magnitude = F.linear(x.abs().double(), weight.abs().double(), bias.abs().double())
    assert within_float32_rounding(got, REFERENCE_ACTIVATIONS[activation](summed), magnitude)


def test_strided_rows_leading_dimensions_and_no_bias() -> None:
    weight, x = randn(40, 64, seed=4), randn(3, 7, 128, seed=5)[..., 32:96]  # rows 128 apart
    got = f32_short.f32_linear(x, f32_short.pack(weight), 40, None)
    assert got.shape == (3, 7, 40)
    assert within_float32_rounding(got, F.linear(x.double(), weight.double()), F.linear(x.abs(), weight.abs()))


@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(1, 384, 384), (14, 1536, 384), (40, 96, 80), (7, 64, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_norm_is_the_post_norm_block_end(rows: int, inputs: int, outputs: int, threads: int) -> None:
    weight, bias = randn(outputs, inputs, seed=6, scale=0.05), randn(outputs, seed=7)
    x, residual = randn(rows, inputs, seed=8), randn(rows, 2 * outputs, seed=9)[:, :outputs] * 3  # strided residual
    gamma, beta = torch.rand(outputs) + 0.5, randn(outputs, seed=10)
    summed = residual.double() + F.linear(x.double(), weight.double(), bias.double())
    expected = F.layer_norm(summed, (outputs,), gamma.double(), beta.double(), eps=1e-12)
    packed = f32_short.pack(weight)
    got = on_threads(
        threads, lambda: f32_short.f32_linear_add_norm(x, packed, outputs, bias, residual, gamma, beta, 1e-12)
    )
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    assert (got.double() - expected).abs().max() <= 1e-5


def _called(work: Callable[[], object]) -> list[str]:
    with torch.inference_mode(), recording() as program:
        work()
    return [getattr(function, "__name__", "") for function, _ in program.calls]


def test_linears_run_on_the_kernel_up_to_their_rows() -> None:
    linear = LinearActivation(384, 1536, "gelu")
    plain = LinearActivation(384, 1536, "gelu")
    plain.load_state_dict(linear.state_dict())
    plain.prepack()
    linear.prepack()
    linear.use_f32_short(16)
    for rows, on_kernel in ((1, True), (16, True), (17, False), (64, False)):
        x = randn(rows, 384, seed=rows)
        assert (_called(functools.partial(linear, x)) == ["bouquet_f32_linear"]) == on_kernel
        with torch.inference_mode():
            assert torch.allclose(linear(x), plain(x), rtol=1e-4, atol=1e-5)
    projection = Linear(384, 384)
    projection.use_f32_short(16)
    norm, residual = torch.nn.LayerNorm(384), randn(8, 384, seed=11)
    with torch.inference_mode():
        fused = projection.add_norm(randn(8, 384, seed=12), residual, norm)
        assert torch.allclose(fused, norm(residual + projection(randn(8, 384, seed=12))), atol=1e-5)
    assert _called(lambda: projection.add_norm(randn(8, 384, seed=12), residual, norm)) == ["bouquet_f32_linear"]
    assert _called(lambda: projection(randn(8, 384, seed=12).double())) == []  # float32 rows only


def test_the_choice_is_measured_once_per_machine_and_shape(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    measured: list[int] = []
    monkeypatch.setattr(
        f32_short, "measure", lambda shapes, threads: measured.append(1) or {16: (1.0, 2.0), 32: (2.0, 1.0)}
    )
    assert f32_short.choose_f32_rows([(384, 384)], 1) == 16
    assert f32_short.choose_f32_rows([(384, 384)], 1) == 16 and len(measured) == 1  # read back
    assert f32_short.choose_f32_rows([(384, 1536)], 1) == 16 and len(measured) == 2  # another shape


def test_not_chosen_on_a_cpu_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BOUQUET_CPU_FEATURES", "sse4_1,avx,avx2,fma,f16c,bmi1,bmi2,avx_vnni")
    cpu_features.cache_clear()
    try:
        assert not f32_short.available()
        model = torch.nn.Sequential(Linear(64, 64))
        assert use_f32_short_linears(model) == 0 and model[0].f32_packed is None
    finally:
        monkeypatch.delenv("BOUQUET_CPU_FEATURES")
        cpu_features.cache_clear()


def test_a_lone_float32_query_is_one_cpu_graph(minilm_path: Path) -> None:
    """Every op of MiniLM's layers is then a kernel call: the step is captured, and its replays give the eager rows."""
    chosen = f32_short.choose_f32_rows
    f32_short.choose_f32_rows = lambda shapes, threads: 16  # type: ignore[assignment]
    try:
        config = dataclasses.replace(
            create_engine_config(minilm_path, device="cpu", dtype="float32"), cpu_warmup_tokens=0
        )
        with_graphs, eager = (Engine(dataclasses.replace(config, cpu_graphs=on)) for on in (True, False))
    finally:
        f32_short.choose_f32_rows = chosen  # type: ignore[assignment]
    try:
        batch = Batch.pack([[101, 7592, 2088, 2003, 1037, 3231, 102]])
        for _ in range(3):
            with torch.inference_mode():
                got = with_graphs.runner.execute(batch).numpy()
            assert np.array_equal(got, eager.embed(batch))
        assert with_graphs.runner.layer_graphs is not None
        stats = with_graphs.runner.layer_graphs.thread_graphs(with_graphs.model.encoder.layer).stats
        assert stats.captures == 1 and stats.replays == 1
    finally:
        with_graphs.close()
        eager.close()
