"""Reading a request's body: its size bounded before and while it is read, gzip decoded within the same bound,
a pause between its bytes bounded, and the JSON object parsed. Every route with a body reads it here, so each of
these refusals is the route's own error answer, counted under the route."""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from bouquet.gateway.errors import (
    ClientClosed,
    InvalidRequest,
    RequestTimeout,
    TooLarge,
    UnsupportedMedia,
)
from bouquet.gateway.http.decode import BodyDecoder
from bouquet.gateway.service import Service

T = TypeVar("T", bound=msgspec.Struct)


async def refuse_unread(service: Service, request: Request) -> None:
    """A large body refused before it is read while the bulk lane is over its cap (`Admission.refuse_unread`);
    one over the body limit is left to `read_body`'s 413."""
    length = content_length(request)
    if length is not None and length <= service.config.max_payload_bytes:
        await service.admission.refuse_unread(length)


async def read_request(service: Service, request: Request, decoder: BodyDecoder[T]) -> T:
    """The body decoded into its route's struct (http/decode.py), unknown fields refused unless the server runs
    with --allow-unknown-fields."""
    return decoder.decode(await read_body(service, request), strict=not service.config.allow_unknown_fields)


async def read_body(service: Service, request: Request, limit: int | None = None) -> bytes | bytearray:
    """The body's bytes, gunzipped if they came compressed, within the size limit (`max_payload_bytes` unless the
    route has its own: an image's bytes)."""
    limit = limit or service.config.max_payload_bytes
    length = content_length(request)
    if length is not None and length > limit:
        raise TooLarge(f"the body has {length} bytes, over the limit of {limit}", "payload_too_large")
    encoding = request.headers.get("content-encoding", "identity")
    return _decoded(await _read_body(service, request, limit), encoding, limit)


async def _read_body(service: Service, request: Request, limit: int) -> bytearray:
    """The whole body, within two deadlines kept as one timer (its earlier): `body_timeout` without a byte, and for
    the whole body `body_timeout` plus a second per `body_min_rate` bytes that have arrived (Apache's mod_reqtimeout
    MinRate), so a client trickling a byte a second cannot hold a request open for hours. The timeout lives here, in
    the one reader every route with a body uses, so the 408 is the route's own error answer, counted under the
    route; a client that stops sending (a body shorter than its Content-Length) no longer holds its connection."""
    body = bytearray()
    config = service.config
    loop = asyncio.get_running_loop()
    started = loop.time()
    by_pause = True  # which deadline the timer holds; the first byte's: both are `body_timeout` away
    try:
        async with aclosing(request.stream()) as pieces, asyncio.timeout_at(started + config.body_timeout) as timer:
            while (piece := await _next_piece(pieces)) is not None:
                if not piece:
                    continue  # the stream's end marker: no byte came
                body += piece
                if len(body) > limit:
                    raise TooLarge(f"the body is over the limit of {limit} bytes", "payload_too_large")
                pause = loop.time() + config.body_timeout
                whole = started + config.body_timeout + len(body) / config.body_min_rate
                by_pause = pause <= whole
                timer.reschedule(min(pause, whole))
    except TimeoutError:
        raise _timed_out(service, by_pause, len(body), loop.time() - started) from None
    return body


async def _next_piece(pieces: AsyncGenerator[bytes, None]) -> bytes | None:
    """The body's next piece, None at its end."""
    try:
        return await anext(pieces, None)
    except ClientDisconnect:
        raise ClientClosed("the client closed the connection before its body ended", "client_closed") from None


def _timed_out(service: Service, by_pause: bool, received: int, elapsed: float) -> RequestTimeout:
    """The 408 for the deadline that passed: a pause of `body_timeout` between bytes, or the whole body's."""
    config = service.config
    if by_pause:
        service.metrics.connections_closed.labels("body_timeout").inc()
        return RequestTimeout(
            f"no byte of the body arrived for {config.body_timeout:g} s (is it shorter than its Content-Length?)",
            "request_timeout",
            headers={"Connection": "close"},  # the rest of the body may still come: the connection is done
        )
    service.metrics.connections_closed.labels("body_too_slow").inc()
    return RequestTimeout(
        f"the body came slower than {config.body_min_rate} bytes a second ({received} bytes in {elapsed:.0f} s)",
        "request_timeout",
        headers={"Connection": "close"},
    )


def content_length(request: Request) -> int | None:
    """The body's size as its Content-Length states it; None without one (chunked) or with a malformed one."""
    length = request.headers.get("content-length")
    return int(length) if length is not None and length.isdigit() else None


def _decoded(body: bytearray, encoding: str, limit: int) -> bytes | bytearray:
    """The body as sent, or gunzipped (clients that compress requests); the limit holds for the decompressed
    body too, so a small bomb cannot grow past it."""
    encoding = encoding.strip().lower()
    if encoding in ("identity", ""):
        return body
    if encoding not in ("gzip", "x-gzip"):
        raise UnsupportedMedia(
            f"Content-Encoding {encoding!r} is not supported; send gzip or none", "unsupported_encoding"
        )
    inflater = zlib.decompressobj(wbits=31)  # 31: a gzip header and trailer
    try:
        plain = inflater.decompress(bytes(body), limit + 1)
    except zlib.error as error:
        raise InvalidRequest(f"the gzip body is corrupt: {error}", "invalid_gzip") from error
    if len(plain) > limit or inflater.unconsumed_tail:
        raise TooLarge(f"the decompressed body is over the limit of {limit} bytes", "payload_too_large")
    if not inflater.eof:
        raise InvalidRequest("the gzip body ends before its stream does", "invalid_gzip")
    return plain
