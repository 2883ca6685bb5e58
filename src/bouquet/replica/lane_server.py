"""The replica's end of the local lane (replica/lane_frames.py): Embed calls from gateways on this host, answered
by the gRPC servicer's own handler, so that scheduling, deadlines, draining, metrics and every error's status are
the gRPC path's. It listens beside the gRPC Unix socket, in the directory `bouquet serve` keeps to its user; a
gateway proves it read this replica's Info (its nonce) and holds the token the gRPC calls need.

A call is a task of the connection; a CANCEL, the call's deadline or the connection's end cancels it, so work
whose caller has gone is dropped before it is computed, as on gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import secrets
from typing import NoReturn

import grpc
from google.protobuf.message import DecodeError

from bouquet.proto import embedding_pb2
from bouquet.replica.lane_frames import NO_DEADLINE, Frame, FrameError, Kind, frame, read_frame, read_hello

logger = logging.getLogger(__name__)


class LaneAbort(Exception):
    """A handler's `context.abort`: the call ends with this status."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class LaneContext:
    """What the servicer's handler reads of a gRPC context: the time left, and `abort`."""

    def __init__(self, deadline: float | None):
        self._deadline = deadline

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - asyncio.get_running_loop().time())

    async def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise LaneAbort(code, details)


class LaneServer:
    def __init__(self, path: str, servicer: object, token: str | None):
        """`servicer`: replica/server.py's EmbeddingServicer (its `Embed`)."""
        self.path = path
        self.nonce = secrets.token_hex(16)  # a new one per process: a restarted replica's lane is a new lane
        self._servicer = servicer
        self._token = token.encode() if token else None
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a socket left by a replica that was killed
        self._server = await asyncio.start_unix_server(self._serve, path=self.path)
        os.chmod(self.path, 0o600)

    async def stop(self) -> None:
        """Closes the socket and every connection: calls still in flight end UNAVAILABLE at the gateways, which
        move them to another replica (a drain waits for the calls first)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        calls: dict[int, asyncio.Task[None]] = {}
        try:
            if await self._welcome(reader, writer):
                while True:
                    self._take(await read_frame(reader), calls, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the gateway went
        except FrameError as error:
            logger.warning("local lane: closing a connection: %s", error)
        finally:
            for call in calls.values():
                call.cancel()
            writer.close()
            self._connections.discard(task)

    async def _welcome(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        hello = await read_frame(reader)
        nonce, token = read_hello(hello.payload) if hello.kind is Kind.HELLO else (b"", b"")
        refusal = None
        if not hmac.compare_digest(nonce, self.nonce.encode()):
            refusal = "this lane belongs to another replica than the Info the gateway read"
        elif self._token is not None and not hmac.compare_digest(token, self._token):
            refusal = "this replica needs the gateway's token ($BOUQUET_REPLICA_TOKEN)"
        writer.write(frame(Kind.REFUSED, payload=refusal.encode()) if refusal else frame(Kind.WELCOME))
        return refusal is None

    def _take(self, received: Frame, calls: dict[int, asyncio.Task[None]], writer: asyncio.StreamWriter) -> None:
        if received.kind is Kind.CALL:
            call = asyncio.get_running_loop().create_task(self._answer(received, writer))
            calls[received.call] = call
            call.add_done_callback(lambda _: calls.pop(received.call, None))
        elif received.kind is Kind.CANCEL and (withdrawn := calls.get(received.call)) is not None:
            withdrawn.cancel()
        elif received.kind is not Kind.CANCEL:  # a CANCEL may cross its call's answer
            raise FrameError(f"a {received.kind.name} frame from a gateway")

    async def _answer(self, call: Frame, writer: asyncio.StreamWriter) -> None:
        deadline = None if call.number == NO_DEADLINE else asyncio.get_running_loop().time() + call.number
        try:
            request = embedding_pb2.EmbedRequest.FromString(call.payload)
        except DecodeError as error:
            answer = _failed(call.call, grpc.StatusCode.INVALID_ARGUMENT, f"an unreadable EmbedRequest: {error}")
        else:
            answer = await self._embed(call.call, request, deadline)
        with contextlib.suppress(ConnectionError):
            writer.write(answer)
            await writer.drain()  # a large reply waits for the socket, not in an unbounded buffer

    async def _embed(self, call: int, request: embedding_pb2.EmbedRequest, deadline: float | None) -> bytes:
        try:
            async with asyncio.timeout_at(deadline):
                reply = await self._servicer.Embed(request, LaneContext(deadline))  # type: ignore[attr-defined]
            return frame(Kind.REPLY, call, payload=reply.SerializeToString())
        except LaneAbort as error:  # every error of the handler's comes as its status (server.py's `_mapped`)
            return _failed(call, error.code, error.details)
        except TimeoutError:
            return _failed(call, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")


def _failed(call: int, code: grpc.StatusCode, details: str) -> bytes:
    return frame(Kind.FAILED, call, float(code.value[0]), details.encode())
