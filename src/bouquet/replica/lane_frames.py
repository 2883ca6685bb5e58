"""The local lane's wire: Embed calls between a gateway and a replica on the same host over a Unix socket, beside
gRPC (replica/lane_server.py, gateway/replicas/lane.py). The messages are the gRPC service's own EmbedRequest and
EmbedResponse; only the framing is new, because grpc.aio hands every message through its poller threads on both
sides: a round trip here took ~500-750 us after the 2-3 ms a query's forward idles the connection, where an
asyncio Unix socket took ~70-120 us (docs/benchmarks.md, "The local lane").

A frame is a fixed header, then `length` bytes of payload:
    kind (u8), call (u32, the caller's number for the call), number (f64: a CALL's seconds left, or -1 for none;
    a FAILED's gRPC status code), length (u32).
A connection opens with HELLO (payload: the nonce the replica's Info gave, a NUL, the gateway's token) answered by
WELCOME, or by REFUSED (payload: why) and the close. Then any number of CALLs (payload: an EmbedRequest) in flight
at once, each answered by REPLY (an EmbedResponse) or FAILED (payload: the status's details), in any order; a
CANCEL withdraws a call whose caller has gone. No torch: the gateway imports this."""

from __future__ import annotations

import asyncio
import struct
from dataclasses import dataclass
from enum import IntEnum

HEADER = struct.Struct("<BIdI")
NO_DEADLINE = -1.0
# The largest payload a frame may carry: gRPC's limit between gateway and replica (replica/server.py).
MAX_PAYLOAD_BYTES = 256 * 1024 * 1024
LANE_SUFFIX = ".lane"  # the lane's socket: the replica's gRPC socket path with this added


class Kind(IntEnum):
    HELLO = 1
    WELCOME = 2
    REFUSED = 3
    CALL = 4
    CANCEL = 5
    REPLY = 6
    FAILED = 7


@dataclass(frozen=True)
class Frame:
    kind: Kind
    call: int
    number: float
    payload: bytes


class FrameError(Exception):
    """A frame this end cannot read: an unknown kind or an oversized payload. The connection is closed."""


def frame(kind: Kind, call: int = 0, number: float = 0.0, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, call, number, len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> Frame:
    """The next frame; asyncio.IncompleteReadError at the connection's end."""
    kind, call, number, length = HEADER.unpack(await reader.readexactly(HEADER.size))
    if length > MAX_PAYLOAD_BYTES:
        raise FrameError(f"a frame of {length} bytes, over the lane's {MAX_PAYLOAD_BYTES}")
    try:
        known = Kind(kind)
    except ValueError:
        raise FrameError(f"a frame of unknown kind {kind}") from None
    return Frame(known, call, number, await reader.readexactly(length) if length else b"")


def hello_payload(nonce: bytes, token: str | None) -> bytes:
    return nonce + b"\0" + (token or "").encode()


def read_hello(payload: bytes) -> tuple[bytes, bytes]:
    """(nonce, token) of a HELLO's payload."""
    nonce, _, token = payload.partition(b"\0")
    return nonce, token


def lane_path(listen: str) -> str | None:
    """Where a replica listening at `listen` keeps its lane: beside its gRPC Unix socket; None for a TCP listener
    (its gateways may be on other hosts: they use gRPC)."""
    return listen.removeprefix("unix:") + LANE_SUFFIX if listen.startswith("unix:") else None
