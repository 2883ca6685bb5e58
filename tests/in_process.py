"""The HTTP API in one process: real replicas (the gRPC server and scheduler over engines a test already holds)
and the real gateway app, all on one event loop on a thread of its own. grpc.aio serves one event loop at a time
in a process, which is why the replicas and the gateway share this one. No process starts and no model loads
beyond the test's engines, so a module of API tests costs its requests, not a `bouquet serve` start (a gateway
process and a replica process per model, each importing torch and loading its model).

Two ways in, to the same app:
- `api()`: an httpx client whose transport hands each request to the app on that loop (ASGI, no socket). Clients
  that take an httpx client (openai's `http_client=`, cohere's `httpx_client=`) run on it unchanged.
- `served(..., listen=True)`: besides, the app behind the gateway's own HTTP server (uvicorn with the bounded
  protocol of gateway/http/protocol.py, as http/server.py runs it) on a loopback port of this process, for what
  needs a real socket: clients that take only a URL (huggingface_hub, langchain, litellm, haystack, urllib), a
  client that hangs up mid-request, bytes exactly as sent.
`engines()` builds the engines of a module's own models (conftest holds the bundled MiniLM's)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from starlette.applications import Starlette

from bouquet import event_loop
from bouquet.config import EngineConfig, GatewayConfig, SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.app import create_app
from bouquet.gateway.http.server import bind_socket, scheme, uvicorn_config
from bouquet.replica.server import ReplicaServer

BASE_URL = "http://testserver"
READY_SECONDS = 60.0
T = TypeVar("T")


@dataclass(frozen=True)
class Served:
    client: httpx.Client  # ASGI: no socket
    replicas: tuple[str, ...]  # each replica's gRPC address, in the order of the engines
    url: str = ""  # http://127.0.0.1:PORT with `listen` (https:// with `tls_cert`), else empty
    app: Starlette | None = None
    loop: asyncio.AbstractEventLoop | None = None  # the one the app and the replicas run on


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


def runs_an_event_loop() -> bool:
    """Whether the calling thread runs an event loop: work a test expects on the gateway's executor sees none."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@contextmanager
def engines(*model_dirs: Path, dtype: str = "float32") -> Iterator[list[Engine]]:
    """CPU engines for models other than the session's MiniLM (conftest), closed after. Without the start-up build
    of oneDNN's primitives, as conftest has the replicas tests start: built as steps meet them instead."""
    built: list[Engine] = []
    try:
        for model_dir in model_dirs:
            built.append(Engine(EngineConfig(model_dir, "cpu", dtype, cpu_warmup_tokens=0)))
        yield built
    finally:
        for engine in built:
            engine.close()


@contextmanager
def api(engines: Sequence[Engine], served_names: tuple[str, ...] = (), **options: Any) -> Iterator[httpx.Client]:
    """A client of the gateway app (GatewayConfig `options`; with an `api_key`, the client sends it) in front of one
    replica per engine, once each has registered its model."""
    with served(engines, served_names, **options) as running:
        yield running.client


@contextmanager
def served(
    engines: Sequence[Engine],
    served_names: tuple[str, ...] = (),
    scheduler: dict[str, int] | None = None,
    listen: bool = False,
    **options: Any,
) -> Iterator[Served]:
    """`api()`, with the replicas' addresses; `scheduler`: SchedulerConfig fields for every replica (as `bouquet
    replica --max-batch-tokens` etc.); `listen`: the app also served on a loopback port (`Served.url`)."""
    loop = event_loop.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="api-loop", daemon=True)
    thread.start()
    stack = AsyncExitStack()

    def call(coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    try:
        config = SchedulerConfig.for_device("cpu", **(scheduler or {}))
        replicas = tuple(call(_start_replica(stack, engine, config, served_names)) for engine in engines)
        gateway = GatewayConfig(replicas=replicas, **options)
        app = call(_start_app(stack, gateway))
        url = call(_listen(stack, app, gateway)) if listen else ""
        transport = _LoopTransport(httpx.ASGITransport(app=app), loop)
        key = options.get("api_key")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        with httpx.Client(transport=transport, base_url=BASE_URL, headers=headers, timeout=120) as client:
            yield Served(client, replicas, url, app, loop)
    finally:
        call(stack.aclose())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


async def _start_replica(
    stack: AsyncExitStack, engine: Engine, config: SchedulerConfig, served_names: tuple[str, ...]
) -> str:
    server = ReplicaServer("127.0.0.1:0")
    await server.start()
    stack.push_async_callback(server.stop, 1.0)
    await server.attach(engine, config, engine.config.dtype, "cpu", served_names)
    return f"127.0.0.1:{server.port}"


async def _start_app(stack: AsyncExitStack, config: GatewayConfig) -> Starlette:
    """Made on the loop: the gateway's gRPC channels belong to the loop they are created on. Returned once every
    replica serves and has told the gateway its model, as a test expects of a server that is up."""
    app = create_app(config)
    await stack.enter_async_context(app.router.lifespan_context(app))
    pool = app.state.service.pool
    async with asyncio.timeout(READY_SECONDS):
        while not all(replica.healthy and replica.model is not None for replica in pool.replicas):
            await asyncio.sleep(0.01)
    return app


async def _listen(stack: AsyncExitStack, app: Starlette, config: GatewayConfig) -> str:
    """The app behind server.py's uvicorn set-up on a free loopback port; the lifespan is already `_start_app`'s.
    uvicorn's `serve` installs no signal handlers off the main thread, so it runs here as it does in a gateway."""
    server = uvicorn.Server(uvicorn_config(app, config, lifespan="off", log_config=None))
    sock = bind_socket("127.0.0.1", 0)
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    stack.push_async_callback(_stop, server, task)
    while not server.started:
        if task.done():
            task.result()  # its error
        await asyncio.sleep(0.01)
    return f"{scheme(config)}://127.0.0.1:{sock.getsockname()[1]}"


async def _stop(server: uvicorn.Server, task: asyncio.Future[None]) -> None:
    server.should_exit = True
    await task
