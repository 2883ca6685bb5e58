"""`bouquet gateway`: one gateway process, uvicorn on uvloop and httptools, on a socket bound with SO_REUSEPORT
so several gateway processes can share a port (the kernel spreads connections across them). SIGTERM stops
accepting and lets in-flight requests finish (up to drain_seconds)."""

from __future__ import annotations

import asyncio
import socket
import sys

import uvicorn

from bouquet.config import GatewayConfig
from bouquet.gateway.app import create_app


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
    server = uvicorn.Server(
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
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio's own loop also works
        return asyncio.run(serve_gateway(config))
    return uvloop.run(serve_gateway(config))
