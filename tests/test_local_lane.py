"""The local lane (replica/lane_server.py, gateway/replicas/lane.py): a real replica on a Unix socket with the real
MiniLM engine, its lane's calls against the same calls on gRPC, every way a call can fail, and the gateway's pool
using the lane and falling back to gRPC when it goes."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from bouquet.batch import Batch
from bouquet.config import SchedulerConfig
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.replicas.catalog import ModelCatalog
from bouquet.gateway.replicas.lane import Lane, LaneRefused
from bouquet.gateway.replicas.pool import ReplicaPool
from bouquet.proto import embedding_pb2, embedding_pb2_grpc
from bouquet.proto.embedding_pb2 import EmbedRequest, EmbedResponse
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.lane_frames import HEADER, Kind, frame
from bouquet.replica.testing import RecordingEngine, ReplicaThread, marked, markers_in_order, wait_until

CONFIG = SchedulerConfig(max_batch_tokens=256, max_batch_seqs=8, max_queue_tokens=1000)
TOKEN = "lane-test-token"


@pytest.fixture
def replica(recorder: RecordingEngine, tmp_path: Path) -> Iterator[ReplicaThread]:
    server = ReplicaThread(recorder, CONFIG, listen=f"unix:{tmp_path}/replica.sock", token=TOKEN)
    yield server
    server.stop()


def info_of(replica: ReplicaThread) -> embedding_pb2.InfoResponse:
    with grpc.insecure_channel(replica.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingStub(channel)
        info: embedding_pb2.InfoResponse = stub.Info(
            embedding_pb2.InfoRequest(), metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        return info


def grpc_rows(replica: ReplicaThread, request: EmbedRequest) -> np.ndarray:
    with grpc.insecure_channel(replica.address) as channel:
        reply = embedding_pb2_grpc.EmbeddingStub(channel).Embed(
            request, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        return response_rows(reply)


async def open_lane(replica: ReplicaThread, nonce: str | None = None, token: str | None = TOKEN) -> Lane:
    info = info_of(replica)
    return await Lane.open(info.lane_path, info.lane_nonce if nonce is None else nonce, token)


def test_info_names_the_lane_beside_the_socket_and_a_tcp_replica_has_none(replica, recorder):
    info = info_of(replica)
    assert info.lane_path == replica.address.removeprefix("unix:") + ".lane" and len(info.lane_nonce) == 32
    assert Path(info.lane_path).stat().st_mode & 0o777 == 0o600  # only this user's processes may connect
    tcp = ReplicaThread(recorder, CONFIG)
    try:
        with grpc.insecure_channel(tcp.address) as channel:
            tcp_info = embedding_pb2_grpc.EmbeddingStub(channel).Info(embedding_pb2.InfoRequest())
        assert tcp_info.lane_path == "" and tcp.server.lane is None  # its gateways may be on other hosts
    finally:
        tcp.stop()


def test_lane_rows_are_grpc_rows_with_calls_in_flight_together(replica):
    batches = [Batch.pack([marked(10 + i, length=5 + 7 * i)]) for i in range(6)]

    async def run() -> list[EmbedResponse]:
        lane = await open_lane(replica)
        try:
            return list(await asyncio.gather(*(lane.embed(embed_request(b), timeout=60) for b in batches)))
        finally:
            await lane.close()

    info_of(replica)  # the lane's Info, counted before
    before = replica.server.metrics.value("bouquet_requests_total", {"status": "OK"})
    replies = asyncio.run(run())
    assert replica.server.metrics.value("bouquet_requests_total", {"status": "OK"}) == before + 7  # as gRPC's are
    for batch, reply in zip(batches, replies, strict=True):  # batched together there, alone here: float32's noise
        np.testing.assert_allclose(response_rows(reply), grpc_rows(replica, embed_request(batch)), rtol=1e-4, atol=1e-5)


def test_another_replicas_nonce_or_a_wrong_token_is_refused(replica):
    async def run() -> None:
        with pytest.raises(LaneRefused, match="another replica"):
            await open_lane(replica, nonce="0" * 32)
        with pytest.raises(LaneRefused, match="token"):
            await open_lane(replica, token="wrong")
        with pytest.raises(LaneRefused, match="token"):
            await open_lane(replica, token=None)
        lane = await open_lane(replica)
        assert lane.open_now
        await lane.close()

    asyncio.run(run())


def test_bad_input_gets_its_status_and_the_connection_serves_on(replica, recorder, minilm_fp32):
    async def run() -> tuple[grpc.aio.AioRpcError, grpc.aio.AioRpcError, EmbedResponse]:
        lane = await open_lane(replica)
        try:
            out_of_vocabulary = embed_request(Batch.pack([[101, 10**6, 102]]))
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await lane.embed(out_of_vocabulary, timeout=30)
            with pytest.raises(grpc.aio.AioRpcError) as unreadable:  # bytes that are no EmbedRequest
                await lane.embed(_Garbage(), timeout=30)  # type: ignore[arg-type]
            return bad.value, unreadable.value, await lane.embed(embed_request(Batch.pack([marked(7)])), timeout=30)
        finally:
            await lane.close()

    bad, unreadable, good = asyncio.run(run())
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT and "input_ids holds 1000000" in (bad.details() or "")
    assert unreadable.code() == grpc.StatusCode.INVALID_ARGUMENT and "EmbedRequest" in (unreadable.details() or "")
    np.testing.assert_array_equal(response_rows(good), minilm_fp32.embed(Batch.pack([marked(7)])))


class _Garbage:
    def SerializeToString(self) -> bytes:
        return b"\xff\xff\xff\xff"


def test_a_late_or_cancelled_call_is_dropped_before_it_is_computed(replica, recorder):
    async def run() -> tuple[grpc.StatusCode, bool]:
        lane = await open_lane(replica)
        try:
            recorder.hold()  # two steps in flight: what comes next waits in the queue
            blockers = [asyncio.ensure_future(lane.embed(embed_request(Batch.pack([marked(m)])), 60)) for m in (1, 2)]
            await asyncio.to_thread(wait_until, lambda: len(recorder.batches) == 2)
            late = asyncio.ensure_future(lane.embed(embed_request(Batch.pack([marked(40)])), timeout=0.3))
            gone = asyncio.ensure_future(lane.embed(embed_request(Batch.pack([marked(41)])), timeout=60))
            await asyncio.to_thread(wait_until, lambda: replica.scheduler.queued_seqs == 2)
            gone.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await late
            await asyncio.to_thread(wait_until, lambda: replica.scheduler.queued_seqs == 0)
            recorder.release()
            await asyncio.gather(*blockers)
            return error.value.code(), gone.cancelled()
        finally:
            await lane.close()

    code, cancelled = asyncio.run(run())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED and cancelled
    assert not {40, 41} & set(markers_in_order(recorder.batches))


def test_calls_in_flight_end_unavailable_when_the_lane_closes(replica, recorder):
    async def run() -> tuple[grpc.StatusCode, grpc.StatusCode, bool]:
        lane = await open_lane(replica)
        try:
            recorder.hold()
            call = asyncio.ensure_future(lane.embed(embed_request(Batch.pack([marked(3)])), timeout=60))
            await asyncio.to_thread(wait_until, lambda: len(recorder.batches) == 1)
            assert replica.server.lane is not None
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(replica.server.lane.stop(), replica.loop))
            with pytest.raises(grpc.aio.AioRpcError) as in_flight:
                await call
            with pytest.raises(grpc.aio.AioRpcError) as after:
                await lane.embed(embed_request(Batch.pack([marked(4)])), timeout=60)
            return in_flight.value.code(), after.value.code(), lane.open_now
        finally:
            recorder.release()
            await lane.close()

    assert asyncio.run(run()) == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE, False)


def test_a_garbled_connection_is_closed_and_the_replica_serves_on(replica):
    path = info_of(replica).lane_path
    for garbage in (b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64, frame(Kind.REPLY, 1)):  # not a HELLO
        with socket.socket(socket.AF_UNIX) as raw:
            raw.connect(path)
            raw.sendall(garbage)
            raw.settimeout(10)
            answer = b"".join(iter(lambda: raw.recv(4096), b""))  # until the replica closes the connection
            assert answer == b"" or Kind(HEADER.unpack(answer[: HEADER.size])[0]) is Kind.REFUSED

    async def run() -> EmbedResponse:
        lane = await open_lane(replica)
        try:
            await lane.embed(embed_request(Batch.pack([marked(5)])), timeout=30)
            lane._writer.write(frame(Kind(6), 99))  # a REPLY from a gateway: a broken peer
            await asyncio.sleep(0.2)
            assert not lane.open_now  # the replica closed that connection...
            fresh = await open_lane(replica)  # ...and takes new ones
            try:
                return await fresh.embed(embed_request(Batch.pack([marked(6)])), timeout=30)
            finally:
                await fresh.close()
        finally:
            await lane.close()

    assert response_rows(asyncio.run(run())).shape == (1, 384)


def test_the_pool_embeds_on_the_lane_and_moves_a_call_to_grpc_when_the_lane_goes(replica, recorder, caplog):
    async def run() -> tuple[bool, np.ndarray, np.ndarray, bool]:
        catalog = ModelCatalog((), ThreadPoolExecutor(1))
        pool = ReplicaPool((replica.address,), catalog, GatewayMetrics(), token=TOKEN, probe_interval=0.05)
        pool.start()
        try:
            await pool.first_round(30)
            model = pool.replicas[0].model
            assert model is not None
            lane = pool.replicas[0].lane
            on_lane = lane is not None and lane.open_now
            first = await pool.embed(model.name, Batch.pack([marked(8)]))
            recorder.hold()
            in_flight = asyncio.ensure_future(pool.embed(model.name, Batch.pack([marked(8)])))
            await asyncio.to_thread(wait_until, lambda: len(recorder.batches) == 2)
            assert replica.server.lane is not None
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(replica.server.lane.stop(), replica.loop))
            recorder.release()
            # The call ends UNAVAILABLE on the lane; the replica is marked down, found serving again, its lane gone
            # (said once), and the call is retried there on gRPC.
            second = await asyncio.wait_for(in_flight, timeout=30)
            return on_lane, np.asarray(first), np.asarray(second), pool.replicas[0].lane is None
        finally:
            recorder.release()
            await pool.close()

    with caplog.at_level(logging.INFO, logger="bouquet.gateway.replicas"):
        on_lane, first, second, back_on_grpc = asyncio.run(run())
    assert on_lane and back_on_grpc
    np.testing.assert_array_equal(first, second)
    said = [r.getMessage() for r in caplog.records if "local lane could not be opened" in r.getMessage()]
    assert len(said) == 1 and "FileNotFoundError" in said[0]
    assert any("marking it down" in r.getMessage() for r in caplog.records)
