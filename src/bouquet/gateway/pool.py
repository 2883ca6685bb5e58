"""The replicas behind the gateway: discovered through their Info RPC, watched through grpc.health.v1, and
chosen per chunk as the healthy replica of the model with the fewest outstanding tokens. A chunk whose replica
fails is retried on another one (bounded); that replica is marked down and probed until it serves again."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bouquet.batch import Batch
from bouquet.gateway.errors import InvalidRequest, Overloaded, Unavailable
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.models import ModelCatalog, ServedModel
from bouquet.proto import embedding_pb2, embedding_pb2_grpc
from bouquet.replica.client import embed_request, response_rows

logger = logging.getLogger(__name__)

SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["Embedding"].full_name
_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a large request's rows, or a tokenizer in Info (~11 MB for Qwen3)
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # A replica that comes back is found within a second, not after gRPC's default backoff of up to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A replica that stops answering (a hung process, a cut link) shows as an unanswered ping within about a
    # second: the connection is closed, its calls fail over to another replica and its health stream breaks.
    # Without pings a call would wait out its whole timeout on a replica that can no longer answer. Every chunk
    # caught there waits out this time and then its turn on another replica: tests/test_fault_partition.py.
    ("grpc.keepalive_time_ms", 500),
    ("grpc.keepalive_timeout_ms", 500),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", 500),  # the replica accepts pings this often (replica/server.py)
    ("grpc.http2.ping_timeout_ms", 500),  # gRPC 1.6x+: how long a ping may go unanswered before the close
]
_SERVING = health_pb2.HealthCheckResponse.SERVING


class Replica:
    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=_CHANNEL_OPTIONS)
        self.stub = embedding_pb2_grpc.EmbeddingStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.model: ServedModel | None = None  # known once Info has answered
        self.healthy = False
        self.outstanding_tokens = 0  # sent and not yet answered
        self.probing = False


class ReplicaPool:
    def __init__(
        self,
        addresses: tuple[str, ...],
        catalog: ModelCatalog,
        metrics: GatewayMetrics,
        max_attempts: int = 3,
        timeout: float = 120.0,
        probe_interval: float = 0.5,
        token: str | None = None,
    ):
        self.replicas = [Replica(address) for address in addresses]
        # Sent with every Embed and Info call; a replica started with a token refuses calls without it.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.catalog = catalog
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._timeout = timeout
        self._probe_interval = probe_interval
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        for replica in self.replicas:
            self._spawn(self._watch(replica))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(replica.channel.close() for replica in self.replicas))

    def any_healthy(self) -> bool:
        return any(replica.healthy for replica in self.replicas)

    async def embed(self, model: str, batch: Batch) -> np.ndarray:  # [B, width] float32
        request = embed_request(batch)
        tokens = batch.num_tokens
        tried: set[Replica] = set()
        last_code: grpc.StatusCode | None = None
        for attempt in range(self._max_attempts):
            replica = self._pick(model, tried)
            if replica is None:
                break
            if attempt:
                self._metrics.retries.inc()
            tried.add(replica)
            try:
                return await self._call(replica, request, tokens)
            except grpc.aio.AioRpcError as error:
                last_code = error.code()
                if last_code is grpc.StatusCode.INVALID_ARGUMENT:
                    raise InvalidRequest(error.details() or "invalid input", "invalid_value", None) from error
                if last_code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise Unavailable(f"the replica took over {self._timeout} s", "timeout") from error
                if last_code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
                    logger.warning("replica %s failed (%s); marking it down", replica.address, last_code.name)
                    self._mark_down(replica)
        if last_code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded("every replica's queue is full; retry shortly", "overloaded", headers={"Retry-After": "1"})
        raise Unavailable(f"no healthy replica serves the model {model!r}", "no_healthy_replica", "model")

    async def _call(self, replica: Replica, request: embedding_pb2.EmbedRequest, tokens: int) -> np.ndarray:
        replica.outstanding_tokens += tokens
        started = time.perf_counter()
        try:
            reply = await replica.stub.Embed(request, timeout=self._timeout, metadata=self._metadata)
        finally:
            replica.outstanding_tokens -= tokens
        self._metrics.queue_seconds.observe(time.perf_counter() - started)
        return response_rows(reply)

    def _pick(self, model: str, tried: set[Replica]) -> Replica | None:
        best: Replica | None = None
        for replica in self.replicas:
            if not replica.healthy or replica in tried or replica.model is None or replica.model.name != model:
                continue
            if best is None or replica.outstanding_tokens < best.outstanding_tokens:
                best = replica
        return best

    def _set_healthy(self, replica: Replica, healthy: bool) -> None:
        if replica.healthy != healthy:
            # A replica going down is worth an operator's attention; one coming up is routine.
            log = logger.info if healthy else logger.warning
            log("replica %s is %s", replica.address, "serving" if healthy else "down")
        replica.healthy = healthy
        self._metrics.replica_healthy.labels(replica.address).set(1 if healthy else 0)

    async def _discover(self, replica: Replica) -> None:
        info = await replica.stub.Info(embedding_pb2.InfoRequest(), timeout=10, metadata=self._metadata)
        if self.catalog.needs_tokenizer(info):
            # Asked for only for a model met for the first time with no local directory: it is megabytes.
            request = embedding_pb2.InfoRequest(include_tokenizer=True)
            info = await replica.stub.Info(request, timeout=30, metadata=self._metadata)
        replica.model = self.catalog.register(info)

    async def _watch(self, replica: Replica) -> None:
        """Follows the replica's health stream; when it breaks, marks the replica down and reconnects."""
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
                async for reply in replica.health.Watch(request):
                    if reply.status == _SERVING:
                        await self._discover(replica)  # a restarted replica may serve another model
                    self._set_healthy(replica, reply.status == _SERVING)
            self._set_healthy(replica, False)
            await asyncio.sleep(self._probe_interval)

    def _mark_down(self, replica: Replica) -> None:
        self._set_healthy(replica, False)
        if not replica.probing:
            replica.probing = True
            self._spawn(self._probe(replica))

    async def _probe(self, replica: Replica) -> None:
        """Checks a replica marked down after a failed call until it serves again (its health stream may not
        have broken, so the watch alone would not notice it is back)."""
        try:
            while not replica.healthy:
                await asyncio.sleep(self._probe_interval)
                with contextlib.suppress(grpc.aio.AioRpcError):
                    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
                    reply = await replica.health.Check(request, timeout=2)
                    if reply.status == _SERVING:
                        await self._discover(replica)
                        self._set_healthy(replica, True)
        finally:
            replica.probing = False

    def _spawn(self, coro: object) -> None:
        task = asyncio.ensure_future(coro)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
