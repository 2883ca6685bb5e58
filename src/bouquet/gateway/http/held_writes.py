"""A connection's transport that sends a response's head and body in one segment.

uvicorn writes a response's head when the route sends `http.response.start` and its body at `http.response.body`,
two writes a moment apart: two segments, so a client wakes up for the head, then again for the body, and the
gateway makes two send calls. `HeldWrites` holds a write until the next one or the end of the event loop's turn,
whichever comes first, and sends what it holds with the next write in one call (`writelines`: one `writev`). At most
one write is ever held, so nothing piles up beyond what the transport's own flow control sees, and nothing is held
past the turn it was written in.
"""

from __future__ import annotations

import asyncio
from typing import Any


class HeldWrites:
    """Wraps a connection's transport: `write` held as above; closing, EOF and abort first settle what is held;
    everything else is the transport's own."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            return
        if self._held is None:
            # A copy of anything mutable: the caller may reuse its buffer once write() returns, as a transport allows.
            self._held = data if isinstance(data, bytes) else bytes(data)
            self._loop.call_soon(self._send_held)
            return
        held, self._held = self._held, None
        self._transport.writelines((held, data))

    def writelines(self, pieces: Any) -> None:
        self._send_held()
        self._transport.writelines(pieces)

    def write_eof(self) -> None:
        self._send_held()
        self._transport.write_eof()

    def close(self) -> None:
        self._send_held()
        self._transport.close()

    def abort(self) -> None:
        self._held = None  # an abort discards what is buffered
        self._transport.abort()

    def _send_held(self) -> None:
        held, self._held = self._held, None
        # A connection the peer has gone from takes no more bytes; those it would have taken are lost either way.
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
