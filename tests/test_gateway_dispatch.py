"""The pool's dispatch without processes: replicas whose Embed is a fake that the test releases. Each replica is
kept only a window of work ahead, queries' chunks overtake bulk ones, an attempt that runs past the deadline its
replica's speed predicts is moved to another replica and the slow one ejected, and a replica with no alternative
keeps the whole request timeout."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from bouquet.batch import Batch
from bouquet.gateway.errors import Unavailable
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.replicas.catalog import ModelCatalog, ServedModel
from bouquet.gateway.replicas.pool import ReplicaPool
from bouquet.gateway.replicas.replica import ServiceRate
from bouquet.proto import embedding_pb2

BATCH_TOKENS = 100  # the window is four batches: 400 tokens


def _model() -> ServedModel:
    return ServedModel(
        name="m", aliases=(), dimension=2, max_seq_length=512, vocab_size=1000, family="bert", architecture="x",
        task="embed", score_activation="none", pooling="mean", normalize=True, dtype="float32",
        max_batch_tokens=BATCH_TOKENS, prompts={}, default_prompt_name=None, tokenizer=None,
    )  # fmt: skip


class _Deadline(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(), grpc.aio.Metadata())


class FakeStub:
    """Embed answers when the test says so (or never, for a stuck replica), honouring the call's timeout."""

    def __init__(self, name: str, log: list[tuple[str, int]], stuck: bool = False):
        self.name, self.log, self.stuck = name, log, stuck
        self.release = asyncio.Event()

    async def Embed(self, request: embedding_pb2.EmbedRequest, timeout: float, metadata: object) -> object:
        tokens = len(request.input_ids) // 4
        self.log.append((self.name, tokens))
        try:
            await asyncio.wait_for(self._answer(), timeout)
        except TimeoutError:
            raise _Deadline() from None
        return embedding_pb2.EmbedResponse(embeddings=np.zeros((1, 2), np.float32).tobytes(), num_seqs=1, dimension=2)

    async def _answer(self) -> None:
        await self.release.wait()
        if self.stuck:
            await asyncio.sleep(3600)


def _pool(names: list[str], log: list[tuple[str, int]], timeout: float = 30.0) -> ReplicaPool:
    catalog = ModelCatalog((), ThreadPoolExecutor(1))
    pool = ReplicaPool(tuple(names), catalog, GatewayMetrics(), timeout=timeout)
    for replica in pool.replicas:
        replica.model, replica.healthy = _model(), True
        replica.stub = FakeStub(replica.address, log)  # type: ignore[assignment]
    return pool


def _batch(tokens: int) -> Batch:
    return Batch.pack([[1] * tokens])


def test_a_replica_is_kept_only_a_window_ahead_and_queries_go_first():
    async def scenario() -> list[tuple[str, int]]:
        log: list[tuple[str, int]] = []
        pool = _pool(["a"], log)
        stub = pool.replicas[0].stub
        bulk = [asyncio.ensure_future(pool.embed("m", _batch(200), priority=1)) for _ in range(4)]
        await asyncio.sleep(0.1)
        assert [tokens for _, tokens in log] == [200, 200]  # 400 tokens: the window is full, two wait
        query = asyncio.ensure_future(pool.embed("m", _batch(5), priority=0))
        await asyncio.sleep(0.1)
        stub.release.set()  # the replica answers everything from now on
        await asyncio.gather(*bulk, query)
        return log

    log = asyncio.run(scenario())
    assert [tokens for _, tokens in log] == [200, 200, 5, 200, 200]  # the query overtook the waiting bulk chunks


def test_an_attempt_past_its_deadline_moves_and_ejects_the_replica():
    async def scenario() -> tuple[list[tuple[str, int]], bool]:
        log: list[tuple[str, int]] = []
        pool = _pool(["slow", "fast"], log)
        slow, fast = pool.replicas
        slow.stub.stuck = True  # answers pings (healthy) but its engine never returns
        for replica in pool.replicas:
            replica.rate.started(0.0)
            replica.rate.answered(10_000, 1.0, still_busy=False)  # measured: 10,000 tokens/s
            replica.stub.release.set()
        fast.outstanding_tokens = 1  # so the first chunk goes to the stuck replica
        rows = await asyncio.wait_for(pool.embed("m", _batch(50)), timeout=10)
        assert rows.shape == (1, 2)
        return log, slow.ejected

    log, ejected = asyncio.run(scenario())
    assert [name for name, _ in log] == ["slow", "fast"] and ejected


def test_with_no_other_replica_an_attempt_keeps_the_request_timeout():
    async def scenario() -> float:
        pool = _pool(["only"], [])
        replica = pool.replicas[0]
        replica.rate.started(0.0)
        replica.rate.answered(10_000, 1.0, still_busy=False)
        replica.outstanding_tokens = 50
        return pool._attempt_timeout(replica, 50, deadline=time.monotonic() + 1e9)

    assert asyncio.run(scenario()) > 60


def test_a_replica_answering_nothing_is_measured_only_from_answers():
    rate = ServiceRate()
    assert rate.tokens_per_second is None
    rate.started(0.0)
    rate.failed(5.0, still_busy=False)  # five seconds that produced nothing do not count as its speed
    assert rate.tokens_per_second is None
    rate.started(10.0)
    rate.answered(1_000, 10.5, still_busy=False)
    assert rate.tokens_per_second == pytest.approx(2_000)


class _Unavailable(grpc.aio.AioRpcError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), "ping timeout")


class BreaksOnce(FakeStub):
    """Its first Embed fails as a connection that broke does (a missed ping on a loaded host); later ones answer."""

    async def Embed(self, request: embedding_pb2.EmbedRequest, timeout: float, metadata: object) -> object:
        if not self.log:
            self.log.append((self.name, -1))
            raise _Unavailable()
        return await super().Embed(request, timeout, metadata)


def test_a_chunk_whose_only_replica_broke_waits_for_it_to_serve_again():
    # Before, the chunk's retry found no replica it had not tried and the request was answered 503 at once.
    async def scenario() -> tuple[object, bool, list[tuple[str, int]]]:
        log: list[tuple[str, int]] = []
        pool = _pool(["only"], log)
        replica = pool.replicas[0]
        replica.stub = BreaksOnce("only", log)  # type: ignore[assignment]
        replica.stub.release.set()
        chunk = asyncio.ensure_future(pool.embed("m", _batch(5)))
        while replica.healthy:  # the failure marks it down
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # a while with no replica serving
        waited = not chunk.done()
        replica.healthy = True  # as its health watch finds it serving again
        rows = await asyncio.wait_for(chunk, timeout=10)
        await pool.close()
        return rows, waited, log

    rows, waited, log = asyncio.run(scenario())
    assert waited and rows.shape == (1, 2)  # type: ignore[attr-defined]
    assert log == [("only", -1), ("only", 5)]


def test_a_chunk_whose_replicas_stay_down_is_answered_503_after_the_wait():
    async def scenario() -> None:
        log: list[tuple[str, int]] = []
        catalog = ModelCatalog((), ThreadPoolExecutor(1))
        pool = ReplicaPool(("only",), catalog, GatewayMetrics(), come_back_seconds=0.2)
        replica = pool.replicas[0]
        replica.model, replica.healthy = _model(), True
        replica.stub = BreaksOnce("only", log)  # type: ignore[assignment]
        with pytest.raises(Unavailable, match="no healthy replica"):
            await asyncio.wait_for(pool.embed("m", _batch(5)), timeout=10)
        await pool.close()

    asyncio.run(scenario())


def test_a_request_arriving_while_its_replica_is_down_for_a_moment_waits_for_it():
    # Seen with both cores loaded: the one replica left missed a keepalive ping, was marked down for about a second,
    # and every request arriving meanwhile was answered 503 no_healthy_replica at once (482 of 549 in one run).
    async def scenario() -> tuple[bool, bool, bool]:
        pool = _pool(["only"], [])
        replica = pool.replicas[0]
        pool._set_healthy(replica, False)  # as a broken health stream marks it
        arriving = asyncio.ensure_future(pool.serving("m"))
        await asyncio.sleep(0.3)
        waited = not arriving.done()
        pool._set_healthy(replica, True)  # its watch reconnects and finds it serving
        served = await asyncio.wait_for(arriving, timeout=10)
        replica.down_since = time.monotonic() - 6.0  # down for longer than the 5 s a replica may take to come back
        replica.healthy = False
        started = time.monotonic()
        refused = not await pool.serving("m") and time.monotonic() - started < 0.1
        await pool.close()
        return waited, served, refused

    waited, served, refused = asyncio.run(scenario())
    assert waited and served and refused


def test_a_chunk_queued_when_its_replica_goes_down_for_a_moment_waits_for_it():
    # A chunk waiting for room in a full window found no replica once the only one went down, and was answered 503.
    async def scenario() -> tuple[bool, object]:
        log: list[tuple[str, int]] = []
        pool = _pool(["only"], log)
        replica = pool.replicas[0]
        first = asyncio.ensure_future(pool.embed("m", _batch(400)))  # fills the window
        await asyncio.sleep(0.05)
        queued = asyncio.ensure_future(pool.embed("m", _batch(5)))
        await asyncio.sleep(0.05)
        pool._set_healthy(replica, False)
        replica.stub.release.set()  # the first chunk's call was sent: it is answered
        await first
        await asyncio.sleep(0.3)
        waited = not queued.done()
        pool._set_healthy(replica, True)
        rows = await asyncio.wait_for(queued, timeout=10)
        await pool.close()
        return waited, rows

    waited, rows = asyncio.run(scenario())
    assert waited and rows.shape == (1, 2)  # type: ignore[attr-defined]


class SlowOnce(FakeStub):
    """Its first Embed runs past any deadline (a loaded host's step); later ones answer."""

    async def Embed(self, request: embedding_pb2.EmbedRequest, timeout: float, metadata: object) -> object:
        if not self.log:
            self.log.append((self.name, -2))
            await asyncio.sleep(timeout)
            raise _Deadline()
        return await super().Embed(request, timeout, metadata)


class Broken(FakeStub):
    async def Embed(self, request: embedding_pb2.EmbedRequest, timeout: float, metadata: object) -> object:
        self.log.append((self.name, -1))
        raise _Unavailable()


def test_a_replica_ejected_for_a_late_attempt_takes_the_chunk_again_once_its_ejection_ends(monkeypatch):
    # Seen with both cores loaded while the other replica hung: the chunk ran past its deadline on the slow replica,
    # the hung one was marked down, and the chunk, never to return to a replica it had tried, was answered 503.
    monkeypatch.setattr("bouquet.gateway.replicas.pool._ATTEMPT_FLOOR_S", 0.1)

    async def scenario() -> tuple[object, list[tuple[str, int]]]:
        log: list[tuple[str, int]] = []
        pool = _pool(["slow", "broken"], log)
        slow, broken = pool.replicas
        slow.stub, broken.stub = SlowOnce("slow", log), Broken("broken", log)  # type: ignore[assignment]
        for replica in pool.replicas:
            replica.rate.started(0.0)
            replica.rate.answered(10_000, 1.0, still_busy=False)
            replica.stub.release.set()
        broken.outstanding_tokens = 1  # the first attempt goes to the slow one
        rows = await asyncio.wait_for(pool.embed("m", _batch(5)), timeout=10)
        await pool.close()
        return rows, log

    rows, log = asyncio.run(scenario())
    assert rows.shape == (1, 2)  # type: ignore[attr-defined]
    assert log == [("slow", -2), ("broken", -1), ("slow", 5)]  # back on the slow one after its 1 s ejection
