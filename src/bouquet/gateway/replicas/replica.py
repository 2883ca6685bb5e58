"""One replica as the gateway sees it: its channel, the model it serves, whether it is healthy, the tokens sent
to it and not yet answered, how fast it computes, and whether it is ejected for answering too slowly."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

import grpc
from grpc_health.v1 import health_pb2_grpc

from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.replicas.lane import Lane, LaneRefused
from bouquet.proto import WIRE_VERSION, bouquet_version, embedding_pb2, embedding_pb2_grpc
from bouquet.replica.lane_frames import FrameError

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a large request's rows, or a tokenizer in Info (~11 MB for Qwen3)
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    # A replica that comes back is found within a second, not after gRPC's default backoff of up to 2 minutes.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    # A replica that stops answering (a hung process, a cut link) shows as an unanswered ping within 0.5 to 1.5 s:
    # the connection is closed, its calls fail over to another replica and its health stream breaks. Without pings
    # a call would wait out its whole timeout on a replica that can no longer answer. A live replica acks in well
    # under a millisecond, from gRPC's own threads, however busy its Python is; 500 ms leaves room for a loaded host
    # (with 1 s, requests caught by a hang took up to 2.9 s, over the 3 s bound's margin).
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 500),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.http2.min_time_between_pings_ms", 1000),
    ("grpc.http2.ping_timeout_ms", 500),  # gRPC 1.6x+: how long a ping may go unanswered before the close
]

_RATE_HALF_LIFE_S = 10.0  # of busy time: the speed follows a replica that slows down within seconds
_EJECT_FIRST_S = 1.0
_EJECT_MAX_S = 30.0


class ServiceRate:
    """Tokens per second a replica computes while it has work: answered tokens over busy time, both decayed so
    recent seconds count most. Idle time is not counted, so a quiet replica keeps its measured speed."""

    def __init__(self) -> None:
        self._tokens = 0.0
        self._seconds = 0.0
        self._busy_since: float | None = None

    def started(self, now: float) -> None:
        if self._busy_since is None:
            self._busy_since = now

    def answered(self, tokens: int, now: float, still_busy: bool) -> None:
        if self._busy_since is not None:
            elapsed = max(0.0, now - self._busy_since)
            decay = 0.5 ** (elapsed / _RATE_HALF_LIFE_S)
            self._tokens = self._tokens * decay + tokens
            self._seconds = self._seconds * decay + elapsed
        self._busy_since = now if still_busy else None

    def failed(self, now: float, still_busy: bool) -> None:
        """A call that produced nothing ends: its time is not the replica's speed."""
        self._busy_since = now if still_busy else None

    @property
    def tokens_per_second(self) -> float | None:
        """None until a quarter second of work has been seen."""
        return self._tokens / self._seconds if self._seconds >= 0.25 else None


class Replica:
    def __init__(
        self, address: str, credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None
    ):
        """`server_name`: the name its certificate must carry, instead of `address` (a pod's IP, found by DNS)."""
        self.address = address
        if credentials is None:
            self.channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        else:
            named = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self.channel = grpc.aio.secure_channel(address, credentials, options=[*CHANNEL_OPTIONS, *named])
        self.stub = embedding_pb2_grpc.EmbeddingStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.model: ServedModel | None = None  # known once Info has answered
        self.healthy = False
        self.down_since: float | None = None  # when it last went from serving to down (monotonic)
        self.heard = False  # its first health answer (and Info, if serving) is in, or its first check failed
        self.problem: str | None = None  # why it cannot be used, as last seen (unusable_cause)
        self.problems_said: set[str] = set()  # the causes logged since it last served
        self.outstanding_tokens = 0  # sent and not yet answered
        self.rate = ServiceRate()
        self.probing = False
        self.retired = False  # gone from DNS: no new work
        self.watch: asyncio.Task[None] | None = None  # its health watch, cancelled when it is closed
        self._ejected_until = 0.0
        self._eject_seconds = _EJECT_FIRST_S
        self.lane: Lane | None = None  # its local lane, where its Info names one this gateway could open

    def embed_call(
        self, request: embedding_pb2.EmbedRequest, timeout: float, metadata: tuple[tuple[str, str], ...] | None
    ) -> Awaitable[embedding_pb2.EmbedResponse]:
        """One Embed call: on the local lane while it is open, else on gRPC; both fail alike (replicas/lane.py)."""
        if self.lane is not None and self.lane.open_now:
            return self.lane.embed(request, timeout)
        reply: Awaitable[embedding_pb2.EmbedResponse] = self.stub.Embed(request, timeout=timeout, metadata=metadata)
        return reply

    async def open_lane(self, info: embedding_pb2.InfoResponse, token: str | None) -> None:
        """The local lane its Info names, if any: kept while it is the same replica's (its nonce), opened anew
        otherwise; where it cannot be opened, its Embed calls stay on gRPC and the log says why once."""
        lane = self.lane
        if lane is not None and lane.open_now and info.lane_path and lane.nonce == info.lane_nonce:
            return
        await self.close_lane()
        if not info.lane_path:
            return
        try:
            self.lane = await Lane.open(info.lane_path, info.lane_nonce, token)
        except (OSError, TimeoutError, asyncio.IncompleteReadError, FrameError, LaneRefused) as error:
            self.unusable_lane(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)
        else:
            logger.info("replica %s: Embed calls on its local lane %s", self.address, info.lane_path)

    async def close_lane(self) -> None:
        lane, self.lane = self.lane, None
        if lane is not None:
            await lane.close()

    def serves(self, model: str) -> bool:
        return (
            self.healthy and not self.retired and self.model is not None and self.model.name == model
            and not self.ejected
        )  # fmt: skip

    def serves_when_up(self, model: str) -> bool:
        """Whether it served `model` when last up, and is still one of the pool's (not retired)."""
        return not self.retired and self.model is not None and self.model.name == model

    @property
    def ejected(self) -> bool:
        return time.monotonic() < self._ejected_until

    def eject(self) -> float:
        """Out of rotation for a while after an attempt ran past its deadline (outlier ejection, as Envoy does):
        a replica whose process answers pings but whose engine is stuck would otherwise keep taking chunks. The
        time doubles while it keeps failing, up to half a minute; a success resets it."""
        seconds = self._eject_seconds
        self._ejected_until = time.monotonic() + seconds
        self._eject_seconds = min(_EJECT_MAX_S, seconds * 2)
        return seconds

    def unusable(self, cause: str) -> None:
        """Says why it cannot be used, once per cause (until it serves again): a wrong token or a TLS mismatch
        would otherwise show only as 503s, with nothing in the log at the default level."""
        if cause not in self.problems_said:
            logger.warning("replica %s cannot be used: %s", self.address, cause)
            self.problems_said.add(cause)
        self.problem = cause

    def unusable_lane(self, cause: str) -> None:
        """Its local lane could not be opened: its Embed calls stay on gRPC; said once per cause."""
        if cause not in self.problems_said:
            logger.warning("replica %s: its local lane could not be opened (%s); Embed calls stay on gRPC",
                           self.address, cause)  # fmt: skip
            self.problems_said.add(cause)

    def serving_again(self) -> None:
        self.problem = None
        self.problems_said.clear()  # said again if it fails again

    def succeeded(self) -> None:
        self._eject_seconds = _EJECT_FIRST_S

    def expected_seconds(self, tokens: int) -> float | None:
        """How long `tokens` more should take here, queue included; None while its speed is unknown."""
        rate = self.rate.tokens_per_second
        return None if rate is None else (self.outstanding_tokens + tokens) / rate


_TLS_WORDS = ("ssl", "tls", "handshake", "certificate", "verification")


class Incompatible(Exception):
    """A replica of a release whose wire this gateway does not speak (InfoResponse.wire_version)."""


def check_wire(info: embedding_pb2.InfoResponse) -> None:
    speaks = info.wire_version or 1  # a replica from before the field spoke version 1
    if speaks != WIRE_VERSION:
        theirs, ours = info.bouquet_version or "older", bouquet_version()
        raise Incompatible(
            f"it speaks wire version {speaks} (bouquet {theirs}) and this gateway {WIRE_VERSION} (bouquet {ours}): "
            "run gateways and replicas of one release"
        )


def unusable_cause(error: Exception) -> str:
    """What an operator should check, from a failed health watch or Info call, or a replica's Info."""
    if isinstance(error, Incompatible):
        return str(error)
    if not isinstance(error, grpc.aio.AioRpcError):  # the gateway failed on what the replica said: retried
        return f"the gateway could not take in its Info ({type(error).__name__}: {error}); asked again while it serves"
    code, details = error.code(), (error.details() or "").strip()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return f"it refused the gateway's token ({details}): give the gateway its replicas' $BOUQUET_REPLICA_TOKEN"
    if code is grpc.StatusCode.UNAVAILABLE and "hostname" in details.lower():
        return (
            f"the TLS handshake failed ({details}): its certificate does not name the address dialled; give the "
            "gateway the name it carries (--replica-tls-server-name)"
        )
    if code is grpc.StatusCode.UNAVAILABLE and any(word in details.lower() for word in _TLS_WORDS):
        return (
            f"the TLS handshake failed ({details}): check --replica-tls-ca, the client certificate and that the "
            "replica's certificate names the address dialled"
        )
    if code is grpc.StatusCode.UNAVAILABLE:
        return f"unreachable ({details}); if it serves TLS, give the gateway --replica-tls-ca"
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return f"it does not answer a call this gateway makes ({details}): is it a replica of another release?"
    return f"{code.name} ({details})"
