"""One HTTP/1.1 answer read from a connection the gateway opened (image_fetch.py's GET): its status line and
headers within `MAX_HEAD_BYTES`, then, for a 200 only, its body by Content-Length, chunks or the connection's
close, counted as it streams and cut at `max_bytes` whatever the headers declare. The standard library's streams
only: the gateway's core imports no HTTP library (tests/test_gateway_layout.py)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from bouquet.gateway.errors import InvalidRequest

MAX_HEAD_BYTES = 16 * 1024  # the status line and headers: an image server's are a few hundred bytes
READ_SIZE = 64 * 1024


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]  # names in lower case
    body: bytes  # a 200's; empty for any other status (a redirect's or an error's body is not read)


async def read_answer(reader: asyncio.StreamReader, max_bytes: int, name: str) -> Answer:
    """The answer; a 400 naming the input `name` when it is not HTTP, ends early, or its body is over `max_bytes`."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise _malformed(name, f"its headers are over {MAX_HEAD_BYTES} bytes") from None
    except asyncio.IncompleteReadError:
        raise _malformed(name, "it ended before its headers did") from None
    status_line, *lines = head[:-4].decode("latin-1").split("\r\n")
    version, _, rest = status_line.partition(" ")
    if not version.startswith("HTTP/1.") or not rest[:3].isdigit():
        raise _malformed(name, f"its status line is {status_line[:60]!r}")
    headers: dict[str, str] = {}
    for line in lines:
        key, colon, value = line.partition(":")
        if not colon:
            raise _malformed(name, f"a header line is {line[:60]!r}")
        headers[key.strip().lower()] = value.strip()
    status = int(rest[:3])
    if status != 200:
        return Answer(status, headers, b"")
    try:
        return Answer(status, headers, await _body(reader, headers, max_bytes, name))
    except asyncio.IncompleteReadError:
        raise _malformed(name, "its body ended early") from None


async def _body(reader: asyncio.StreamReader, headers: dict[str, str], max_bytes: int, name: str) -> bytes:
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _chunks(reader, max_bytes, name)
    length = headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise _malformed(name, f"its Content-Length is {length[:30]!r}")
        if int(length) > max_bytes:  # refused before the body; a smaller length is read, never trusted beyond
            raise too_large(name, max_bytes)
        return await reader.readexactly(int(length))
    body = bytearray()  # delimited by the connection's close
    while piece := await reader.read(READ_SIZE):
        body += piece
        if len(body) > max_bytes:
            raise too_large(name, max_bytes)
    return bytes(body)


async def _chunks(reader: asyncio.StreamReader, max_bytes: int, name: str) -> bytes:
    body = bytearray()
    while True:
        line = await reader.readuntil(b"\r\n")
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise _malformed(name, f"a chunk's size line is {line[:30]!r}") from None
        if size == 0:
            return bytes(body)  # trailers, if any, are left unread: the connection closes
        if len(body) + size > max_bytes:
            raise too_large(name, max_bytes)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise _malformed(name, "a chunk does not end in CRLF")


# Why a URL was not fetched, as the metrics label it: no origin listed at all, its origin (or a redirect's) not
# listed, a listed name resolving inward, no connection or answer, past the deadline, an answer not a 200 image (or
# not HTTP/1.1, or redirecting without end), over a byte cap.
REFUSALS = ("no_origins", "not_listed", "inward_address", "unreachable", "timeout", "bad_answer", "too_large")


class FetchRefused(InvalidRequest):
    """An image URL not fetched: a 400 naming the input, and the `reason` the fetch metrics count it under."""

    def __init__(self, message: str, code: str, name: str | None = None, reason: str = "bad_answer"):
        super().__init__(message, code, name)
        self.reason = reason


def too_large(name: str, limit: int) -> FetchRefused:
    return FetchRefused(
        f"{name} is an image of over {limit} bytes, over the limit", "image_too_large", name, "too_large"
    )


def _malformed(name: str, why: str) -> FetchRefused:
    return FetchRefused(
        f"{name}: the image server's answer is not HTTP/1.1 as read here: {why}", "image_url_failed", name, "bad_answer"
    )
