"""The gateway's end of a replica's local lane (replica/lane_frames.py): its Embed calls over the replica's Unix
socket beside gRPC, when its Info names one that this host has. Every failure looks as a gRPC call's would (an
AioRpcError of the same status), so the pool's retries, ejections and marking down are the same on both paths:
the connection's end is UNAVAILABLE, a call past its timeout DEADLINE_EXCEEDED, and the replica's own statuses come
back as it gave them. Info, health and every other call stay on gRPC; a lane that cannot be opened leaves the
replica on gRPC alone, said once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

import grpc

from bouquet.proto import embedding_pb2
from bouquet.replica.lane_frames import NO_DEADLINE, FrameError, Kind, frame, hello_payload, read_frame

logger = logging.getLogger(__name__)

_OPEN_TIMEOUT_S = 2.0


class LaneRefused(Exception):
    """The replica's lane turned the gateway away (another replica's socket, or a wrong token)."""


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Lane:
    """One connection to one replica's lane; calls multiplexed on it by number."""

    def __init__(self, path: str, nonce: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.path, self.nonce = path, nonce
        self._reader, self._writer = reader, writer
        self._numbers = itertools.count(1)
        self._pending: dict[int, asyncio.Future[embedding_pb2.EmbedResponse]] = {}
        self._closed: str | None = None  # why, once closed
        self._replies = asyncio.get_running_loop().create_task(self._read_replies())

    @classmethod
    async def open(cls, path: str, nonce: str, token: str | None) -> Lane:
        """Connects and shows the replica its nonce and the token; OSError or TimeoutError where the socket is not
        there or does not answer, LaneRefused where it refuses."""
        async with asyncio.timeout(_OPEN_TIMEOUT_S):
            reader, writer = await asyncio.open_unix_connection(path)
            try:
                writer.write(frame(Kind.HELLO, payload=hello_payload(nonce.encode(), token)))
                answer = await read_frame(reader)
            except BaseException:
                writer.close()
                raise
        if answer.kind is not Kind.WELCOME:
            writer.close()
            raise LaneRefused(answer.payload.decode(errors="replace") or f"answered {answer.kind.name}")
        return cls(path, nonce, reader, writer)

    @property
    def open_now(self) -> bool:
        return self._closed is None

    async def embed(self, request: embedding_pb2.EmbedRequest, timeout: float | None) -> embedding_pb2.EmbedResponse:
        """As the gRPC stub's Embed with this timeout."""
        if self._closed is not None:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, self._closed)
        number = next(self._numbers)
        answer = self._pending[number] = asyncio.get_running_loop().create_future()
        seconds = NO_DEADLINE if timeout is None else max(0.0, timeout)
        self._writer.write(frame(Kind.CALL, number, seconds, request.SerializeToString()))
        try:
            async with asyncio.timeout(timeout):
                reply: embedding_pb2.EmbedResponse = await answer
            return reply
        except TimeoutError:
            self._cancel(number)
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded") from None
        except asyncio.CancelledError:  # the request went (its client disconnected, or it was refused)
            self._cancel(number)
            raise
        finally:
            self._pending.pop(number, None)

    def _cancel(self, number: int) -> None:
        if self._closed is None and number in self._pending:
            self._writer.write(frame(Kind.CANCEL, number))

    async def _read_replies(self) -> None:
        try:
            while True:
                received = await read_frame(self._reader)
                answer = self._pending.get(received.call)
                if answer is None or answer.done():
                    continue  # a call that timed out or was cancelled meanwhile
                if received.kind is Kind.REPLY:
                    answer.set_result(embedding_pb2.EmbedResponse.FromString(received.payload))
                elif received.kind is Kind.FAILED:
                    code = _status(int(received.number))
                    answer.set_exception(rpc_error(code, received.payload.decode(errors="replace")))
                else:
                    raise FrameError(f"a {received.kind.name} frame from a replica")
        except (asyncio.IncompleteReadError, ConnectionError):
            self._end("the replica's local lane closed")
        except (FrameError, ValueError) as error:  # ValueError: a reply that does not parse
            logger.warning("local lane %s: %s; closing it", self.path, error)
            self._end(f"the replica's local lane failed: {error}")
        except asyncio.CancelledError:
            self._end("the local lane was closed")
            raise

    def _end(self, why: str) -> None:
        """Every call in flight ends UNAVAILABLE, as on a broken gRPC connection: the pool moves it elsewhere."""
        if self._closed is None:
            self._closed = why
            self._writer.close()
        for answer in self._pending.values():
            if not answer.done():
                answer.set_exception(rpc_error(grpc.StatusCode.UNAVAILABLE, why))

    async def close(self) -> None:
        self._replies.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replies


def _status(value: int) -> grpc.StatusCode:
    return next((code for code in grpc.StatusCode if code.value[0] == value), grpc.StatusCode.UNKNOWN)
