"""Span pooling, several rows from one sequence, on every hop: the packed batch (pack, slice, concat, rows), the
wire (bytes round trip, every malformed span refused), the pooler (means, Dense unless raw, the head), the engine
against transformers, the CUDA-graph runner (spans run eagerly), and the scheduler over gRPC (rows per request
are not sequences per request)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_batch import FIELDS, assert_same
from test_cuda_graphs import _CapturableCpuVarlen, _ReplayingCapturer

from bouquet.batch import Batch, RowOptions
from bouquet.config import CudaGraphConfig, SchedulerConfig
from bouquet.engine.cuda_graphs import CudaGraphRunner
from bouquet.engine.engine import Engine
from bouquet.engine.inputs import prepare_spans
from bouquet.engine.model_runner import ModelRunner
from bouquet.layers.attention import bind_backend
from bouquet.layers.pooling import Pooler
from bouquet.model_dir import DenseSpec, PoolingMethod, PoolingSpec
from bouquet.proto import embedding_pb2
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.replica.testing import ReplicaThread

SPAN_FIELDS = (*FIELDS, "cu_spans", "span_bounds", "raw_spans")
LIMITS = Limits(vocab_size=30522, type_vocab_size=2, max_seq_length=256, dimension=384, hidden_size=384)
IDS = [[101, 2023, 2003, 1037, 3231, 6251, 102], [101, 7592, 2088, 102], [101, 2129, 2024, 2017, 1029, 102]]
SPANS = [[(1, 3), (3, 6), (0, 7)], [], [(2, 3)]]


def assert_same_spans(a: Batch, b: Batch) -> None:
    assert_same(a, b)
    for name in SPAN_FIELDS[len(FIELDS) :]:
        left, right = getattr(a, name), getattr(b, name)
        assert (left is None) == (right is None), name
        if left is not None:
            np.testing.assert_array_equal(left, right, err_msg=name)


# The packed batch


def test_pack_lays_spans_out_and_counts_rows() -> None:
    batch = Batch.pack(IDS, RowOptions(normalize=False), spans=SPANS)
    assert batch.cu_spans.tolist() == [0, 3, 3, 4] and batch.cu_spans.dtype == np.int32
    assert batch.span_bounds.tolist() == [[1, 3], [3, 6], [0, 7], [2, 3]] and batch.span_bounds.dtype == np.int32
    assert batch.raw_spans.tolist() == [False] * 3
    assert batch.cu_rows.tolist() == [0, 3, 4, 5] and batch.num_rows == 5
    assert Batch.pack(IDS).num_rows == 3 and Batch.pack(IDS).cu_spans is None
    assert batch.options() == RowOptions(normalize=False)
    assert Batch.pack(IDS[:1], RowOptions(raw_spans=True), spans=SPANS[:1]).options().raw_spans


def test_span_slices_concatenate_back_to_the_batch() -> None:
    batch = Batch.pack(IDS, spans=SPANS)
    middle = batch.slice(1, 3)
    assert middle.cu_spans.tolist() == [0, 0, 1] and middle.span_bounds.tolist() == [[2, 3]]
    assert_same_spans(Batch.concat([batch.slice(0, 1), middle]), batch)
    assert_same_spans(Batch.concat([batch.slice(0, 2), batch.slice(2, 3)]), batch)


def test_concat_with_a_batch_without_spans_gives_its_sequences_none() -> None:
    raw = Batch.pack(IDS[:1], RowOptions(normalize=False, raw_spans=True), spans=[[(0, 1), (1, 2)]])
    step = Batch.concat([Batch.pack(IDS[1:]), raw])
    assert step.cu_spans.tolist() == [0, 0, 0, 2] and step.raw_spans.tolist() == [False, False, True]
    assert step.cu_rows.tolist() == [0, 1, 2, 4]
    with pytest.raises(ValueError, match="different row options"):
        step.options()


# The wire


def test_spans_round_trip_the_wire() -> None:
    sent = Batch.pack(IDS, RowOptions(16, False), spans=SPANS).slice(0, 3)
    request = embed_request(sent)
    assert request.cu_spans == np.array([0, 3, 3, 4], "<i4").tobytes() and not request.raw_spans
    received = decode_request(embedding_pb2.EmbedRequest.FromString(request.SerializeToString()), LIMITS)
    assert_same_spans(received, sent)
    raw = Batch.pack(IDS[1:], RowOptions(normalize=False, raw_spans=True), spans=[[(0, 4)], [(5, 6)]])
    assert_same_spans(decode_request(embed_request(raw), LIMITS), raw)
    assert decode_request(embed_request(Batch.pack(IDS)), LIMITS).cu_spans is None


def _request(cu_spans: list[int], bounds: list[int], raw: bool = False) -> embedding_pb2.EmbedRequest:
    request = embed_request(Batch.pack(IDS[:2]))  # sequences of 7 and 4 tokens
    request.cu_spans = np.array(cu_spans, "<i4").tobytes()
    request.span_bounds = np.array(bounds, "<i4").tobytes()
    request.raw_spans = raw
    return request


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (_request([0, 1], [0, 1]), "cu_spans must hold 3 values"),
        (_request([0, 1, 1], [0, 1, 2, 3]), "cu_spans must hold 3 values"),
        (_request([0, 2, 1], [0, 1]), "cu_spans decreases at sequence 1"),
        (_request([0, 0, 5], [0, 1] * 5), "sequence 1 has 5 spans, more than its 4 tokens"),
        (_request([0, 1, 2], [0, 7, 3, 5]), r"span 1 is \[3, 5\)"),
        (_request([0, 1, 1], [2, 2]), r"span 0 is \[2, 2\)"),
        (_request([0, 1, 1], [-1, 2]), r"span 0 is \[-1, 2\)"),
        (_request([0, 1, 1], [0, 1], raw=True), "raw_spans: sequence 1 has no spans"),
    ],
    ids=["short", "long", "decreasing", "too-many", "past-end", "empty", "negative", "raw-without"],
)
def test_malformed_spans_are_invalid_input(request_: embedding_pb2.EmbedRequest, message: str) -> None:
    with pytest.raises(InvalidInput, match=message):
        decode_request(request_, LIMITS)


def test_spans_need_cu_spans_and_a_model_that_can_pool_them() -> None:
    request = embed_request(Batch.pack(IDS[:1]))
    request.span_bounds = np.array([0, 1], "<i4").tobytes()
    with pytest.raises(InvalidInput, match="need cu_spans"):
        decode_request(request, LIMITS)
    with pytest.raises(InvalidInput, match="cannot be pooled over spans"):
        decode_request(_request([0, 1, 1], [0, 2]), replace(LIMITS, mean_spans=False))
    raw = decode_request(_request([0, 1, 2], [0, 2, 0, 1], raw=True), replace(LIMITS, mean_spans=False))
    assert raw.options().raw_spans  # token states need no head: any model gives them


def test_raw_rows_may_be_truncated_to_the_hidden_width_only() -> None:
    limits = replace(LIMITS, dimension=128)  # a model whose Dense modules give 128 values
    request = _request([0, 1, 2], [0, 2, 0, 1], raw=True)
    request.dimensions = 384
    assert decode_request(request, limits).options().dimensions == 384
    request.raw_spans = False
    with pytest.raises(InvalidInput, match=r"dimensions must be in \[0, 128\]"):
        decode_request(request, limits)


# The pooler


def test_span_rows_go_through_dense_unless_raw(tmp_path: Path) -> None:
    dense = DenseSpec(8, 3, True, "Tanh", False, (tmp_path / "unused",))
    pooler = Pooler(PoolingSpec((PoolingMethod.CLS,)), 8, (dense,)).eval()
    hidden = torch.randn(9, 8, generator=torch.Generator().manual_seed(0))
    batch = Batch.concat(
        [
            Batch.pack([[1] * 5], RowOptions(normalize=False), spans=[[(1, 4), (0, 2)]]),
            Batch.pack([[1] * 4], RowOptions(normalize=False, raw_spans=True), spans=[[(2, 4)]]),
        ]
    )
    spans = prepare_spans(batch, torch.device("cpu"))
    args = (torch.tensor(batch.cu_seqlens), torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
    with torch.inference_mode():
        rows = pooler(hidden, *args, torch.zeros(2, dtype=torch.bool), spans=spans)
        expected_dense = pooler.dense[0](torch.stack([hidden[1:4].mean(0), hidden[0:2].mean(0)]))
    assert rows.shape == (3, 8)  # the raw row's hidden width; the Dense rows padded with zeros beyond their 3
    torch.testing.assert_close(rows[:2, :3], expected_dense)
    assert not rows[:2, 3:].any()
    torch.testing.assert_close(rows[2], hidden[5 + 2 : 5 + 4].mean(0))


# The engine, against transformers


@pytest.fixture(scope="module")
def last_hidden_states(minilm_path: Path) -> list[np.ndarray]:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(minilm_path)).eval()
    with torch.inference_mode():
        return [model(torch.tensor([ids])).last_hidden_state[0].numpy() for ids in IDS]


def test_engine_span_rows_are_span_means_of_the_whole_forward(minilm_fp32: Engine, last_hidden_states) -> None:
    rows = minilm_fp32.embed(Batch.pack(IDS, RowOptions(normalize=False), spans=SPANS))
    states = last_hidden_states
    expected = [states[0][1:3].mean(0), states[0][3:6].mean(0), states[0].mean(0), None, states[2][2:3].mean(0)]
    assert rows.shape == (5, 384)
    for row, reference in zip(rows, expected, strict=True):
        if reference is not None:
            np.testing.assert_allclose(row, reference, rtol=1e-4, atol=2e-5)
    plain = minilm_fp32.embed(Batch.pack(IDS[1:2], RowOptions(normalize=False)))  # no spans: the model's pooling
    np.testing.assert_allclose(rows[3], plain[0], rtol=1e-5, atol=1e-6)
    normalized = minilm_fp32.embed(Batch.pack(IDS[:1], RowOptions(dimensions=32), spans=SPANS[:1]))
    np.testing.assert_allclose(np.linalg.norm(normalized, axis=1), 1.0, rtol=1e-5)
    assert normalized.shape == (3, 384) and not normalized[:, 32:].any()


def test_raw_spans_of_one_token_are_the_last_hidden_state(minilm_fp32: Engine, last_hidden_states) -> None:
    spans = [[(i, i + 1) for i in range(len(ids))] for ids in IDS]
    rows = minilm_fp32.embed(Batch.pack(IDS, RowOptions(normalize=False, raw_spans=True), spans=spans))
    np.testing.assert_allclose(rows, np.concatenate(last_hidden_states), rtol=1e-4, atol=1e-4)


def test_cuda_graph_runner_leaves_span_batches_to_the_eager_path(minilm_fp32: Engine) -> None:
    engine = minilm_fp32
    backend = _CapturableCpuVarlen()
    backend.bind(engine.attn_backend.shape)
    runner = ModelRunner(engine.model, engine.pooler, backend, engine.device)
    config = CudaGraphConfig(token_buckets=(16, 32), seq_buckets=(2, 4, 8), max_graphs=4)
    runner.graphs = CudaGraphRunner(config, engine.device, backend, runner.forward, _ReplayingCapturer())
    batch = Batch.pack(IDS, spans=SPANS)
    try:
        with torch.inference_mode():
            assert runner.graphs.run(batch) is None
            for _ in range(3):  # would be eager, captured, replayed without spans
                # The runners share the model's attention layers: each binds its backend before it runs.
                bind_backend(engine.model, engine.attn_backend)
                expected = engine.embed(batch)
                runner.set_backend(backend)
                np.testing.assert_allclose(runner.execute(batch).numpy(), expected, rtol=1e-5, atol=1e-6)
    finally:
        bind_backend(engine.model, engine.attn_backend)
    assert runner.graphs.graphs.stats.captures == 0 and runner.graphs.graphs.stats.eager == 0


# The scheduler, over gRPC


@pytest.fixture
def replica(recorder) -> Iterator[ReplicaThread]:
    server = ReplicaThread(recorder, SchedulerConfig(max_batch_tokens=12, max_batch_seqs=8))
    yield server
    server.stop()


def test_scheduler_hands_out_span_rows_per_request(stub, recorder, replica, minilm_fp32: Engine) -> None:
    """Requests with and without spans share steps (a budget of 12 tokens splits them); each gets its rows."""
    batches = [
        Batch.pack(IDS, RowOptions(normalize=False), spans=SPANS),
        Batch.pack(IDS[::-1]),
        Batch.pack(IDS, RowOptions(normalize=False, raw_spans=True), spans=[[(0, 1), (6, 7)], [(1, 3)], [(0, 6)]]),
        Batch.pack(IDS[1:], RowOptions(dimensions=16), spans=[[(1, 2)], [(1, 2), (2, 5)]]),
    ]
    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(lambda b: response_rows(stub.Embed(embed_request(b), timeout=120)), batches))
    for batch, rows in zip(batches, results, strict=True):
        expected = minilm_fp32.embed(batch)[:, : batch.width(384)]
        assert rows.shape == expected.shape == (batch.num_rows, batch.width(384))
        np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=2e-5)
    assert any(b.cu_spans is not None and b.num_seqs < 3 for b in recorder.batches)  # span requests were split
