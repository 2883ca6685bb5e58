"""CPU graphs (engine/cpu_graphs.py): a layer stack recorded as its kernel calls and replayed, against the same
layers run eagerly. The stacks here are made of bouquet's `cpu_varlen` attention kernel and int8 linears on each
int8 product this CPU offers (oneDNN's are torch ops recorded as calls; the AMX kernel where the CPU has it), so
every x86-64 CPU runs them."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading

import numpy as np
import pytest
import torch
from torch import nn

from bouquet.batch import Batch
from bouquet.config import create_engine_config, default_model_path
from bouquet.engine.cpu_graphs import CpuCapturer, CpuLayerGraphs, NotReplayable, _KeepAndGuard
from bouquet.engine.cuda_graphs import Bucket, BucketState
from bouquet.layers.attention_backends.base import AttentionShape
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.context import ForwardContext, forward_context, get_forward_context
from bouquet.layers.int8_linear import (
    INT_MM_PRODUCT,
    Int8Weight,
    int8_linear,
    quantize_weight,
    weight_range,
    with_products,
)
from bouquet.layers.int8_products import available_products
from bouquet.layers.layer_stack import run_layers
from bouquet.layers.linear import Linear, LinearActivation

HEADS, HEAD_DIM = 2, 16


class KernelAttention(nn.Module):
    """Self-attention of the hidden states' heads on themselves (q = k = v), by the cpu_varlen kernel only."""

    def __init__(self, backend: CpuVarlenBackend):
        super().__init__()
        self.backend = backend

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, H * D]
        heads = hidden.unflatten(1, (HEADS, HEAD_DIM))
        ctx = get_forward_context()
        out = self.backend.forward(heads, heads, heads, ctx, causal=False, scale=0.7)
        return out.flatten(1)


class TorchScale(nn.Module):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * 2.0  # torch's own op: a replay of kernel calls would skip it


class Int8Layer(nn.Module):
    """An int8 linear (quantize, product, dequantize with GELU) on the product its weight was prepared for."""

    def __init__(self, weight: Int8Weight):
        super().__init__()
        self.weight = weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return int8_linear(hidden, self.weight, "gelu")


def int8_layer(in_features: int, out_features: int, product: str, seed: int) -> Int8Layer:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
    bias = torch.randn(out_features, generator=generator)
    return Int8Layer(with_products(quantize_weight(weight, bias, weight_range(product)), product, product))


@pytest.fixture(scope="module")
def backend() -> CpuVarlenBackend:
    backend = CpuVarlenBackend()
    backend.bind(AttentionShape(HEADS, HEADS, HEAD_DIM, False, torch.float32))
    return backend


def step(
    layers: list[nn.Module], hidden: torch.Tensor, seq_lens: list[int], backend: CpuVarlenBackend,
    graphs: CpuLayerGraphs | None,
) -> torch.Tensor:  # fmt: skip
    cu_seqlens = torch.tensor([0, *itertools.accumulate(seq_lens)], dtype=torch.int32)
    ctx = ForwardContext(cu_seqlens, max(seq_lens), list(seq_lens))
    ctx.attn_metadata = backend.prepare(ctx)
    if graphs is not None:
        ctx.layer_graphs = graphs.bind(ctx, backend.prepare, backend.name)
    with torch.inference_mode(), forward_context(ctx):
        return run_layers(layers, hidden)


def states(seed: int, tokens: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, HEADS * HEAD_DIM, generator=generator) * 3  # far from uniform attention


def test_replays_equal_eager_runs_for_new_states_and_sequence_bounds(backend: CpuVarlenBackend) -> None:
    layers: list[nn.Module] = [KernelAttention(backend) for _ in range(3)]
    graphs = CpuLayerGraphs()
    # One key (16 tokens, 2 sequences): eager, captured, then replayed with other states and other bounds.
    for seed, seq_lens in enumerate([[5, 11], [9, 7], [1, 15], [8, 8], [15, 1]]):
        hidden = states(seed, 16)
        expected = step(layers, hidden, seq_lens, backend, None)
        got = step(layers, hidden, seq_lens, backend, graphs)
        assert torch.equal(got, expected), seq_lens
    stats = graphs.thread_graphs(layers).stats
    assert (stats.eager, stats.captures, stats.replays) == (1, 1, 3)  # the capture's own run answers its step
    # Another sequence count is another graph; the first's output stays the caller's after the next replay.
    kept = step(layers, states(10, 16), [16], backend, graphs)
    kept_copy = kept.clone()
    for seed in range(11, 14):
        assert torch.equal(step(layers, states(seed, 16), [16], backend, graphs),
                           step(layers, states(seed, 16), [16], backend, None))  # fmt: skip
    assert torch.equal(kept, kept_copy)
    assert graphs.thread_graphs(layers).stats.captures == 2


def test_two_stacks_of_one_shape_keep_their_own_graphs(backend: CpuVarlenBackend) -> None:
    one: list[nn.Module] = [KernelAttention(backend)]
    two: list[nn.Module] = [KernelAttention(backend), KernelAttention(backend)]
    graphs = CpuLayerGraphs()
    for seed in range(4):
        hidden = states(seed, 16)
        for layers in (one, two):  # same tokens, sequences and backend
            assert torch.equal(step(layers, hidden, [16], backend, graphs), step(layers, hidden, [16], backend, None))
    assert graphs.thread_graphs(one).stats.captures == graphs.thread_graphs(two).stats.captures == 1


def test_layers_with_torch_ops_stay_eager_and_say_why_once(
    backend: CpuVarlenBackend, caplog: pytest.LogCaptureFixture
) -> None:
    layers: list[nn.Module] = [KernelAttention(backend), TorchScale(), KernelAttention(backend)]
    graphs = CpuLayerGraphs()
    with caplog.at_level(logging.INFO, logger="bouquet.engine.cpu_graphs"):
        for seed, tokens in itertools.product(range(3), (12, 20)):
            hidden = states(seed, tokens)
            expected = step(layers, hidden, [tokens], backend, None)
            assert torch.equal(step(layers, hidden, [tokens], backend, graphs), expected)
    assert graphs.thread_graphs(layers).stats.captures == 0
    assert set(graphs.thread_graphs(layers).states.values()) == {BucketState.EAGER}
    said = [r.message for r in caplog.records if "stays eager" in r.message]
    assert len(said) == 1 and "aten::mul computes outside bouquet's kernels" in said[0]


@pytest.mark.parametrize("inference", [False, True])
def test_a_view_that_copies_is_refused(inference: bool) -> None:
    rows = torch.randn(8, 6)
    with torch.inference_mode(inference), pytest.raises(NotReplayable, match="computes outside"), _KeepAndGuard():
        rows.t().reshape(-1, 2)  # not viewable: reshape copies


def test_views_and_allocations_pass_and_are_kept() -> None:
    rows = torch.randn(8, 6)
    with torch.inference_mode(), _KeepAndGuard() as guard:
        torch.empty(4, 3)
        rows.view(6, 8).unflatten(1, (2, 4)).chunk(2, dim=1)
    assert len(guard.kept) >= 4


def test_bounds_tokens_bytes_and_other_backends(backend: CpuVarlenBackend) -> None:
    layers: list[nn.Module] = [KernelAttention(backend)]
    cu_seqlens = torch.tensor([0, 16], dtype=torch.int32)
    ctx = ForwardContext(cu_seqlens, 16, [16])
    assert CpuLayerGraphs(max_tokens=8).bind(ctx, backend.prepare, backend.name) is None
    assert CpuLayerGraphs().bind(dataclasses.replace(ctx, backend=backend), backend.prepare, backend.name) is None
    tight = CpuLayerGraphs(max_bytes=1024)  # less than one graph's states
    for seed in range(3):
        hidden = states(seed, 16)
        assert torch.equal(step(layers, hidden, [16], backend, tight), step(layers, hidden, [16], backend, None))
    assert tight.thread_graphs(layers).stats.captures == 0
    assert "graph budget" in next(iter(tight.thread_graphs(layers).capture_errors.values()))


def test_a_graph_predicted_over_the_budget_is_never_captured(
    backend: CpuVarlenBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once a thread's graphs have shown their bytes per token, a bucket whose graph would not fit what is left stays
    eager without a capture: one found over the budget after recording had cost its step ~4 eager runs."""
    layers: list[nn.Module] = [KernelAttention(backend)]
    sizing = CpuLayerGraphs()
    for seed in range(2):
        step(layers, states(seed, 16), [16], backend, sizing)
    kept_by_one = sizing.bytes_here() - sizing.arena_bytes_here()
    assert kept_by_one > 0
    attempts: list[int] = []
    capture = CpuCapturer.capture
    monkeypatch.setattr(CpuCapturer, "capture", lambda self, fn, bucket: attempts.append(bucket.num_tokens)
                        or capture(self, fn, bucket))  # fmt: skip
    # the 16-token graph and the arena fit; a 32-token graph's own buffers (twice the 16-token one's) no longer do
    graphs = CpuLayerGraphs(max_bytes=sizing.bytes_here() + kept_by_one)
    for tokens in (16, 16, 16, 32, 32, 32):
        hidden = states(tokens, tokens)
        assert torch.equal(
            step(layers, hidden, [tokens], backend, graphs), step(layers, hidden, [tokens], backend, None)
        )
    assert attempts == [16]
    stack = graphs.thread_graphs(layers)
    assert stack.stats.captures == 1 and stack.stats.replays == 1
    assert stack.capture_errors == {Bucket(32, 1, 0, backend.name): "its graph would pass the thread's graph budget"}


def test_each_thread_keeps_its_own_graphs(backend: CpuVarlenBackend) -> None:
    layers: list[nn.Module] = [KernelAttention(backend)]
    graphs = CpuLayerGraphs()
    for seed in range(3):
        step(layers, states(seed, 16), [16], backend, graphs)
    assert graphs.thread_graphs(layers).stats.replays == 1
    seen: list[tuple[int, int, int]] = []

    def other() -> None:
        for seed in range(3):
            hidden = states(seed, 16)
            assert torch.equal(step(layers, hidden, [16], backend, graphs), step(layers, hidden, [16], backend, None))
        stats = graphs.thread_graphs(layers).stats
        seen.append((stats.eager, stats.captures, stats.replays))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert seen == [(1, 1, 1)]


def assert_replays_equal_eager_runs(layers: list[nn.Module], backend: CpuVarlenBackend) -> None:
    """Two step shapes, four states each: each shape eager, then captured, then replayed twice, bit for bit."""
    graphs = CpuLayerGraphs()
    for seed, tokens in itertools.product(range(4), (12, 20)):
        hidden = states(seed, tokens)
        assert torch.equal(
            step(layers, hidden, [tokens], backend, graphs), step(layers, hidden, [tokens], backend, None)
        )
    stats = graphs.thread_graphs(layers).stats
    assert stats.captures == 2 and stats.replays == 4


@pytest.mark.parametrize("product", available_products())
def test_int8_products_replay_as_kernel_calls(backend: CpuVarlenBackend, product: str) -> None:
    """Each int8 product, torch's oneDNN ops among them, is captured and replayed with the kernels around it."""
    layers: list[nn.Module] = [
        int8_layer(32, 128, product, 1),
        int8_layer(128, 32, product, 2),
        KernelAttention(backend),
    ]
    assert_replays_equal_eager_runs(layers, backend)


def test_graphs_of_one_thread_share_one_arena_and_each_replays_its_own_step(backend: CpuVarlenBackend) -> None:
    """Every graph's buffers live in the thread's arena (graph_arena.py), sized at the first capture for the longest
    step: six shapes captured, replayed in an order that alternates them, each bit for bit its eager run, the arena
    never grown, and the thread's bytes far below what six graphs of their own would keep."""
    layers: list[nn.Module] = [int8_layer(32, 128, INT_MM_PRODUCT, 1), int8_layer(128, 32, INT_MM_PRODUCT, 2),
                               KernelAttention(backend)]  # fmt: skip
    graphs = CpuLayerGraphs(max_tokens=64)
    shapes = [8, 64, 16, 40, 24, 32]
    for tokens in shapes * 2:  # eager, then captured
        step(layers, states(tokens, tokens), [tokens], backend, graphs)
    arena = graphs.arena_bytes_here()
    capturer = graphs._local.capturer
    assert graphs.thread_graphs(layers).stats.captures == len(shapes) and arena > 0
    for seed, tokens in itertools.product(range(3), [*shapes, *reversed(shapes)]):
        hidden = states(seed, tokens)
        assert torch.equal(
            step(layers, hidden, [tokens], backend, graphs), step(layers, hidden, [tokens], backend, None)
        )
    assert graphs.thread_graphs(layers).stats.replays == 3 * 2 * len(shapes)
    assert graphs.arena_bytes_here() == arena
    own_buffers = capturer.allocated_per_token * sum(shapes)  # what the graphs would keep without the arena
    assert graphs.bytes_here() < 0.6 * own_buffers


@pytest.mark.parametrize("roomy", [True, False])
def test_a_wider_stack_gets_a_new_arena_within_the_budget(backend: CpuVarlenBackend, roomy: bool) -> None:
    """A second stack whose graphs allocate more a token than the arena was sized for takes a new arena, the old one
    kept for the first stack's graphs: each replays bit for bit, and the thread's bytes never pass its budget (one
    that holds the first stack's graphs alone leaves the wider stack eager)."""
    narrow: list[nn.Module] = [KernelAttention(backend)]
    wide: list[nn.Module] = [int8_layer(32, 512, INT_MM_PRODUCT, 1), int8_layer(512, 32, INT_MM_PRODUCT, 2),
                             KernelAttention(backend)]  # fmt: skip
    sizing = CpuLayerGraphs(max_tokens=32)
    for seed in range(2):
        step(narrow, states(seed, 24), [24], backend, sizing)
    budget = 64 * 2**20 if roomy else sizing.bytes_here() + 1024
    graphs = CpuLayerGraphs(max_tokens=32, max_bytes=budget)
    arenas = []
    for layers in (narrow, wide):
        for seed in range(4):
            hidden = states(seed, 24)
            expected = step(layers, hidden, [24], backend, None)
            assert torch.equal(step(layers, hidden, [24], backend, graphs), expected)
            assert graphs.bytes_here() <= budget
        arenas.append(graphs.arena_bytes_here())
    assert graphs.thread_graphs(narrow).stats.captures == 1
    assert graphs.thread_graphs(wide).stats.captures == int(roomy)
    assert (arenas[1] > arenas[0]) == roomy


def test_a_float32_linear_on_onednns_packed_weight_replays_as_a_call(backend: CpuVarlenBackend) -> None:
    """oneDNN's float32 linear on its packed weight (what int8 keeps where the CPU has no VNNI: the QKV
    projections), with and without a fused activation, is recorded as a call, so those CPUs' int8 steps replay."""
    generator = torch.Generator().manual_seed(5)
    width = HEADS * HEAD_DIM
    float_linears = [Linear(width, width), LinearActivation(width, 4 * width, "gelu")]
    for linear in float_linears:
        with torch.no_grad():
            linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) / width**0.5)
            linear.bias.copy_(torch.randn(linear.out_features, generator=generator))
        linear.prepack()
    layers: list[nn.Module] = [
        *float_linears,
        int8_layer(4 * width, width, INT_MM_PRODUCT, 3),
        KernelAttention(backend),
    ]
    assert_replays_equal_eager_runs(layers, backend)


def test_int8_engine_rows_are_the_same_with_graphs() -> None:
    from bouquet.engine.engine import Engine
    from bouquet.tokenizer import TextTokenizer

    path = default_model_path()
    config = dataclasses.replace(create_engine_config(path, device="cpu", dtype="int8"), cpu_warmup_tokens=0)
    tokenizer = TextTokenizer(path / "tokenizer.json", 256)
    texts = ["what is a packed batch", "graphs on the cpu", "a longer query about int8 products on amx tiles"]
    texts += ["Replays must give the very same rows as the eager layers: bit for bit, every time."] * 2
    ids = tokenizer.encode(texts)
    batches = [Batch.pack([one]) for one in ids] + [Batch.pack(ids[:3]), Batch.pack(ids[1:4])]
    with_graphs, eager = (Engine(dataclasses.replace(config, cpu_graphs=on)) for on in (True, False))
    try:
        for _ in range(3):
            for batch in batches:
                with torch.inference_mode():
                    got = with_graphs.runner.execute(batch).numpy()
                assert np.array_equal(got, eager.embed(batch))
        stats = with_graphs.runner.layer_graphs.thread_graphs(with_graphs.model.encoder.layer).stats  # type: ignore[union-attr]
        assert stats.captures >= 5 and stats.replays >= 5
    finally:
        with_graphs.close()
        eager.close()


def test_capturing_does_not_import_dynamo() -> None:
    """The dispatch mode's first use would import torch._dynamo (seconds, on a request's step) unless told not to."""
    import subprocess
    import sys

    code = (
        "import sys, torch\n"
        "from bouquet.engine.cpu_graphs import _KeepAndGuard\n"
        "with torch.inference_mode(), _KeepAndGuard():\n"
        "    torch.empty(3).view(3, 1)\n"
        "assert 'torch._dynamo' not in sys.modules, 'torch._dynamo imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_steps_in_flight_on_both_workers_replay_their_own_graphs(caplog: pytest.LogCaptureFixture) -> None:
    """Steps submitted together run on the engine's two workers at once, each replaying its thread's graphs."""
    from bouquet.engine.engine import Engine
    from bouquet.tokenizer import TextTokenizer

    path = default_model_path()
    config = dataclasses.replace(create_engine_config(path, device="cpu", dtype="int8"), cpu_warmup_tokens=0)
    tokenizer = TextTokenizer(path / "tokenizer.json", 256)
    ids = tokenizer.encode([f"query number {i} about " + "packed batches " * (i % 5) for i in range(12)])
    batches = [Batch.pack([one]) for one in ids] + [Batch.pack(ids[i : i + 3]) for i in range(0, 12, 3)]
    with_graphs, eager = (Engine(dataclasses.replace(config, cpu_graphs=on)) for on in (True, False))
    try:
        assert with_graphs.workers == 2
        expected = [eager.embed(batch) for batch in batches]
        with caplog.at_level(logging.DEBUG, logger="bouquet.engine.cuda_graphs"):
            for _ in range(4):
                lazies = [with_graphs.step(batch) for batch in batches]  # all in flight: both workers busy
                for lazy, rows in zip(lazies, expected, strict=True):
                    assert np.array_equal(lazy.result(), rows)
        captured = {r.thread for r in caplog.records if r.message.startswith("captured a CPU graph")}
        assert len(captured) == 2, "each worker captures its own graphs"
    finally:
        with_graphs.close()
        eager.close()


def test_a_lone_querys_shapes_are_captured_at_start_on_the_lead(caplog: pytest.LogCaptureFixture) -> None:
    from bouquet.engine.cpu_graphs import SHORT_QUERY_TOKENS
    from bouquet.engine.engine import Engine
    from bouquet.tokenizer import TextTokenizer

    path = default_model_path()
    config = dataclasses.replace(create_engine_config(path, device="cpu", dtype="int8"), cpu_warmup_tokens=64)
    with caplog.at_level(logging.DEBUG, logger="bouquet.engine.cuda_graphs"):
        engine = Engine(config)
    try:
        started = [r for r in caplog.records if r.message.startswith("captured a CPU graph")]
        assert len({r.thread for r in started}) == 1 and len(started) == SHORT_QUERY_TOKENS
        caplog.clear()
        eager = Engine(dataclasses.replace(config, cpu_graphs=False, cpu_warmup_tokens=0))
        tokenizer = TextTokenizer(path / "tokenizer.json", 256)
        with caplog.at_level(logging.DEBUG, logger="bouquet.engine.cuda_graphs"):
            for ids in tokenizer.encode(["a first query", "and a second, a little longer than the first one"]):
                assert np.array_equal(engine.embed(Batch.pack([ids])), eager.embed(Batch.pack([ids])))
        assert not [r for r in caplog.records if r.message.startswith("captured")], "no request pays a capture"
        eager.close()
    finally:
        engine.close()
