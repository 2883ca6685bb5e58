"""Every HTTP connection to a gateway process, bounded: uvicorn's httptools protocol plus the limits it lacks.
A fault campaign held 20,000 idle connections open until every new client was reset, kept a body shorter than
its Content-Length waiting forever, and had a 50 MB header accepted.

- Size: the request line and headers hold at most `max_header_bytes`, counted as they arrive (httptools would
  otherwise gather a header whole before anyone sees it); more is 431.
- Time: headers complete within `header_timeout` of their first byte, else 408. A body that goes `body_timeout`
  without a byte is answered 408 by `http/body.read_body`, which every body-reading route uses, so the answer goes
  through the route's error path and metrics; here only a body left unread after the route answered is cut. A
  connection with no request in progress, a fresh one included, is closed after `idle_timeout` (uvicorn's
  keep-alive timer, armed here on connect as well).
- Count: at most `max_connections` a process. At the cap a new connection takes the place of the idle one that
  has waited longest (nginx reuses idle keep-alive connections the same way); only when every connection has a
  request in progress is the new one refused 503 with Retry-After. Requests in progress are never cut for room.

Defaults (config.py), and why. 16 KiB of headers: Node's limit, twice what nginx allows a line, room for long
bearer tokens. 30 s for headers and between body bytes: an honest client sends its headers in one packet and its
body without pause; nginx allows 60 s, and half that halves how long a slow-loris client holds a connection
while still sparing a congested link. 75 s idle: nginx's, longer than the 60 s idle timeout of the load balancers
usually in front, so the balancer closes first and never sends a request on a connection being closed. 10,000
connections: a cap where fairness starts, not a throughput limit (requests in progress are bounded by
max_inflight_tokens long before); each costs a descriptor and about 6 KiB (10,000 idle connections added 63 MB
to a gateway's resident memory), and the process raises its soft open-file limit toward the hard one to hold
them (`connection_cap`), lowering the cap where it cannot.

What is answered here (431, 408, 503, and 400 for bytes that are not HTTP/1.1) is OpenAI-shaped JSON like every
other error, and the connection then closes the way nginx's lingering close does: the answer and a FIN are sent,
and what the client still sends is read and dropped for a few seconds, because closing a socket with unread
bytes sends a reset, and a reset can make the client's stack drop the answer before the client reads it."""

from __future__ import annotations

import asyncio
import http
import logging
import resource
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, cast

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from bouquet.config import GatewayConfig
from bouquet.gateway.errors import ApiError, HeadersTooLarge, InvalidRequest, RequestTimeout, Unavailable, error_body
from bouquet.gateway.http.held_writes import HeldWrites
from bouquet.gateway.metrics import GatewayMetrics

logger = logging.getLogger(__name__)

_LINGER_SECONDS = 5.0  # nginx's lingering_timeout: how long a refused client may go on sending, dropped
_MAX_LINGERING = 256  # refused connections lingering at once; past it one is closed at once, a flood can't pile up
# Descriptors a gateway process needs besides its connections: listening socket, gRPC channels, log and metrics
# files, and the lingering connections above.
_FD_RESERVE = 2 * _MAX_LINGERING


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    max_header_bytes: int
    header_timeout: float
    body_timeout: float
    idle_timeout: float

    @classmethod
    def of(cls, config: GatewayConfig) -> ConnectionLimits:
        return cls(*(getattr(config, field.name) for field in fields(cls)))


def connection_cap(limits: ConnectionLimits) -> ConnectionLimits:
    """`limits` with a cap this process can hold: its soft open-file limit raised toward the hard one first (as
    Go's runtime does), the cap lowered, with a warning, where even the hard limit is too low. A cap past the
    descriptors would bring back what it guards against: accept() failing, and every new client reset."""
    wanted = limits.max_connections + _FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return limits
    cap = max(1, soft - _FD_RESERVE)
    logger.warning(
        "max_connections lowered from %d to %d: the open-file limit is %d (raise it with ulimit -n)",
        limits.max_connections,
        cap,
        soft,
    )
    return replace(limits, max_connections=cap)


class Connections:
    """What one process's connections share: how many are counted against the cap, the idle ones in the order
    they became idle (a dict: O(1) to add, drop, and find the oldest), and the metrics."""

    def __init__(self, limits: ConnectionLimits, metrics: GatewayMetrics):
        self.limits = limits
        self.metrics = metrics
        self.counted = 0
        self.lingering = 0
        self._idle: dict[BoundedHttpProtocol, None] = {}

    def admit(self) -> bool:
        """Whether a new connection may be served: under the cap, or once the longest idle one has made room."""
        if self.counted >= self.limits.max_connections:
            if not self._idle:
                return False
            next(iter(self._idle)).evict()
        self.counted += 1
        self.metrics.connections_open.inc()
        return True

    def release(self, connection: BoundedHttpProtocol) -> None:
        self._idle.pop(connection, None)
        self.counted -= 1
        self.metrics.connections_open.dec()

    def idle(self, connection: BoundedHttpProtocol) -> None:
        self._idle[connection] = None

    def busy(self, connection: BoundedHttpProtocol) -> None:
        self._idle.pop(connection, None)

    def closed(self, reason: str) -> None:
        self.metrics.connections_closed.labels(reason).inc()


class BoundedHttpProtocol(HttpToolsProtocol):
    """One connection. Its states: idle (no byte of a request yet), reading a head, reading a body, answering
    (the response, and any pipelined request behind it, in progress); `shared` is the process's `Connections`,
    set on the subclass `bounded_protocol` makes, as uvicorn builds each protocol with its own arguments only."""

    shared: ClassVar[Connections]

    def __init__(
        self, config: Config, server_state: ServerState, app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, server_state, app_state, _loop)
        self.limits = self.shared.limits
        self.timeout_keep_alive = self.limits.idle_timeout  # type: ignore[assignment]  # uvicorn's timer is ours
        self._counted = False  # counted against the cap (admitted, not yet released)
        self._in_message = False  # a request's first byte seen, its last not yet
        self._in_body = False  # its headers complete, its body not
        self._head_bytes = 0  # bytes read while a head was being read
        self._heads = 0  # heads completed, to tell whether a slice of bytes completed one
        self._idle_since = 0.0
        self._body_at = 0.0  # when the latest body bytes came
        self._timer: asyncio.TimerHandle | None = None  # the head's or body's deadline
        # The deadline a read left pending, armed once the read is parsed (`_arm_pending`): a request whose head and
        # body come in one read has none to arm, where arming each as the parser passed would make two timers a request.
        self._pending: tuple[float, Any] | None = None
        self._refusal: bytes | None = None  # an answer to send once the response in progress is done
        self._lingering = False
        self._draining = False  # the server's shutdown began: the request in progress is this connection's last

    # The connection

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(cast(asyncio.Transport, HeldWrites(transport, self.loop)))  # head and body as one
        if not self.shared.admit():
            self.shared.closed("refused")
            message = f"the gateway holds its limit of {self.limits.max_connections} connections, all busy; retry"
            self._linger(_answer(Unavailable(message, "too_many_connections", headers={"Retry-After": "1"})))
            return
        self._counted = True
        self._become_idle()

    def shutdown(self) -> None:
        """The server's drain. uvicorn closes every connection without a response in progress, one whose request
        head is still arriving too: that request, sent before the drain, would get a closed connection instead of
        its answer. It is answered, as the drain answers the requests in progress, and the connection then closes."""
        self._draining = True
        if self._in_message and not self._answering():
            return  # its head is arriving: on_headers_complete makes its response the connection's last
        super().shutdown()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        self._unset_keepalive_if_required()
        self._release()
        if self._lingering:
            self._lingering = False
            self.shared.lingering -= 1
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refusal is not None or self._lingering:
            return  # answered and closing: what the client still sends is dropped
        if self._in_body:
            super().data_received(data)
        else:
            self._head_received(data)
        self._arm_pending()
        if self._idle() and self.timeout_keep_alive_task is None and not self.transport.is_closing():
            self._arm_idle()  # bytes that begin no request (blank lines) do not restart the idle clock

    def _head_received(self, data: bytes) -> None:
        """Bytes while a head is read: at most max_header_bytes of them reach the parser. A read that completes a
        head and goes on into its body or the next request is split there; bytes of the next head in the same
        read go uncounted, so a head may pass the limit by at most one read."""
        room = self.limits.max_header_bytes - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        heads = self._heads
        if room > 0:
            super().data_received(data[:room])
        if self.transport.is_closing():
            return  # the parser refused the bytes (400)
        if self._heads == heads:
            self.shared.closed("header_too_large")
            limit = self.limits.max_header_bytes
            self._refuse(HeadersTooLarge(f"the request line and headers are over {limit} bytes", "headers_too_large"))
            return
        self.data_received(data[room:])

    # Parser callbacks

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_message = True
        self.shared.busy(self)
        self._unset_keepalive_if_required()
        self._set_timer_after_read(self.limits.header_timeout, self._head_timed_out)

    def on_headers_complete(self) -> None:
        self._heads += 1
        self._head_bytes = 0
        self._in_body = True
        self._body_at = self.loop.time()
        self._set_timer_after_read(self.limits.body_timeout, self._body_timed_out)
        super().on_headers_complete()
        if self._draining and self.cycle is not None:
            self.cycle.keep_alive = False

    def on_body(self, body: bytes) -> None:
        self._body_at = self.loop.time()  # checked when the timer fires: cheaper than a new timer a read
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._in_message = self._in_body = False
        self._cancel_timer()
        super().on_message_complete()
        if self._idle() and self._refusal is None and not self.transport.is_closing():
            self._become_idle()  # answered before its body ended (a 401, 413 or 429 unread): idle from its last byte

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts a pipelined request, or arms the keep-alive timer
        if self.transport.is_closing() or self._answering():
            return
        self._unset_keepalive_if_required()
        if self._refusal is not None:
            self._linger(self._refusal)
        elif not self._in_message:
            self._become_idle()

    def send_400_response(self, msg: str) -> None:
        """What uvicorn calls when the parser refuses the bytes (a bad request line, header or chunk): its answer is
        plain text, and every answer of the gateway is JSON."""
        self.shared.closed("invalid_http")
        self._refuse(
            InvalidRequest("the request is not valid HTTP/1.1 (its request line, headers or framing)", "invalid_http")
        )

    # Timers

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        if self._idle() and not self.transport.is_closing():
            self.shared.closed("idle_timeout")
            self.transport.close()

    def _head_timed_out(self) -> None:
        self._timer = None
        if self._answering():  # a pipelined head waits on the gateway's answer, not on the client
            self._set_timer(self.limits.header_timeout, self._head_timed_out)
            return
        self.shared.closed("header_timeout")
        seconds = self.limits.header_timeout
        self._refuse(RequestTimeout(f"the request's headers did not arrive within {seconds:g} s", "request_timeout"))

    def _body_timed_out(self) -> None:
        self._timer = None
        wait = self._body_at + self.limits.body_timeout - self.loop.time()
        if wait > 0 or self._answering():
            # Bytes came meanwhile; or the route is answering, and reading the body it answers the 408 itself.
            self._set_timer(wait if wait > 0 else self.limits.body_timeout, self._body_timed_out)
            return
        self.shared.closed("body_timeout")  # the route answered without reading it: nobody waits for the rest
        self.transport.close()

    def _set_timer(self, delay: float, callback: Any) -> None:
        self._cancel_timer()
        self._timer = self.loop.call_later(delay, callback)

    def _set_timer_after_read(self, delay: float, callback: Any) -> None:
        """From a parser callback: the deadline replaces the one running now, and is armed once the read is parsed
        unless the request has moved on by then (its head or body complete)."""
        self._cancel_timer()
        self._pending = (delay, callback)

    def _arm_pending(self) -> None:
        if self._pending is not None:
            delay, callback = self._pending
            self._pending = None
            if not self.transport.is_closing():
                self._timer = self.loop.call_later(delay, callback)

    def _cancel_timer(self) -> None:
        self._pending = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm_idle(self) -> None:
        deadline = self._idle_since + self.limits.idle_timeout
        self.timeout_keep_alive_task = self.loop.call_at(deadline, self.timeout_keep_alive_handler)

    # States

    def _answering(self) -> bool:
        """A response, or a pipelined request behind it, is in progress."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _idle(self) -> bool:
        return self._counted and not self._in_message and not self._answering()

    def _become_idle(self) -> None:
        self._idle_since = self.loop.time()
        self.shared.idle(self)
        self._unset_keepalive_if_required()
        self._arm_idle()

    def _release(self) -> None:
        if self._counted:
            self._counted = False
            self.shared.release(self)

    def evict(self) -> None:
        """Closed to make room at the cap: only ever an idle connection, so no request is cut."""
        self._release()
        self.shared.closed("evicted")
        self._unset_keepalive_if_required()
        self.transport.close()

    def _refuse(self, error: ApiError) -> None:
        """Answers `error` and closes; after the response in progress, if there is one (pipelined requests)."""
        self._cancel_timer()
        self._unset_keepalive_if_required()
        self._refusal = _answer(error)
        if not self._answering():
            self._linger(self._refusal)

    def _linger(self, answer: bytes) -> None:
        self._release()
        self._cancel_timer()
        self.transport.write(answer)
        if self.shared.lingering >= _MAX_LINGERING or not self.transport.can_write_eof():
            self.transport.close()
            return
        self._lingering = True
        self.shared.lingering += 1
        self.transport.write_eof()  # the answer, then FIN; the client's EOF then closes it (eof_received)
        self.flow.resume_reading()
        self._timer = self.loop.call_later(_LINGER_SECONDS, self.transport.close)


def _answer(error: ApiError) -> bytes:
    """A whole HTTP response for `error`, the JSON body every route answers with, and `Connection: close`."""
    body = error_body(error)
    status = f"HTTP/1.1 {error.status} {http.HTTPStatus(error.status).phrase}"
    headers = {"content-type": "application/json", "content-length": len(body), "connection": "close", **error.headers}
    lines = [status, *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def bounded_protocol(limits: ConnectionLimits, metrics: GatewayMetrics) -> type[BoundedHttpProtocol]:
    """The protocol class for `uvicorn.Config(http=...)`, bound to one process's connection table."""

    class GatewayHttpProtocol(BoundedHttpProtocol):
        shared = Connections(limits, metrics)

    return GatewayHttpProtocol
