"""bfloat16 linears on AMX tiles (layers/bf16_amx.py, kernels/int8_linear_bf16.h): against float32 products of the
same bfloat16 values, rounded once; the Linear's routing by rows; MiniLM served through it against
sentence-transformers. Skipped, saying why, on CPUs without AMX-BF16."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import embed_ids, row_cosines
from corpus import parity_texts

from bouquet.engine.engine import Engine
from bouquet.kernels.recording import recording
from bouquet.layers import bf16_amx
from bouquet.layers.linear import Linear, LinearActivation

pytestmark = pytest.mark.skipif(not bf16_amx.available(), reason="needs AMX-BF16 (amx_tile, amx_bf16)")

REFERENCE_ACTIVATIONS = {
    "none": lambda y: y,
    "gelu": F.gelu,
    "gelu_tanh": lambda y: F.gelu(y, approximate="tanh"),
    "relu": torch.relu,
}


def bf16(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("activation", sorted(REFERENCE_ACTIVATIONS))
@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(1, 384, 1152), (15, 384, 1536), (16, 1536, 384),
                                                         (17, 64, 48), (300, 96, 80)])  # fmt: skip
@pytest.mark.parametrize("threads", [1, 2])
def test_products_round_the_float32_sums_once(
    activation: str, rows: int, inputs: int, outputs: int, threads: int
) -> None:
    weight, bias, x = bf16(outputs, inputs, scale=0.05, seed=1), torch.randn(outputs), bf16(rows, inputs, seed=2)
    expected = REFERENCE_ACTIVATIONS[activation](F.linear(x.double(), weight.double(), bias.double()))
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = bf16_amx.amx_bf16_linear(x, bf16_amx.pack(weight), outputs, bias, activation)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, outputs)
    # One rounding to bfloat16 (half of 2^-7 relative) on top of float32 sums and the activation's approximation.
    error = (got.double() - expected).abs() / (expected.abs() + 1e-2)
    assert error.max() <= 2**-8 + 1e-4


def test_float32_rows_are_rounded_once_on_the_way_in() -> None:
    weight, bias, x = bf16(48, 64, scale=0.1, seed=5), torch.randn(48), torch.randn(20, 96)[:, :64] * 2
    packed = bf16_amx.pack(weight)
    from_float = bf16_amx.amx_bf16_linear(x, packed, 48, bias, "gelu")  # strided float32 rows
    assert torch.equal(from_float, bf16_amx.amx_bf16_linear(x.to(torch.bfloat16), packed, 48, bias, "gelu"))


@pytest.mark.parametrize(("rows", "inputs", "outputs"), [(1, 384, 384), (40, 1536, 384), (7, 64, 48)])
@pytest.mark.parametrize("threads", [1, 2])
def test_add_norm_keeps_the_float32_stream(rows: int, inputs: int, outputs: int, threads: int) -> None:
    weight, bias = bf16(outputs, inputs, scale=0.05, seed=6), torch.randn(outputs)
    x, residual = torch.randn(rows, inputs), torch.randn(rows, outputs) * 3
    gamma, beta = torch.rand(outputs) + 0.5, torch.randn(outputs)
    summed = residual.double() + F.linear(x.to(torch.bfloat16).double(), weight.double(), bias.double())
    expected = F.layer_norm(summed, (outputs,), gamma.double(), beta.double(), eps=1e-12)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = bf16_amx.amx_bf16_linear_add_norm(x, bf16_amx.pack(weight), outputs, bias, residual, gamma, beta, 1e-12)
    finally:
        torch.set_num_threads(previous)
    assert got.dtype == torch.float32
    assert (got.double() - expected).abs().max() <= 1e-4  # float32 sums of exact bfloat16 products


def test_strided_rows_and_threads_agree_bit_for_bit() -> None:
    weight, x = bf16(64, 128, scale=0.1, seed=3), bf16(40, 256, seed=4)
    rows = x[:, 64:192]  # each row 128 values, 256 apart
    packed = bf16_amx.pack(weight)
    one = bf16_amx.amx_bf16_linear(rows, packed, 64, None)
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = bf16_amx.amx_bf16_linear(rows.contiguous(), packed, 64, None)
    finally:
        torch.set_num_threads(previous)
    assert torch.equal(one, two)


def _kernel_calls(module: torch.nn.Module, x: torch.Tensor) -> int:
    with torch.inference_mode(), recording() as program:
        module(x)
    return len(program.calls)


def test_linears_run_on_the_tiles_up_to_their_rows() -> None:
    linear = LinearActivation(384, 1536, "gelu").to(torch.bfloat16)
    plain = LinearActivation(384, 1536, "gelu").to(torch.bfloat16)
    plain.load_state_dict(linear.state_dict())
    plain.prepack()
    linear.prepack()
    linear.use_amx_bf16(16)
    for rows, on_tiles in ((8, True), (16, True), (17, False), (64, False)):
        x = bf16(rows, 384, seed=rows)
        assert _kernel_calls(linear, x) == on_tiles
        with torch.inference_mode():
            cosine = F.cosine_similarity(linear(x).float(), plain(x).float(), dim=-1)
        assert cosine.min() >= 0.9999
    projection = Linear(384, 1536).to(torch.bfloat16)
    projection.use_amx_bf16(16)
    norm = torch.nn.LayerNorm(1536)
    residual = torch.randn(8, 1536)
    with torch.inference_mode(), recording() as program:
        fused = projection.add_norm(bf16(8, 384), residual, norm)
        projection.add_norm(bf16(8, 384), residual.to(torch.bfloat16), norm)  # not the float32 stream: torch's norm
    called = [function.__name__ for function, _ in program.calls]
    assert fused.dtype == torch.float32 and called == ["bouquet_amx_bf16_linear_add_norm", "bouquet_amx_bf16_linear"]
    everywhere = Linear(384, 384).to(torch.bfloat16)
    everywhere.prepack()
    everywhere.use_amx_bf16(-1)
    assert everywhere.packed_weight is None and everywhere.weight.numel() == 0  # neither other copy is kept
    assert _kernel_calls(everywhere, bf16(1000, 384)) == 1


@pytest.fixture(scope="module")
def minilm_on_tiles(minilm_path: Path) -> Iterator[Engine]:
    """MiniLM in bfloat16 with every linear on the tiles, whatever the start-up measurement would choose."""
    from bouquet.config import create_engine_config

    chosen = bf16_amx.choose_bf16_rows
    bf16_amx.choose_bf16_rows = lambda shapes, threads: -1  # type: ignore[assignment]
    try:
        engine = Engine(create_engine_config(minilm_path, device="cpu", dtype="bfloat16"))
    finally:
        bf16_amx.choose_bf16_rows = chosen  # type: ignore[assignment]
    yield engine
    engine.close()


def test_minilm_on_the_tiles_matches_sentence_transformers(minilm_on_tiles: Engine, minilm_tokenizer,
                                                           sentence_transformer) -> None:  # fmt: skip
    linears = [m for m in minilm_on_tiles.model.modules() if isinstance(m, Linear)]
    assert all(m.amx_bf16 is not None and m.amx_bf16_rows == -1 for m in linears)
    texts = parity_texts()
    ours = embed_ids(minilm_on_tiles, minilm_tokenizer.encode(texts))
    reference = sentence_transformer.encode(texts, batch_size=32, normalize_embeddings=True)
    cosines = row_cosines(ours, reference)
    assert cosines.min() >= 0.999, f"min cosine {cosines.min():.6f}"
    assert np.median(cosines) >= 0.9999, f"median cosine {np.median(cosines):.6f}"


def test_minilm_layers_on_the_tiles_replay_as_cpu_graphs(minilm_on_tiles: Engine, minilm_path: Path,
                                                          minilm_tokenizer) -> None:  # fmt: skip
    """Every op of a bfloat16 BERT layer is a kernel here, so short steps replay their calls, bit for bit."""
    import dataclasses

    from bouquet.batch import Batch
    from bouquet.config import create_engine_config

    chosen = bf16_amx.choose_bf16_rows
    bf16_amx.choose_bf16_rows = lambda shapes, threads: -1  # type: ignore[assignment]
    try:
        config = create_engine_config(minilm_path, device="cpu", dtype="bfloat16")
        eager = Engine(dataclasses.replace(config, cpu_graphs=False))
    finally:
        bf16_amx.choose_bf16_rows = chosen  # type: ignore[assignment]
    try:
        ids = minilm_tokenizer.encode(["a query", "another short query", "and a third one, a little longer"])
        batches = [Batch.pack([one]) for one in ids] + [Batch.pack(ids)]
        for _ in range(3):
            for batch in batches:
                with torch.inference_mode():
                    got = minilm_on_tiles.runner.execute(batch)
                    assert torch.equal(got, eager.runner.execute(batch))
        layers = minilm_on_tiles.model.encoder.layer
        stats = minilm_on_tiles.runner.layer_graphs.thread_graphs(layers).stats  # type: ignore[union-attr]
        assert stats.captures == len(batches) and stats.replays >= len(batches)
    finally:
        eager.close()
