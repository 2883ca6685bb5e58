"""`bouquet gateway`: one gateway process, uvicorn on uvloop and httptools, on a socket bound with SO_REUSEPORT
so several gateway processes can share a port (the kernel spreads connections across them); each connection is
bounded in size, time and number (protocol.py). SIGTERM stops accepting and lets in-flight requests finish
(up to drain_seconds). `--workers N` runs N of these under a supervisor (processes/gateway_workers.py)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import signal
import socket
import ssl
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from starlette.applications import Starlette

from bouquet.config import GatewayConfig
from bouquet.gateway.app import create_app
from bouquet.gateway.http.protocol import ConnectionLimits, bounded_protocol, connection_cap
from bouquet.processes import serve_lock

# After the drain, the seconds the 503s answering the work left have to go out before the server cancels them.
_ANSWER_SECONDS = 2


def uvicorn_config(app: Starlette, config: GatewayConfig, **overrides: Any) -> uvicorn.Config:
    """How a gateway serves `app`: each connection bounded (protocol.py), no access log, no Server or Date
    header, drained in `drain_seconds` (then the service answers what is left 503, and the server cancels what is
    still left `_ANSWER_SECONDS` later: uvicorn answers those 500); `overrides` are uvicorn's (tests: the lifespan
    run by the caller, the process's logging left alone)."""
    protocol = bounded_protocol(connection_cap(ConnectionLimits.of(config)), app.state.service.metrics)
    return uvicorn.Config(
        app, **{"http": protocol, "ws": "none", "lifespan": "on", "access_log": False, "log_level": "warning",
        "timeout_graceful_shutdown": math.ceil(config.drain_seconds) + _ANSWER_SECONDS, "server_header": False,
        "date_header": False, **_tls(config),
        **overrides},
    )  # fmt: skip


def _tls(config: GatewayConfig) -> dict[str, Any]:
    """uvicorn's HTTPS settings for --tls-cert (the gRPC port uses the same files: api/kserve_grpc.py)."""
    if config.tls_cert is None or config.tls_key is None:
        return {}
    settings: dict[str, Any] = {"ssl_certfile": str(config.tls_cert), "ssl_keyfile": str(config.tls_key)}
    if config.tls_client_ca is not None:
        settings.update(ssl_ca_certs=str(config.tls_client_ca), ssl_cert_reqs=ssl.CERT_REQUIRED)
    return settings


def scheme(config: GatewayConfig) -> str:
    return "https" if config.tls_cert is not None else "http"


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after its graceful shutdown; a drained gateway exits 0 instead. The
    first SIGTERM or SIGINT also starts the service's drain (`on_exit`); `on_listening` runs once the app has
    started (its replicas heard from) and the socket listens."""

    def __init__(self, config: uvicorn.Config, on_exit: Callable[[], None], on_listening: Callable[[], None]):
        super().__init__(config)
        self._on_exit = on_exit
        self._on_listening = on_listening

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if not self.should_exit:
            self._on_listening()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            self._on_exit()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.handle_exit, signum, None)
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    """Bound, not yet listening: uvicorn listens once the app has started. Until then the kernel gives this
    process no connection (an SO_REUSEPORT sibling that listens takes them all), so a gateway never holds a
    request it can only answer 503 because it has not yet heard what its replicas serve."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.setblocking(False)
    return sock


async def serve_gateway(config: GatewayConfig) -> int:
    app = create_app(config)
    # httptools with every connection bounded (protocol.py); no WebSocket route, so no upgrade either.
    sock = bind_socket(config.host, config.port)
    service = app.state.service
    port = sock.getsockname()[1]

    def listening() -> None:
        print(f"bouquet gateway: listening on {scheme(config)}://{config.host}:{port}", file=sys.stderr, flush=True)

    server = _Server(uvicorn_config(app, config), lambda: service.begin_drain(config.drain_seconds), listening)
    serve_lock.hold_while_alive()  # serve's replicas, orphaned, serve this process until it has exited
    # What start-up made lives as long as the process: later collections need not scan it (a full one took 11 ms).
    gc.collect()
    gc.freeze()
    await server.serve(sockets=[sock])
    return 0
