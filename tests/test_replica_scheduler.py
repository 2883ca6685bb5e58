"""The replica over real gRPC on loopback with the real all-MiniLM-L6-v2: results, batching, order, health."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import corpus
import grpc
import numpy as np
import pytest
from conftest import embed_ids
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bouquet.batch import Batch, RowOptions
from bouquet.config import SchedulerConfig
from bouquet.proto import embedding_pb2, embedding_pb2_grpc
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.testing import ReplicaThread, marked, markers_in_order, wait_until

BUDGET = SchedulerConfig(max_batch_tokens=256, max_batch_seqs=8)


@pytest.fixture
def replica(recorder) -> Iterator[ReplicaThread]:
    server = ReplicaThread(recorder, BUDGET)
    yield server
    server.stop()


def test_concurrent_clients_get_the_offline_embeddings_in_order(stub, recorder, minilm_fp32, minilm_tokenizer):
    texts = corpus.parity_texts()[::4]  # documents of every length, queries, non-ASCII, one-word texts
    ids = minilm_tokenizer.encode(texts)
    chunks = [ids[i : i + 7] for i in range(0, len(ids), 7)]
    options = [(0, True), (128, True), (0, False), (32, False)]  # (dimensions, normalize)

    def call(index: int) -> np.ndarray:
        dimensions, normalize = options[index % len(options)]
        return response_rows(
            stub.Embed(embed_request(Batch.pack(chunks[index], RowOptions(dimensions, normalize))), timeout=120)
        )

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(call, range(len(chunks))))
    for index, rows in enumerate(results):
        dimensions, normalize = options[index % len(options)]
        expected = embed_ids(minilm_fp32, chunks[index], normalize, dimensions)[:, : dimensions or 384]
        assert rows.shape == expected.shape
        np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=2e-5)
    assert len(recorder.batches) > len(chunks) // 2  # requests really were split and merged across steps


def test_batches_respect_the_budget(stub, recorder, replica, minilm_tokenizer):
    ids = minilm_tokenizer.encode(corpus.documents(40))
    with ThreadPoolExecutor(max_workers=6) as pool:
        list(
            pool.map(
                lambda i: stub.Embed(embed_request(Batch.pack(ids[i : i + 5])), timeout=120), range(0, len(ids), 5)
            )
        )
    for batch in recorder.batches:
        assert batch.num_seqs <= BUDGET.max_batch_seqs
        assert batch.num_tokens <= BUDGET.max_batch_tokens or batch.num_seqs == 1
    metrics = replica.server.metrics
    assert metrics.value("bouquet_batch_tokens_count") == len(recorder.batches)
    assert metrics.value("bouquet_batch_tokens_sum") == sum(batch.num_tokens for batch in recorder.batches)
    assert metrics.value("bouquet_requests_total", {"status": "OK"}) == len(range(0, len(ids), 5))
    assert metrics.value("bouquet_queue_tokens") == 0 and metrics.value("bouquet_steps_in_flight") == 0


def test_oversized_sequence_runs_alone(recorder, minilm_fp32):
    small_budget = SchedulerConfig(max_batch_tokens=64, max_batch_seqs=8)
    long_seq = marked(7, length=200)
    sequences = [marked(5), marked(6), long_seq, marked(8), marked(9)]
    replica = ReplicaThread(recorder, small_budget)
    try:
        with grpc.insecure_channel(replica.address) as channel:
            stub = embedding_pb2_grpc.EmbeddingStub(channel)
            rows = response_rows(stub.Embed(embed_request(Batch.pack(sequences)), timeout=120))
    finally:
        replica.stop()
    np.testing.assert_allclose(rows, embed_ids(minilm_fp32, sequences), rtol=1e-4, atol=2e-5)
    alone = [batch for batch in recorder.batches if batch.num_tokens > small_budget.max_batch_tokens]
    assert len(alone) == 1 and alone[0].num_seqs == 1 and alone[0].num_tokens == len(long_seq)
    assert markers_in_order(recorder.batches) == [5, 6, 7, 8, 9]


def test_first_come_first_served_across_batches(stub, recorder, replica):
    recorder.hold()
    calls = []
    for marker in (1, 2):  # both steps in flight, held: everything after them queues
        calls.append(stub.Embed.future(embed_request(Batch.pack([marked(marker)]))))
        wait_until(lambda marker=marker: len(recorder.batches) == marker)
    large = [marked(100 + i, length=60) for i in range(12)]  # 720 tokens: several batches of 256
    order = [(large, list(range(100, 112))), ([marked(20), marked(21)], [20, 21]), ([marked(30)], [30])]
    for sequences, _ in order:
        queued = replica.scheduler.queued_seqs
        calls.append(stub.Embed.future(embed_request(Batch.pack(sequences))))
        wait_until(lambda queued=queued: replica.scheduler.queued_seqs > queued)
    recorder.release()
    for call in calls:
        call.result(timeout=120)
    expected = [1, 2, *(marker for _, markers in order for marker in markers)]
    assert markers_in_order(recorder.batches) == expected  # the small late requests never overtook the large one
    assert all(batch.num_tokens <= BUDGET.max_batch_tokens for batch in recorder.batches)


def test_info_describes_the_model(stub):
    info = stub.Info(embedding_pb2.InfoRequest(), timeout=10)
    assert (info.model_name, info.dimension, info.max_seq_length, info.pooling) == ("model", 384, 256, "mean")
    assert (info.dtype, info.device, info.vocab_size, info.max_batch_tokens) == ("float32", "cpu", 30522, 256)
    assert info.architecture == "BertModel" and info.default_prompt_name == ""


def test_health_serving_only_once_the_model_is_attached(recorder):
    replica = ReplicaThread(recorder, BUDGET, attach=False)
    try:
        with grpc.insecure_channel(replica.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            check = health_pb2.HealthCheckRequest(service="bouquet.v1.Embedding")
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.RpcError) as error:
                embedding_pb2_grpc.EmbeddingStub(channel).Embed(embed_request(Batch.pack([marked(1)])), timeout=10)
            assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            replica.attach()
            assert health.Check(check, timeout=10).status == health_pb2.HealthCheckResponse.SERVING
            overall = health.Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert overall.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        replica.stop()
