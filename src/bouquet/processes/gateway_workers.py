"""`bouquet gateway`: one gateway process (gateway/http/server.py), or with `--workers N` a supervisor of N of them on
one port, each handed this process's config whole, restarted when one dies, drained on SIGTERM."""

from __future__ import annotations

import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from bouquet import event_loop
from bouquet.config import GatewayConfig
from bouquet.flags import write_config_file
from bouquet.gateway.http.server import serve_gateway
from bouquet.processes.supervisor import Supervisor

_WORKERS_READY_SECONDS = 60.0  # for every worker to listen; they load no model


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
        scheme = "https" if c.tls_cert is not None else "http"
        print(f"bouquet gateway: listening on {scheme}://{c.host}:{c.port} ({c.workers} workers)", file=sys.stderr)
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
