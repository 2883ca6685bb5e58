"""float32 linears of short steps (layers/f32_short.py, kernels/int8_linear_f32.h and its AVX2 tiles): against
float64 products within float32's rounding, with each activation and the fused add and LayerNorm, in each ISA's kernel
this CPU runs (the AVX2 one forced through the CPU probe on an AVX-512 machine); the probe's choice of kernel; the
Linear's routing by rows; the choice measured once per machine, ISA and shape, and never made on a CPU without AVX2
and FMA; MiniLM's lone query recorded whole as a CPU graph. Skipped, saying why, on CPUs without AVX2 and FMA."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterator
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

pytestmark = pytest.mark.skipif(not f32_short.available(), reason="needs AVX2 and FMA")

AVX2_ONLY = "sse4_1,avx,avx2,fma,f16c,bmi1,bmi2"
ISA_FLAGS = {"avx512": AVX2_ONLY + ",avx512f,avx512bw,avx512vl,avx512dq,avx512cd", "avx2": AVX2_ONLY}

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


@pytest.fixture(params=sorted(ISA_FLAGS))
def isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Each ISA's kernel, chosen through the probe (so the AVX2 code runs on an AVX-512 machine too); skipped where
    this CPU does not run it."""
    with monkeypatch.context() as patch:
        patch.setenv("BOUQUET_CPU_FEATURES", ISA_FLAGS[request.param])
        cpu_features.cache_clear()
        if f32_short.kernel_isa() != request.param:
            pytest.skip(f"this CPU does not run the {request.param} kernel")
        yield request.param
    cpu_features.cache_clear()


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
def test_products_are_float32_linears(
    isa: str, activation: str, rows: int, inputs: int, outputs: int, threads: int
) -> None:
    weight, bias, x = randn(outputs, inputs, seed=1, scale=0.05), randn(outputs, seed=2), randn(rows, inputs, seed=3)
    summed = F.linear(x.double(), weight.double(), bias.double())
    packed = f32_short.pack(weight)
    assert packed.shape[-1] == f32_short.BLOCKS[isa]
    got = on_threads(threads, lambda: f32_short.f32_linear(x, packed, outputs, bias, activation))
    assert got.dtype == torch.float32 and got.shape == (rows, outputs)
    magnitude = F.linear(x.abs().double(), weight.abs().double(), bias.abs().double())
    assert within_float32_rounding(got, REFERENCE_ACTIVATIONS[activation](summed), magnitude)


@pytest.mark.parametrize("activation", sorted(REFERENCE_ACTIVATIONS))
def test_every_row_count_up_to_64(isa: str, activation: str) -> None:
    """Every tile and split of rows, at widths that end in a partial vector, a partial block and a partial group of
    wide blocks."""
    for inputs, outputs in ((37, 50), (129, 17), (97, 200)):
        weight, bias = randn(outputs, inputs, seed=outputs, scale=0.05), randn(outputs, seed=inputs)
        packed = f32_short.pack(weight)
        for rows in range(1, 65):
            x = randn(rows, inputs, seed=rows)
            expected = REFERENCE_ACTIVATIONS[activation](F.linear(x.double(), weight.double(), bias.double()))
            magnitude = F.linear(x.abs().double(), weight.abs().double(), bias.abs().double())
            got = f32_short.f32_linear(x, packed, outputs, bias, activation)
            assert within_float32_rounding(got, expected, magnitude), f"{rows} rows, {inputs} -> {outputs}"


def test_strided_rows_leading_dimensions_and_no_bias() -> None:
    weight, x = randn(40, 64, seed=4), randn(3, 7, 128, seed=5)[..., 32:96]  # rows 128 apart
    got = f32_short.f32_linear(x, f32_short.pack(weight), 40, None)
    assert got.shape == (3, 7, 40)
    assert within_float32_rounding(got, F.linear(x.double(), weight.double()), F.linear(x.abs(), weight.abs()))


@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(1, 384, 384), (14, 1536, 384), (40, 96, 80), (7, 64, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_norm_is_the_post_norm_block_end(isa: str, rows: int, inputs: int, outputs: int, threads: int) -> None:
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


def test_add_norm_at_every_row_count(isa: str) -> None:
    weight, bias = randn(200, 97, seed=13, scale=0.05), randn(200, seed=14)
    gamma, beta = torch.rand(200) + 0.5, randn(200, seed=15)
    packed = f32_short.pack(weight)
    for rows in range(1, 65):
        x, residual = randn(rows, 97, seed=rows), randn(rows, 200, seed=100 + rows)
        summed = residual.double() + F.linear(x.double(), weight.double(), bias.double())
        expected = F.layer_norm(summed, (200,), gamma.double(), beta.double(), eps=1e-12)
        run = functools.partial(f32_short.f32_linear_add_norm, x, packed, 200, bias, residual, gamma, beta, 1e-12)
        for threads in (1, 2):
            got = on_threads(threads, run)
            assert (got.double() - expected).abs().max() <= 1e-5, f"{rows} rows on {threads} threads"


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


def test_the_choice_is_measured_once_per_machine_isa_and_shape(
    isa: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    measured: list[str | None] = []
    monkeypatch.setattr(
        f32_short,
        "measure",
        lambda shapes, threads: measured.append(f32_short.kernel_isa()) or {16: (1.0, 2.0), 32: (2.0, 1.0)},
    )
    assert f32_short.choose_f32_rows([(384, 384)], 1) == 16
    assert f32_short.choose_f32_rows([(384, 384)], 1) == 16 and measured == [isa]  # read back
    assert f32_short.choose_f32_rows([(384, 1536)], 1) == 16 and measured == [isa, isa]  # another shape
    other = next(name for name in ISA_FLAGS if name != isa)  # the other kernel's timing is not read
    with monkeypatch.context() as patch:  # undone before the fixture's own probe is
        patch.setenv("BOUQUET_CPU_FEATURES", ISA_FLAGS[other])
        cpu_features.cache_clear()
        if f32_short.kernel_isa() == other:
            assert f32_short.choose_f32_rows([(384, 384)], 1) == 16 and measured == [isa, isa, other]


@pytest.mark.parametrize(
    ("seconds", "rows"),
    [
        ({16: (1.0, 2.0), 32: (1.0, 2.0), 64: (2.0, 1.0), 128: (1.0, 2.0)}, 32),  # stops at the first loss
        ({16: (1.0, 1.0), 32: (1.61, 1.60), 64: (3.0, 2.9)}, 64),  # ties (within 5%) go to the kernel
        ({16: (1.2, 1.0), 32: (1.0, 2.0)}, 0),  # slower at a query's rows: never
    ],
)
def test_rows_from_the_timings(seconds: dict[int, tuple[float, float]], rows: int) -> None:
    assert f32_short.rows_from(seconds) == rows


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (ISA_FLAGS["avx512"], "avx512"),
        (ISA_FLAGS["avx2"] + ",avx_vnni", "avx2"),
        ("avx2,fma", "avx2"),
        ("sse4_1,avx,f16c", None),
        ("avx,avx2,f16c", None),  # no FMA
        ("avx,fma,avx512f,avx512bw,avx512vl,avx512dq", None),  # no AVX2
    ],
)
def test_the_probe_picks_the_kernel(
    flags: str, expected: str | None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """AVX-512 where the probe grants it, AVX2 where it grants AVX2 and FMA only, none otherwise: the weight is
    packed for that kernel; without one no Linear gets a packed copy and nothing is measured."""
    if expected is not None and not f32_short.cpu_runs(expected):
        pytest.skip(f"this CPU does not run the {expected} kernel")
    measured: list[str | None] = []
    monkeypatch.setattr(f32_short, "measure", lambda shapes, threads: measured.append(expected) or {16: (1.0, 2.0)})
    monkeypatch.setenv("BOUQUET_CACHE_DIR", str(tmp_path))
    with monkeypatch.context() as patch:
        patch.setenv("BOUQUET_CPU_FEATURES", flags)
        cpu_features.cache_clear()
        assert f32_short.kernel_isa() == expected and f32_short.available() == (expected is not None)
        model = torch.nn.Sequential(Linear(64, 40))
        assert use_f32_short_linears(model) == (16 if expected else 0)
        assert measured == ([expected] if expected else [])
        packed = model[0].f32_packed
        block = f32_short.BLOCKS.get(expected or "", 0)
        assert (None if packed is None else tuple(packed.shape)) == (
            (2 if block == 32 else 3, 64, block) if block else None
        )
    cpu_features.cache_clear()


def test_a_lone_float32_query_is_one_cpu_graph(isa: str, minilm_path: Path) -> None:
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
