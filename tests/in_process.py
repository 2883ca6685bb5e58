"""The HTTP API in one process: real replicas (the gRPC server and scheduler over engines a test already holds)
and the real gateway app, all on one event loop on a thread of its own, called through an httpx client whose
transport hands each request to the app on that loop (ASGI, no socket). grpc.aio serves one event loop at a time
in a process, which is why the replicas and the gateway share this one. No process starts and no model loads
beyond the test's engines, so a module of API tests costs its requests, not a `bouquet serve` start; clients
that take an httpx client (openai, cohere) run on it unchanged."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import AsyncExitStack, contextmanager
from typing import Any, TypeVar

import httpx
from starlette.applications import Starlette

from bouquet import event_loop
from bouquet.config import GatewayConfig, SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.app import create_app
from bouquet.replica.server import ReplicaServer

BASE_URL = "http://testserver"
T = TypeVar("T")


class _LoopTransport(httpx.BaseTransport):
    """A sync httpx transport that runs each request through `inner` (ASGI) on `loop` and waits for it."""

    def __init__(self, inner: httpx.ASGITransport, loop: asyncio.AbstractEventLoop):
        self.inner, self.loop = inner, loop

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        async def send() -> httpx.Response:
            request.stream = httpx.ByteStream(request.read())
            response = await self.inner.handle_async_request(request)
            body = await response.aread()
            return httpx.Response(response.status_code, headers=response.headers, content=body)

        return asyncio.run_coroutine_threadsafe(send(), self.loop).result(120)


@contextmanager
def api(engines: list[Engine], served_names: tuple[str, ...] = (), **options: Any) -> Iterator[httpx.Client]:
    """A client of the gateway app (GatewayConfig `options`; with an `api_key`, the client sends it) in front of one
    replica per engine, once each has registered its model."""
    loop = event_loop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="api-loop", daemon=True)
    thread.start()
    stack = AsyncExitStack()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    try:
        addresses = tuple(call(_start_replica(stack, engine, served_names)) for engine in engines)
        app = call(_start_app(stack, GatewayConfig(replicas=addresses, **options)))
        transport = _LoopTransport(httpx.ASGITransport(app=app), loop)
        key = options.get("api_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(transport=transport, base_url=BASE_URL, headers=headers, timeout=120) as client:
            _wait_models(client, len(engines))
            yield client
    finally:
        call(stack.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def _start_replica(stack: AsyncExitStack, engine: Engine, served_names: tuple[str, ...]) -> str:
    server = ReplicaServer("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, 1.0)
    await server.attach(engine, SchedulerConfig.for_device("cpu"), "float32", "cpu", served_names)
    return f"127.0.0.1:{server.port}"


async def _start_app(stack: AsyncExitStack, config: GatewayConfig) -> Starlette:
    """Made on the loop: the gateway's gRPC channels belong to the loop they are created on."""
    app = create_app(config)
    await stack.enter_async_context(app.router.lifespan_context(app))
    return app


def _wait_models(client: httpx.Client, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(client.get("/v1/models").json().get("data", [])) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the gateway did not list {count} models in {timeout} s")
        time.sleep(0.02)
