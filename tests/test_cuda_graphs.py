"""CUDA-graph logic on the CPU: bucket choice, padding that keeps real rows, the lazy capture state machine."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import row_cosines
from random_models import make_bert, make_qwen3

from bouquet.batch import Batch
from bouquet.config import CudaGraphConfig, EngineConfig
from bouquet.engine.cuda_graphs import (
    Bucket,
    BucketState,
    CudaGraphRunner,
    GraphBuckets,
    LazyGraphs,
    StaticBuffers,
    graph_max_seqlen,
    pad_batch,
)
from bouquet.engine.engine import Engine
from bouquet.engine.inputs import padded_positions, prepare_inputs
from bouquet.engine.model_runner import ModelRunner
from bouquet.layers.attention import bind_backend
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.attention_backends.selection import AutoBackend, BackendTable

BUCKETS = GraphBuckets((16, 32, 64, 512), (1, 2, 4, 8))


@pytest.fixture(scope="module")
def random_qwen3(tmp_path_factory, minilm_path) -> Iterator[Engine]:  # last-token pooling
    path = tmp_path_factory.mktemp("qwen3")
    make_qwen3(path, minilm_path, bidirectional=True)
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def random_bert(tmp_path_factory, minilm_path) -> Iterator[Engine]:  # CLS pooling
    path = tmp_path_factory.mktemp("bert")
    make_bert(path, minilm_path)
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.mark.parametrize(
    ("tokens", "seqs", "bucket"),
    [
        (16, 1, Bucket(16, 1)),  # exact fit: no pad sequence needed
        (10, 1, Bucket(16, 2)),  # pad tokens need a sequence slot of their own
        (17, 3, Bucket(32, 4)),
        (512, 8, Bucket(512, 8)),
        (400, 8, None),  # 8 sequences plus a pad sequence exceed the top sequence bucket
        (513, 1, None),  # above the top token bucket: eager
    ],
)
def test_bucket_for(tokens: int, seqs: int, bucket: Bucket | None) -> None:
    assert BUCKETS.bucket_for(tokens, seqs) == bucket


def test_bucket_may_hold_more_sequence_slots_than_tokens() -> None:
    assert GraphBuckets((4, 16), (8, 16)).bucket_for(3, 3) == Bucket(4, 8)  # slots past the pad sequence are empty


def test_default_config_covers_the_benchmark_shapes() -> None:
    buckets = GraphBuckets(CudaGraphConfig().token_buckets, CudaGraphConfig().seq_buckets)
    assert buckets.bucket_for(16, 1) == Bucket(16, 1)
    assert buckets.bucket_for(8 * 64, 8) == Bucket(512, 8)


def test_config_rejects_unsorted_buckets() -> None:
    with pytest.raises(ValueError, match="token_buckets"):
        CudaGraphConfig(token_buckets=(32, 16))


def _batch(seq_lens: list[int], seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000, 2000, sum(seq_lens))
    return Batch.from_packed(ids, np.concatenate([[0], np.cumsum(seq_lens)]))


@pytest.mark.parametrize(
    ("seq_lens", "bucket", "max_seqlen"),
    [
        ([16], Bucket(16, 1), 16),  # exact fit
        ([10, 10], Bucket(32, 4), 16),  # the pad sequence (12 tokens) is the longest
        ([20] * 17, Bucket(384, 32), 64),  # 44 pad tokens: longer than every real sequence
        ([300], Bucket(384, 2), 384),  # a power of two past the bucket: the bucket's tokens
        ([3, 5], Bucket(16, 4), 16),  # at least 16
        ([50] * 81, Bucket(4096, 128), 64),  # the replica's 50-token inputs: not 4,096
    ],
)
def test_graph_max_seqlen_bounds_every_padded_sequence(seq_lens: list[int], bucket: Bucket, max_seqlen: int) -> None:
    padded = pad_batch(_batch(seq_lens), bucket)
    assert graph_max_seqlen(padded, bucket.num_tokens) == max_seqlen
    assert np.diff(padded.cu_seqlens).max() <= max_seqlen <= bucket.num_tokens


def test_the_runner_launches_a_graph_with_its_buckets_max_seqlen(minilm_fp32: Engine) -> None:
    """The forward a graph records sees the bucket's max_seqlen, the same at every replay of the bucket."""
    engine = minilm_fp32
    backend = _CapturableCpuVarlen()
    backend.bind(engine.attn_backend.shape)
    runner = ModelRunner(engine.model, engine.pooler, backend, engine.device)
    seen: list[int] = []
    forward = runner.forward
    runner.graphs = CudaGraphRunner(
        CudaGraphConfig(token_buckets=(64, 512), seq_buckets=(8, 32)), engine.device, backend,
        lambda inputs, prepare: seen.append(inputs.max_seqlen) or forward(inputs, prepare), _ReplayingCapturer(),
    )  # fmt: skip
    try:
        with torch.inference_mode():
            for seq_lens in ([20] * 17, [40, 3, 3], [20] * 17):
                runner.execute(_batch(seq_lens))
    finally:
        bind_backend(engine.model, engine.attn_backend)
    # 17 x 20 in 512 tokens (a pad sequence of 172): eager; [40, 3, 3] in 64 tokens: eager; 17 x 20 again: the
    # capture's forward, then its replay (the stand-in runs it again). Never the bucket's 512.
    assert seen == [256, 64, 256, 256]
    assert set(runner.graphs.graphs.states) == {Bucket(512, 32, 256, "cpu_varlen"), Bucket(64, 8, 64, "cpu_varlen")}


def test_pad_batch_layout() -> None:
    padded = pad_batch(_batch([3, 5]), Bucket(16, 4))
    assert padded.cu_seqlens.tolist() == [0, 3, 8, 16, 16]
    assert padded.input_ids[8:].tolist() == [0] * 8
    assert padded.dimensions.shape == (4,) and padded.normalize.tolist() == [True, True, False, False]
    assert padded_positions(padded, 8).tolist() == [0, 1, 2, 0, 1, 2, 3, 4] + [0] * 8


@pytest.mark.parametrize("engine_name", ["minilm_fp32", "random_qwen3", "random_bert"])
def test_padding_keeps_real_rows(engine_name: str, request: pytest.FixtureRequest) -> None:
    """The padded batch through the eager model (pooling included) gives the unpadded rows."""
    engine: Engine = request.getfixturevalue(engine_name)
    batch = _batch([7, 12, 3])
    bucket = Bucket(32, 8)
    padded = pad_batch(batch, bucket)
    with torch.inference_mode():
        expected = engine.runner.forward(prepare_inputs(batch, engine.device), engine.attn_backend.prepare)
        inputs = prepare_inputs(padded, engine.device)
        inputs.positions = torch.from_numpy(padded_positions(padded, batch.num_tokens))
        got = engine.runner.forward(inputs, engine.attn_backend.prepare)
    assert got.shape[0] == bucket.num_seqs and torch.isfinite(got).all()
    assert row_cosines(got[: batch.num_seqs].numpy(), expected.numpy()).min() > 0.99999


class _RecordingCapturer:
    """Stand-in for CudaCapturer: runs `fn` once at capture and replays by calling it again."""

    computes = False  # as a CUDA capture: the capturing step replays

    def __init__(self) -> None:
        self.calls: list[str] = []

    def fits(self, bucket: Bucket) -> bool:
        return True

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[_RecordingGraph, torch.Tensor]:
        self.calls.append("capture")
        return _RecordingGraph(self.calls), fn()


class _RecordingGraph:
    def __init__(self, calls: list[str]):
        self.calls = calls

    def replay(self) -> None:
        self.calls.append("replay")


def _run(graphs: LazyGraphs, bucket: Bucket, calls: list[str]) -> torch.Tensor:
    def eager() -> torch.Tensor:
        calls.append("eager")
        return torch.zeros(1)

    def capture() -> Callable[[], torch.Tensor]:
        calls.append("capture-setup")
        return lambda: calls.append("capture-forward") or torch.ones(1)

    return graphs.run(bucket, eager, capture, lambda: calls.append("before-replay"))


def test_lazy_policy_eager_then_capture_then_replay() -> None:
    capturer = _RecordingCapturer()
    graphs = LazyGraphs(capturer, max_graphs=4)
    bucket = Bucket(16, 1)
    for _ in range(4):
        _run(graphs, bucket, capturer.calls)
    assert capturer.calls == [
        "eager",
        "capture-setup",
        "capture",
        "capture-forward",
        "before-replay",
        "replay",
        "before-replay",
        "replay",
        "before-replay",
        "replay",
    ]
    assert (graphs.stats.eager, graphs.stats.captures, graphs.stats.replays) == (1, 1, 3)


def test_graph_bound_leaves_later_buckets_eager() -> None:
    capturer = _RecordingCapturer()
    graphs = LazyGraphs(capturer, max_graphs=2)
    buckets = [Bucket(16, 1), Bucket(32, 1), Bucket(64, 1)]
    for _ in range(3):
        for bucket in buckets:
            _run(graphs, bucket, capturer.calls)
    assert len(graphs.graphs) == 2 and capturer.calls.count("capture") == 2
    assert graphs.states[Bucket(64, 1)] is BucketState.EAGER
    assert graphs.stats.eager == 3 + 2  # every first hit, then the third bucket twice more


def test_capture_returns_the_static_output_and_replays_reuse_it() -> None:
    capturer = _RecordingCapturer()
    graphs = LazyGraphs(capturer, max_graphs=1)
    outputs = [_run(graphs, Bucket(16, 1), capturer.calls) for _ in range(3)]
    assert outputs[1] is outputs[2]


class _FailingCapturer:
    """A capture that raises, as a kernel that cannot be captured or a plan that outgrows its buffers does."""

    computes = False

    def __init__(self) -> None:
        self.attempts = 0

    def fits(self, bucket: Bucket) -> bool:
        return True

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[_RecordingGraph, torch.Tensor]:
        self.attempts += 1
        raise RuntimeError("operation not permitted when stream is capturing")


def test_failed_capture_leaves_the_bucket_eager_without_retrying() -> None:
    capturer = _FailingCapturer()
    graphs = LazyGraphs(capturer, max_graphs=4)  # type: ignore[arg-type]
    calls: list[str] = []
    outputs = [_run(graphs, Bucket(16, 1), calls) for _ in range(4)]
    assert capturer.attempts == 1 and all(out.item() == 0 for out in outputs)  # every step ran, eagerly
    assert graphs.states[Bucket(16, 1)] is BucketState.EAGER and not graphs.graphs
    assert "not permitted when stream is capturing" in graphs.capture_errors[Bucket(16, 1)]
    assert (graphs.stats.eager, graphs.stats.captures, graphs.stats.replays) == (4, 0, 0)


def test_static_buffers_load_writes_all_a_bucket_reads() -> None:
    """The buffers start uninitialised (no fill kernel on another stream): load must write every element of
    the bucket's views, token types included when the model has none."""
    buffers = StaticBuffers(Bucket(64, 8), torch.device("cpu"))
    for buffer in vars(buffers).values():
        buffer.fill_(7)
    batch = _batch([3, 5])
    bucket = Bucket(16, 4)
    padded = pad_batch(batch, bucket)
    inputs = buffers.load(padded, padded_positions(padded, batch.num_tokens), bucket)
    assert inputs.input_ids.tolist() == padded.input_ids.tolist()
    assert inputs.positions.tolist() == padded_positions(padded, batch.num_tokens).tolist()
    assert inputs.token_type_ids is not None and inputs.token_type_ids.tolist() == [0] * 16
    assert inputs.cu_seqlens.tolist() == [0, 3, 8, 16, 16] and inputs.cu_seqlens.dtype == torch.int32
    assert inputs.dimensions.tolist() == [0] * 4 and inputs.normalize.tolist() == [True, True, False, False]
    assert inputs.seq_lens == [3, 5, 8, 0] and inputs.max_seqlen == 16
    assert inputs.cu_seqlens.data_ptr() == buffers.cu_seqlens.data_ptr()  # views at the captured addresses


class _ReplayingCapturer:
    """Stand-in for CudaCapturer with CUDA graphs' semantics on the CPU: a replay runs the recorded function
    again and writes its result into the output tensor the capture returned."""

    computes = False

    def fits(self, bucket: Bucket) -> bool:
        return True

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[_Replay, torch.Tensor]:
        output = fn()
        return _Replay(fn, output), output


class _Replay:
    def __init__(self, fn: Callable[[], torch.Tensor], output: torch.Tensor):
        self.fn, self.output = fn, output

    def replay(self) -> None:
        self.output.copy_(self.fn())


class _CapturableCpuVarlen(CpuVarlenBackend):
    """cpu_varlen's metadata is the batch's cu_seqlens tensor itself (a static buffer's view in a graph) and the
    bucket's token count, both fixed per bucket: planning once at capture is all a replay needs."""

    supports_cuda_graphs = True

    def prepare_capture(self, ctx, key):
        return self.prepare(ctx)

    def prepare_replay(self, ctx, key) -> None:
        pass


@pytest.mark.parametrize("engine_name", ["minilm_fp32", "random_qwen3"])
def test_runner_graph_path_matches_eager(engine_name: str, request: pytest.FixtureRequest) -> None:
    """The runner's graph path (pad to the bucket, load the static buffers, warm up, capture, replay) gives the
    eager path's rows for every batch, batches that share a bucket included."""
    engine: Engine = request.getfixturevalue(engine_name)
    backend = _CapturableCpuVarlen()
    backend.bind(engine.attn_backend.shape)
    runner = ModelRunner(engine.model, engine.pooler, backend, engine.device)
    config = CudaGraphConfig(token_buckets=(16, 32, 64), seq_buckets=(2, 4, 8), max_graphs=4)
    runner.graphs = CudaGraphRunner(config, engine.device, backend, runner.forward, _ReplayingCapturer())
    generator = np.random.default_rng(0)
    batches = [_batch(lengths) for lengths in ([7, 12, 3], [5, 9, 1], [20, 2, 4], [3, 30], [1])]
    batches = [replace(b, input_ids=generator.integers(1000, 2000, b.num_tokens).astype(np.int32)) for b in batches]
    batches[2] = replace(
        batches[2], dimensions=np.array([0, 8, 0], np.int32), prompt_lens=np.array([2, 0, 1], np.int32)
    )
    try:
        with torch.inference_mode():
            for batch in batches * 3:  # each bucket: eager, then captured, then replayed
                # Both runners share the model's attention layers: each binds its backend before it runs (an
                # `auto` backend that dispatches by length carries metadata the capturable one cannot read).
                expected = ModelRunner(engine.model, engine.pooler, engine.attn_backend, engine.device).execute(batch)
                runner.set_backend(backend)
                got = runner.execute(batch)
                np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    finally:
        bind_backend(engine.model, engine.attn_backend)
    stats = runner.graphs.graphs.stats
    assert stats.captures >= 3 and stats.replays >= 3


def test_auto_graphs_record_the_backend_its_table_gives_each_batchs_longest_sequence(
    minilm_fp32: Engine,
) -> None:
    """`auto` over a capturable backend (short sequences) and SDPA (long ones): a batch whose longest sequence the
    table gives the capturable one is captured and replayed by it, chosen by that sequence and not by the bucket's
    token count (which the graph's context holds); a batch it gives SDPA runs eagerly, without turning graphs off
    for the others. Rows equal the eager path's throughout."""
    engine = minilm_fp32
    capturable = _CapturableCpuVarlen()
    auto = AutoBackend(
        {"cpu_varlen": capturable, "sdpa": SdpaBackend()}, BackendTable(((16, "cpu_varlen"), (512, "sdpa")))
    )
    auto.bind(engine.attn_backend.shape)
    runner = ModelRunner(engine.model, engine.pooler, auto, engine.device)
    config = CudaGraphConfig(token_buckets=(16, 32, 64, 128), seq_buckets=(2, 4, 8), max_graphs=8)
    runner.graphs = CudaGraphRunner(config, engine.device, auto, runner.forward, _ReplayingCapturer())
    short = [_batch([9, 12, 7, 14], seed) for seed in range(3)]  # 42 tokens: a 64-token bucket, longest 14
    long = [_batch([40, 5], seed) for seed in range(3)]  # the table gives 40 tokens to SDPA
    try:
        with torch.inference_mode():
            for batch in short + long:
                expected = ModelRunner(engine.model, engine.pooler, engine.attn_backend, engine.device).execute(batch)
                runner.set_backend(auto)
                np.testing.assert_allclose(runner.execute(batch).numpy(), expected.numpy(), rtol=1e-5, atol=1e-6)
    finally:
        bind_backend(engine.model, engine.attn_backend)
    lazy = runner.graphs.graphs
    assert list(lazy.graphs) == [Bucket(64, 8, 32, "cpu_varlen")]  # the pad sequence, 22 tokens, is the longest
    assert (lazy.stats.eager, lazy.stats.captures, lazy.stats.replays) == (1, 1, 2)  # the long batches: not graphs
