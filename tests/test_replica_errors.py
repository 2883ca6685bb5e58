"""Overload, deadlines, cancellation and bad input each get their status; a good request beside them succeeds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from conftest import embed_ids

from bouquet.batch import Batch, RowOptions
from bouquet.config import SchedulerConfig
from bouquet.proto.embedding_pb2 import EmbedRequest
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.request import DeadlineExpired
from bouquet.replica.testing import RecordingEngine, ReplicaThread, marked, markers_in_order, wait_until

CONFIG = SchedulerConfig(max_batch_tokens=256, max_batch_seqs=8, max_queue_tokens=100)
GOOD = [marked(90), marked(91, length=20)]


@pytest.fixture
def replica(recorder) -> Iterator[ReplicaThread]:
    server = ReplicaThread(recorder, CONFIG)
    yield server
    server.stop()


def hold_engine(stub, recorder: RecordingEngine) -> list[grpc.Future]:
    """Holds the engine with both steps in flight, so that whatever is sent next stays queued."""
    recorder.hold()
    calls = []
    for count, marker in enumerate((1, 2), start=1):
        calls.append(stub.Embed.future(embed_request(Batch.pack([marked(marker)]))))
        wait_until(lambda count=count: len(recorder.batches) == count)
    return calls


def assert_good(call: grpc.Future, engine) -> None:
    np.testing.assert_allclose(response_rows(call.result(timeout=120)), embed_ids(engine, GOOD), rtol=1e-4, atol=2e-5)


def status_of(call: grpc.Future) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        call.result(timeout=60)
    return error.value.code()


def test_over_the_queue_bound_is_resource_exhausted(stub, recorder, replica, minilm_fp32):
    blockers = hold_engine(stub, recorder)
    good = stub.Embed.future(embed_request(Batch.pack(GOOD)))  # 26 tokens of the 100 the queue holds
    wait_until(lambda: replica.scheduler.queued_seqs == 2)
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(embed_request(Batch.pack([marked(60, length=80)])), timeout=10)
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "queue full" in error.value.details() and "100 tokens" in error.value.details()
    recorder.release()
    assert_good(good, minilm_fp32)
    for call in blockers:
        call.result(timeout=60)
    assert 60 not in markers_in_order(recorder.batches)
    assert replica.server.metrics.value("bouquet_requests_total", {"status": "RESOURCE_EXHAUSTED"}) == 1


def test_expired_deadline_is_not_computed(stub, recorder, replica, minilm_fp32):
    blockers = hold_engine(stub, recorder)
    late = stub.Embed.future(embed_request(Batch.pack([marked(40)])), timeout=0.3)
    good = stub.Embed.future(embed_request(Batch.pack(GOOD)))
    assert status_of(late) == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: replica.scheduler.queued_seqs == len(GOOD))  # the expired call's sequence left the queue
    recorder.release()
    assert_good(good, minilm_fp32)
    assert all(call.result(timeout=60) for call in blockers)
    assert 40 not in markers_in_order(recorder.batches)


def test_scheduler_fails_work_whose_deadline_passed_in_the_queue(replica, recorder, minilm_fp32):
    async def run() -> list[object]:
        scheduler = replica.scheduler
        loop = asyncio.get_running_loop()
        recorder.hold()
        blockers = []
        for marker in (1, 2):  # one step each: both in flight, held
            blockers.append(asyncio.create_task(scheduler.embed(Batch.pack([marked(marker)]))))
            await asyncio.sleep(0.05)
        late = asyncio.create_task(scheduler.embed(Batch.pack([marked(41)]), deadline=loop.time() + 0.1))
        good = asyncio.create_task(scheduler.embed(Batch.pack(GOOD)))
        await asyncio.sleep(0.3)
        recorder.release()
        return await asyncio.gather(late, good, *blockers, return_exceptions=True)

    late, good, *_ = replica.call(run())
    assert isinstance(late, DeadlineExpired)
    np.testing.assert_allclose(good, embed_ids(minilm_fp32, GOOD), rtol=1e-4, atol=2e-5)
    assert 41 not in markers_in_order(recorder.batches)


def test_cancelled_call_is_dropped_from_the_queue(stub, recorder, replica, minilm_fp32):
    blockers = hold_engine(stub, recorder)  # kept: a dropped grpc future cancels its call
    cancelled = stub.Embed.future(embed_request(Batch.pack([marked(50), marked(51)])))
    wait_until(lambda: replica.scheduler.queued_seqs == 2)
    cancelled.cancel()
    wait_until(lambda: replica.scheduler.queued_seqs == 0 and replica.scheduler.queued_tokens == 0)
    good = stub.Embed.future(embed_request(Batch.pack(GOOD)))
    wait_until(lambda: replica.scheduler.queued_seqs == len(GOOD))
    recorder.release()
    assert_good(good, minilm_fp32)
    assert all(call.result(timeout=60) for call in blockers)
    assert not {50, 51} & set(markers_in_order(recorder.batches))
    assert replica.server.metrics.value("bouquet_requests_total", {"status": "CANCELLED"}) == 1


def int32s(values: list[int]) -> bytes:
    return np.array(values, "<i4").tobytes()


def wire(input_ids: list[int], cu_seqlens: list[int], token_type_ids: list[int] | None = None) -> EmbedRequest:
    """A request built by hand, bypassing the client's packing, so it can be wrong in every way."""
    types = b"" if token_type_ids is None else int32s(token_type_ids)
    return EmbedRequest(input_ids=int32s(input_ids), cu_seqlens=int32s(cu_seqlens), token_type_ids=types)


BAD_REQUESTS = {
    "id past the vocabulary": wire([101, 30522, 102], [0, 3]),
    "negative id": wire([101, -1, 102], [0, 3]),
    "empty sequence": wire([101, 102], [0, 0, 2]),
    "no sequences": EmbedRequest(),
    "boundaries not starting at 0": wire([101, 7, 102], [1, 3]),
    "boundaries short of the ids": wire([101, 7, 102], [0, 2]),
    "boundaries going back": wire([101, 7, 102], [0, 3, 1, 3]),
    "longer than the model": embed_request(Batch.pack([marked(70, length=257)])),
    "dimensions over the width": embed_request(Batch.pack([marked(71)], RowOptions(dimensions=385))),
    "token types of another length": wire([101, 7, 102], [0, 3], token_type_ids=[0, 0]),
    "token type past the table": embed_request(Batch.pack([[101, 7, 102]], token_type_ids=[[0, 2, 0]])),
    "ids not whole int32s": EmbedRequest(input_ids=int32s([101, 7, 102])[:-1], cu_seqlens=int32s([0, 3])),
    "boundaries not whole int32s": EmbedRequest(input_ids=int32s([101, 7, 102]), cu_seqlens=int32s([0, 3]) + b"\x00"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_invalid_argument_and_never_reaches_the_engine(case, stub, recorder, minilm_fp32):
    recorder.hold()
    good = stub.Embed.future(embed_request(Batch.pack(GOOD)))
    with pytest.raises(grpc.RpcError) as error:
        stub.Embed(BAD_REQUESTS[case], timeout=10)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    recorder.release()
    assert_good(good, minilm_fp32)
    assert markers_in_order(recorder.batches) == [90, 91]


def test_metrics_listen_on_the_replicas_own_host() -> None:
    from bouquet.replica.server import listen_host

    assert listen_host("127.0.0.1:50051") == "127.0.0.1"
    assert listen_host("[::1]:50051") == "::1"
    assert listen_host("0.0.0.0:1") == listen_host(":1") == listen_host("[::]:1") == "0.0.0.0"
    assert listen_host("unix:/run/bouquet/replica0.sock") == "127.0.0.1"
