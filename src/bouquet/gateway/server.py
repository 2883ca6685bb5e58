"""`bouquet gateway`: one gateway process, uvicorn on uvloop and httptools, on a socket bound with SO_REUSEPORT
so several gateway processes can share a port (the kernel spreads connections across them). SIGTERM stops
accepting and lets in-flight requests finish (up to drain_seconds)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
from collections.abc import Iterator

import uvicorn

from bouquet import event_loop
from bouquet.config import GatewayConfig
from bouquet.gateway.app import create_app


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after its graceful shutdown; a drained gateway exits 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self.handle_exit, signum, None)
        yield


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_gateway(config: GatewayConfig) -> int:
    app = create_app(config)
    sock = bind_socket(config.host, config.port)
    server = _Server(
        uvicorn.Config(
            app, http="httptools", lifespan="on", access_log=False, log_level="warning",
            timeout_graceful_shutdown=int(config.drain_seconds), server_header=False, date_header=False,
        )
    )  # fmt: skip
    port = sock.getsockname()[1]
    print(f"bouquet gateway: listening on http://{config.host}:{port}", file=sys.stderr, flush=True)
    await server.serve(sockets=[sock])
    return 0


def run_gateway(config: GatewayConfig) -> int:
    return event_loop.run(serve_gateway(config))
