"""The replicas behind the gateway: discovered through their Info RPC, watched through grpc.health.v1, and
chosen per chunk as the healthy replica of the model with the fewest outstanding tokens.

Chunks are not all sent at once. Each replica is kept about `window_seconds` of work ahead (at least a few of
its batches, so it never idles between chunks); the chunks beyond that wait here, the smallest request's first.
So a one-text query waits behind at most a window of work, not behind every chunk of every large request
admitted before it, and a refused or cancelled request has little queued at a replica to throw away.

A chunk whose replica fails is retried on another one (bounded); that replica is marked down and probed until it
serves again. Each attempt has a deadline from the replica's measured speed, so a replica that still answers
pings but computes nothing (a stuck engine) is ejected for a while and its chunk moved within seconds.

Replicas are given by address, or found by DNS (`--replicas-dns NAME:PORT`: every A/AAAA record of NAME, as a
Kubernetes headless Service gives one per ready pod), re-resolved every `dns_interval` seconds: an address that
appears joins once its Info and health answer; one that goes gets no new work, keeps its calls in flight to their
end (a pod leaving drains them) and is closed when idle. A failed lookup keeps the last good set."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import socket
import time
from collections.abc import Coroutine
from typing import Any

import grpc
from grpc_health.v1 import health_pb2

from bouquet.batch import Batch
from bouquet.gateway.errors import InvalidRequest, Overloaded, Unavailable
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.replicas.catalog import ModelCatalog
from bouquet.gateway.replicas.replica import Replica, check_wire, unusable_cause
from bouquet.gateway.replicas.waiting import RECHECK_S, Waiter, back_within, wait_turn, wake_next
from bouquet.proto import embedding_pb2
from bouquet.replica.client import Reply, embed_request, read_reply

logger = logging.getLogger(__name__)

SERVICE_NAME = embedding_pb2.DESCRIPTOR.services_by_name["Embedding"].full_name
_SERVING = health_pb2.HealthCheckResponse.SERVING
_WINDOW_BATCHES = 4  # the least a replica is kept ahead: two steps computing, two batches ready behind them
_ATTEMPT_SLACK = 4.0  # an attempt may take this many times what the replica's speed predicts...
_ATTEMPT_FLOOR_S = 2.0  # ...and never less than this: a cold bucket, a noisy neighbour
_FIRST_ROUND_RECHECK_S = 0.01


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
        window_seconds: float = 0.25,
        credentials: grpc.ChannelCredentials | None = None,
        server_name: str | None = None,
        dns_names: tuple[str, ...] = (),
        dns_interval: float = 2.0,
        come_back_seconds: float = 5.0,
    ):
        self._credentials, self._server_name = credentials, server_name
        self.replicas = [Replica(address, credentials, server_name) for address in addresses]
        self._dns_names = dns_names  # NAME:PORT each
        self._dns_interval = dns_interval
        self._dns_members: dict[str, set[str]] = {}  # per NAME:PORT, the addresses it gave last
        self._dns_looked_up: set[str] = set()  # the names looked up at least once, found or not
        # Sent with every Embed and Info call; a replica started with a token refuses calls without it.
        self._metadata = (("authorization", f"Bearer {token}"),) if token else None
        self._token = token  # and shown on a replica's local lane (gateway/replicas/lane.py)
        self.catalog = catalog
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._timeout = timeout
        self._probe_interval = probe_interval
        self._window_seconds = window_seconds
        self._come_back_seconds = come_back_seconds
        self._waiting: dict[str, list[Waiter]] = {}  # per model, a heap: chunks waiting for room
        self._arrivals = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> None:
        for replica in self.replicas:
            replica.watch = self._spawn(self._watch(replica))
        for name in self._dns_names:
            self._spawn(self._follow_dns(name))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(replica.close_lane() for replica in self.replicas))
        await asyncio.gather(*(replica.channel.close() for replica in self.replicas))

    async def first_round(self, seconds: float) -> None:
        """Until every replica has answered its first health check (serving, its model registered, or not) or failed
        it, and every DNS name has had its first lookup; `seconds` at most. A gateway process listens only then."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                while not (self._dns_looked_up.issuperset(self._dns_names) and all(r.heard for r in self.replicas)):
                    await asyncio.sleep(_FIRST_ROUND_RECHECK_S)

    async def _follow_dns(self, target: str) -> None:
        """Re-resolves NAME:PORT every few seconds; replicas join and leave as its records do."""
        name, _, port = target.rpartition(":")
        while True:
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(name, int(port), type=socket.SOCK_STREAM)
            except OSError as error:
                # Keep serving with what we had: a resolver hiccup must not empty the pool.
                self._metrics.dns_failures.labels(target).inc()
                logger.warning("resolving %s failed (%s); keeping its %d replicas", target, error,
                               len(self._dns_members.get(target, ())))  # fmt: skip
            else:
                self.follow(target, {_address(str(info[4][0]), int(port)) for info in infos})
            self._dns_looked_up.add(target)
            await asyncio.sleep(self._dns_interval)

    def follow(self, target: str, addresses: set[str]) -> None:
        """`addresses` are the replicas `target` gives now (a DNS name, or Ray Serve's registry): new ones join, gone
        ones are retired."""
        known = self._dns_members.get(target, set())
        self._dns_members[target] = addresses
        self._metrics.dns_replicas.labels(target).set(len(addresses))
        current = {replica.address: replica for replica in self.replicas}
        for address in sorted(addresses - known):
            if address not in current:
                logger.info("replica %s appeared in %s", address, target)
                replica = Replica(address, self._credentials, self._server_name)
                self.replicas.append(replica)
                replica.watch = self._spawn(self._watch(replica))
        for address in sorted(known - addresses):
            if address in current and not self._listed_elsewhere(target, address):
                logger.info("replica %s left %s; it gets no new work", address, target)
                self._retire(current[address])

    def _listed_elsewhere(self, target: str, address: str) -> bool:
        return any(address in members for name, members in self._dns_members.items() if name != target)

    def _retire(self, replica: Replica) -> None:
        """Out of rotation now; its calls in flight finish (a leaving pod drains them); closed once idle."""
        replica.retired = True
        self.replicas.remove(replica)
        self._metrics.replica_healthy.labels(replica.address).set(0)
        self._spawn(self._close_when_idle(replica))

    async def _close_when_idle(self, replica: Replica) -> None:
        deadline = time.monotonic() + self._timeout
        while replica.outstanding_tokens and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if replica.watch is not None:
            replica.watch.cancel()
        await replica.close_lane()
        await replica.channel.close()

    def any_healthy(self, model: str | None = None) -> bool:
        return any(r.healthy and (model is None or (r.model is not None and r.model.name == model))
                   for r in self.replicas)  # fmt: skip

    async def serving(self, model: str) -> bool:
        """Whether a replica serves `model`, waiting for one that went down less than `come_back_seconds` ago."""
        went_down = [r.down_since for r in self.replicas if r.down_since is not None and r.serves_when_up(model)]
        return await back_within(lambda: self.any_healthy(model), max(went_down, default=None), self._come_back_seconds)

    def tokens_per_second(self) -> float | None:
        """What the healthy replicas compute together, as measured; None until one has been measured."""
        rates = [r.rate.tokens_per_second for r in self.replicas if r.healthy]
        known = [rate for rate in rates if rate is not None]
        return sum(known) * len(rates) / len(known) if known else None

    async def embed(self, model: str, batch: Batch, priority: int = 0, maxsim: bool = False) -> Reply:
        """The rows of `batch`, [B, elements] in its encoding (or its sparse rows when it asks for them, or its
        AllOutputs; or, with `maxsim`, [B - 1, 1] scores of its first sequence against the others, [B - 1, 3] with
        all outputs); `priority` orders chunks waiting for a replica (lower first, then by arrival). A replica whose
        connection broke (UNAVAILABLE: a missed ping on a loaded host, a restart) may take the chunk again once it
        serves, one ejected for running past an attempt's deadline once its ejection ends, and an attempt that finds
        no replica waits `come_back_seconds` for one: else a loaded host's slow or briefly unreachable replicas
        would answer 503 a request that they serve a second later."""
        request = embed_request(batch, maxsim)
        tokens = batch.budget_tokens  # the work it brings, as the replica's budget counts it
        tried: set[Replica] = set()
        last_code: grpc.StatusCode | None = None
        deadline = time.monotonic() + self._timeout
        arrival = next(self._arrivals)  # a retry keeps the chunk's place: it does not queue behind later chunks
        for attempt in range(self._max_attempts):
            replica = await self._acquire(model, tokens, (priority, arrival), tried, deadline, self._come_back_seconds)
            if replica is None:
                break
            if attempt:
                self._metrics.retries.inc()
            tried.add(replica)
            try:
                reply = await self._call(replica, request, tokens, self._attempt_timeout(replica, tokens, deadline))
                return read_reply(reply, batch, maxsim)
            except grpc.aio.AioRpcError as error:
                last_code = error.code()
                self._after_failure(replica, error, deadline)
                if last_code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    tried.discard(replica)  # marked down or ejected: chosen again only once it serves again
        if last_code is grpc.StatusCode.RESOURCE_EXHAUSTED:
            raise Overloaded("every replica's queue is full; retry shortly", "overloaded", headers={"Retry-After": "1"})
        if time.monotonic() >= deadline:
            raise Unavailable(f"the replicas took over {self._timeout} s", "timeout")
        raise Unavailable(f"no healthy replica serves the model {model!r}", "no_healthy_replica", "model")

    def _after_failure(self, replica: Replica, error: grpc.aio.AioRpcError, deadline: float) -> None:
        code = error.code()
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            raise InvalidRequest(error.details() or "invalid input", "invalid_value", None) from error
        if code is grpc.StatusCode.DEADLINE_EXCEEDED:
            if time.monotonic() >= deadline:
                raise Unavailable(f"the replicas took over {self._timeout} s", "timeout") from error
            seconds = replica.eject()
            self._metrics.ejections.labels(replica.address).inc()
            logger.warning("replica %s ran past an attempt's deadline; ejected for %.0f s", replica.address, seconds)
        elif code is not grpc.StatusCode.RESOURCE_EXHAUSTED:
            logger.warning("replica %s failed (%s); marking it down", replica.address, code.name)
            self._mark_down(replica)

    def _attempt_timeout(self, replica: Replica, tokens: int, deadline: float) -> float:
        """A few times what the replica's speed predicts for its queue and this chunk, when another replica could
        take the chunk over; with none, the request's whole remaining time (there is nowhere to move it)."""
        remaining = max(0.0, deadline - time.monotonic())
        expected = replica.expected_seconds(0)  # the chunk is already counted in outstanding_tokens
        if expected is None or not self._has_alternative(replica):
            return remaining
        return min(remaining, max(_ATTEMPT_FLOOR_S, _ATTEMPT_SLACK * expected))

    def _has_alternative(self, replica: Replica) -> bool:
        assert replica.model is not None
        return any(other is not replica and other.serves(replica.model.name) for other in self.replicas)

    async def _call(
        self, replica: Replica, request: embedding_pb2.EmbedRequest, tokens: int, timeout: float
    ) -> embedding_pb2.EmbedResponse:
        """One attempt; `tokens` were added to the replica's outstanding count when it was chosen."""
        started = time.perf_counter()
        replica.rate.started(time.monotonic())
        answered = False
        try:
            reply = await replica.embed_call(request, timeout, self._metadata)
            answered = True
        finally:
            replica.outstanding_tokens -= tokens
            busy = replica.outstanding_tokens > 0
            if answered:
                replica.rate.answered(tokens, time.monotonic(), busy)
            else:
                replica.rate.failed(time.monotonic(), busy)
            assert replica.model is not None
            self._wake_next(replica.model.name)
        replica.succeeded()
        self._metrics.queue_seconds.observe(time.perf_counter() - started)
        self._metrics.replica_tokens.labels(replica.address).inc(tokens)
        return reply

    async def _acquire(
        self, model: str, tokens: int, place: tuple[int, int], tried: set[Replica], deadline: float,
        come_back: float = 0.0,
    ) -> Replica | None:  # fmt: skip
        """The least loaded replica of `model` not tried yet, once it has room in its window and no smaller
        request's chunk waits before this one; None when no replica can take the chunk (none serves, after
        `come_back` seconds of waiting for one from when it found none)."""
        started = time.monotonic()
        queue = self._waiting.setdefault(model, [])
        me = Waiter(*place, tried)
        queued = False
        none_since: float | None = None
        try:
            while True:
                replica = self._least_loaded(model, tried)
                none_since = None if replica is not None else none_since or time.monotonic()
                if none_since is not None and time.monotonic() < min(deadline, none_since + come_back):
                    await asyncio.sleep(RECHECK_S)
                    continue
                if replica is None or time.monotonic() >= deadline:
                    return None
                # The first in line goes first, unless it may not use this replica (it failed there before).
                if self._has_room(replica, tokens) and (not queue or me <= queue[0] or replica in queue[0].tried):
                    replica.outstanding_tokens += tokens
                    return replica
                if not queued:
                    heapq.heappush(queue, me)
                    queued = True
                await wait_turn(me, queue)
        finally:
            if queued:
                queue.remove(me)
                heapq.heapify(queue)
            self._metrics.dispatch_wait_seconds.observe(time.monotonic() - started)
            self._wake_next(model)  # the next chunk may fit too

    def _wake_next(self, model: str) -> None:
        wake_next(self._waiting.get(model))

    def _least_loaded(self, model: str, tried: set[Replica]) -> Replica | None:
        candidates = [r for r in self.replicas if r.serves(model) and r not in tried]
        return min(candidates, key=lambda r: r.outstanding_tokens, default=None)

    def _has_room(self, replica: Replica, tokens: int) -> bool:
        if replica.outstanding_tokens == 0:
            return True  # a chunk larger than the window still runs, alone
        assert replica.model is not None
        window = _WINDOW_BATCHES * replica.model.max_batch_tokens
        rate = replica.rate.tokens_per_second
        if rate is not None:
            window = max(window, int(rate * self._window_seconds))
        return replica.outstanding_tokens + tokens <= window

    def _set_healthy(self, replica: Replica, healthy: bool) -> None:
        if healthy:
            replica.serving_again()
        if replica.healthy != healthy:
            replica.down_since = None if healthy else time.monotonic()
            # A replica going down is worth an operator's attention; one coming up is routine.
            log = logger.info if healthy else logger.warning
            log("replica %s is %s", replica.address, "serving" if healthy else "down")
        replica.healthy = healthy
        self._metrics.replica_healthy.labels(replica.address).set(1 if healthy else 0)
        if replica.model is not None:
            self._wake_next(replica.model.name)

    async def _discover(self, replica: Replica) -> None:
        info = await replica.stub.Info(embedding_pb2.InfoRequest(), timeout=10, metadata=self._metadata)
        if self.catalog.needs_tokenizer(info):
            # Asked for only for a model met for the first time with no local directory: it is megabytes.
            request = embedding_pb2.InfoRequest(include_tokenizer=True)
            info = await replica.stub.Info(request, timeout=30, metadata=self._metadata)
        check_wire(info)  # a replica of another wire version is not used (Incompatible), and says so
        replica.model = self.catalog.register(info)
        await replica.open_lane(info, self._token)

    async def _watch(self, replica: Replica) -> None:
        """Follows the replica's health stream; when it breaks, marks the replica down and reconnects."""
        while True:
            try:
                request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
                async for reply in replica.health.Watch(request):
                    if reply.status == _SERVING:
                        await self._discover(replica)  # a restarted replica may serve another model
                    self._set_healthy(replica, reply.status == _SERVING)
                    replica.heard = True
            except Exception as error:  # a bug reading its Info, too: it must not end the watch for good
                replica.unusable(unusable_cause(error))
            finally:
                replica.heard = True  # failed, or gone: the gateway knows what it can of it
            # The connection broke (a crash, a hang that missed gRPC's pings): calls on the lane end as gRPC's did.
            await replica.close_lane()
            self._set_healthy(replica, False)
            await asyncio.sleep(self._probe_interval)

    def unusable(self) -> dict[str, str]:
        """Each replica that is not serving, and why as far as the gateway knows."""
        return {
            replica.address: replica.problem or "not serving yet"
            for replica in self.replicas
            if not replica.healthy and not replica.retired
        }

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
                try:
                    request = health_pb2.HealthCheckRequest(service=SERVICE_NAME)
                    reply = await replica.health.Check(request, timeout=2)
                    if reply.status == _SERVING:
                        await self._discover(replica)
                        self._set_healthy(replica, True)
                except Exception as error:  # as in _watch: the probe goes on
                    replica.unusable(unusable_cause(error))
        finally:
            replica.probing = False

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


def _address(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
