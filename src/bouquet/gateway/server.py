"""`bouquet gateway`: one gateway process, uvicorn on uvloop and httptools, on a socket bound with SO_REUSEPORT
so several gateway processes can share a port (the kernel spreads connections across them); each connection is
bounded in size, time and number (http_protocol.py). SIGTERM stops accepting and lets in-flight requests finish
(up to drain_seconds). With `--workers N` this process supervises N such processes instead, as `bouquet serve`
does its gateways."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import uvicorn

from bouquet import event_loop, serve_lock
from bouquet.config import GatewayConfig
from bouquet.flags import write_config_file
from bouquet.gateway.app import create_app
from bouquet.gateway.http_protocol import ConnectionLimits, bounded_protocol, connection_cap
from bouquet.gateway.supervisor import Supervisor

_WORKERS_READY_SECONDS = 60.0  # for every worker to listen; they load no model


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
    # httptools with every connection bounded (http_protocol.py); no WebSocket route, so no upgrade either.
    protocol = bounded_protocol(connection_cap(ConnectionLimits.of(config)), app.state.gateway.metrics)
    sock = bind_socket(config.host, config.port)
    server = _Server(
        uvicorn.Config(
            app, http=protocol, ws="none", lifespan="on", access_log=False, log_level="warning",
            timeout_graceful_shutdown=int(config.drain_seconds), server_header=False, date_header=False,
        )
    )  # fmt: skip
    port = sock.getsockname()[1]
    serve_lock.hold_while_alive()  # serve's replicas, orphaned, serve this process until it has exited
    # What start-up made lives as long as the process: later collections need not scan it (a full one took 11 ms).
    gc.collect()
    gc.freeze()
    print(f"bouquet gateway: listening on http://{config.host}:{port}", file=sys.stderr, flush=True)
    await server.serve(sockets=[sock])
    return 0


class GatewayWorkers(Supervisor):
    """`bouquet gateway --workers N`: N gateway processes on the port, restarted when one dies, drained on SIGTERM."""

    def __init__(self, config: GatewayConfig):
        super().__init__("bouquet gateway", _WORKERS_READY_SECONDS, config.drain_seconds)
        self.config = config
        self._config_dir = tempfile.TemporaryDirectory(prefix="bouquet-gateway-")  # mode 0700

    def cleanup(self) -> None:
        super().cleanup()
        self._config_dir.cleanup()

    def start(self) -> bool:
        c = self.config
        path = write_config_file(Path(self._config_dir.name) / "gateway.json", worker_sections(c))
        if not self.start_gateways(path, c.workers, c.api_key):
            return False
        print(f"bouquet gateway: listening on http://{c.host}:{c.port} ({c.workers} workers)", file=sys.stderr)
        return True


def worker_sections(config: GatewayConfig) -> dict[str, dict[str, object]]:
    """What each worker's `--config` file holds: this config whole, but the secrets (they go by environment, and
    the worker reads them from there as this process did) and the worker count."""
    values = {field: value for field, value in asdict(config).items() if field not in ("api_key", "replica_token")}
    return {"gateway": {**values, "workers": 1}}


def run_gateway(config: GatewayConfig) -> int:
    if config.workers > 1:
        return GatewayWorkers(config).run()
    return event_loop.run(serve_gateway(config))
