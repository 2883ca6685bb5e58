"""A gateway takes requests only once it has heard from its replicas: its start (the app's lifespan) ends when
each replica has answered its first health check, serving with its model registered or not serving, or failed it,
and only then does its socket listen. Before, a gateway process listened at once and answered 503 "no replica has
reported its model yet" for the few hundred milliseconds its first Info took: with `--workers 2` one worker could
say /health 200 while the kernel handed a request to its sibling still in that state. In-process: a real replica
on the test's event loop, the real app, no process."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import httpx
import pytest

from bouquet import event_loop
from bouquet.config import GatewayConfig, SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.app import create_app
from bouquet.gateway.http.server import bind_socket
from bouquet.gateway.service import Service
from bouquet.gateway.testing import free_port
from bouquet.replica.server import ReplicaServer

T = TypeVar("T")
_BOUND_S = 60.0  # first_round's bound in these tests: far longer than any of them should wait


def _with_replica(engine: Engine | None, scenario: Callable[[str], Awaitable[T]]) -> T:
    """`scenario(address)` on one event loop with a replica on loopback: serving `engine`, or, with None, still
    loading its model (its health NOT_SERVING)."""

    async def run() -> T:
        replica = ReplicaServer("127.0.0.1:0")
        await replica.start()
        try:
            if engine is not None:
                await replica.attach(engine, SchedulerConfig.for_device("cpu"), "float32", "cpu")
            return await scenario(f"127.0.0.1:{replica.port}")
        finally:
            await replica.stop(1.0)

    return event_loop.run(run())


def test_the_first_request_after_the_start_is_served(minilm_fp32: Engine) -> None:
    async def first_request(address: str) -> httpx.Response:
        app = create_app(GatewayConfig(replicas=(address,)))
        async with app.router.lifespan_context(app):  # what uvicorn runs before it listens
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
                return await client.post("/v1/embeddings", json={"input": ["the first request"]})

    answer = _with_replica(minilm_fp32, first_request)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["data"][0]["embedding"]) == 384


def test_the_start_ends_on_a_replica_not_serving_yet_or_unreachable() -> None:
    # A replica loading its model answers NOT_SERVING, a port with nothing behind it fails at once: neither holds
    # the start for the whole bound, and neither is taken for serving.
    async def first_round(loading: str) -> list[tuple[bool, bool]]:
        service = Service(GatewayConfig(replicas=(loading, f"127.0.0.1:{free_port()}")))
        service.start()
        try:
            await service.pool.first_round(_BOUND_S)
            return [(replica.heard, replica.healthy) for replica in service.pool.replicas]
        finally:
            await service.close()

    assert _with_replica(None, first_round) == [(True, False), (True, False)]


def test_the_start_waits_for_the_replicas_a_dns_name_gives(minilm_fp32: Engine) -> None:
    async def first_round(address: str) -> bool:
        port = address.rpartition(":")[2]
        service = Service(GatewayConfig(replicas=(), replicas_dns=(f"localhost:{port}",)))
        service.start()
        try:
            await service.pool.first_round(_BOUND_S)
            return service.pool.any_healthy(minilm_fp32.spec.name)
        finally:
            await service.close()

    assert _with_replica(minilm_fp32, first_round)


def test_the_gateways_socket_takes_no_connection_until_the_server_listens() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(sock.getsockname(), timeout=5).close()

        async def served_once_listening() -> bytes:
            async def answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                writer.write(b"up")
                await writer.drain()
                writer.close()

            async with await asyncio.start_server(answer, sock=sock):  # as uvicorn's startup listens on it
                reader, writer = await asyncio.open_connection(*sock.getsockname())
                reply = await reader.read()
                writer.close()
                return reply

        assert event_loop.run(served_once_listening()) == b"up"
    finally:
        sock.close()
