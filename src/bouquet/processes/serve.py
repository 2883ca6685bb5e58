"""`bouquet serve`: N local `bouquet replica` processes per model and `workers` gateway processes on one port,
each its own process (visible in `ps`, stoppable alone). Waits until the replicas serve and every gateway listens
(each only once it has heard from the replicas: gateway/app.py), so it needs no HTTP probe (which a gateway's
client certificates would refuse); restarts a child that dies; on SIGTERM or SIGINT drains the gateways first, then
the replicas.

The replicas listen on Unix sockets in a directory only this user can enter, not on TCP: no other user or host
can reach them, whatever the firewall; they also need this run's token."""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from bouquet.config import ORPHANED_SIGNAL, ServeConfig
from bouquet.flags import write_config_file
from bouquet.processes import serve_lock
from bouquet.processes.supervisor import Child, Supervisor, log_level_args

_SERVING_LINE = "bouquet replica: serving"


class ServeSupervisor(Supervisor):
    def __init__(self, config: ServeConfig):
        super().__init__("bouquet serve", config.ready_timeout, config.drain_seconds)
        self.config = config
        self.replicas: list[Child] = []
        self._sockets = tempfile.TemporaryDirectory(prefix="bouquet-replicas-")  # mode 0700
        self.replica_addresses: dict[str, str] = {}  # replica name -> its socket, once it serves
        self.replica_serving: set[str] = set()
        self.replica_models: dict[str, int] = {}  # replica name -> index of its model in config.replica_configs

    def start(self) -> bool:
        # Its replicas serve only its gateways: one token for this run, handed down by environment (not argv).
        os.environ.setdefault("BOUQUET_REPLICA_TOKEN", secrets.token_urlsafe(32))
        # Held by each gateway while it lives: orphaned replicas (serve killed) serve until it is free.
        serve_lock.create(os.path.join(self._sockets.name, "gateways.lock"))
        if not (self._start_replicas() and self._start_gateways()):
            return False
        scheme = "https" if self.config.gateway_config["gateway"].get("tls_cert") else "http"
        print(f"bouquet serve: ready on {scheme}://{self.config.host}:{self.config.port}", file=sys.stderr, flush=True)
        return True

    def groups(self) -> list[list[Child]]:
        return [self.gateways, self.replicas]  # gateways first: their in-flight requests still need the replicas

    def restart(self, child: Child) -> None:
        """A replica restarts on its old socket, so the gateways find it again."""
        if child in self.replicas:
            print(f"bouquet serve: {child.name} exited; restarting it", file=sys.stderr)
            child.restart()
        else:
            super().restart(child)

    def cleanup(self) -> None:
        self._sockets.cleanup()

    def _replica_command(self, name: str, model: int, listen: str) -> list[str]:
        """The replica config cli.py built for this model, with the address serve gives this replica, whole."""
        sections = self.config.replica_configs[model]
        sections = {**sections, "replica": {**sections["replica"], "listen": listen}}
        path = write_config_file(Path(self._sockets.name) / f"{name}.json", sections)
        return [sys.executable, "-m", "bouquet.cli", "replica", "--config", str(path), *log_level_args()]

    def _start_replicas(self) -> bool:
        env = dict(os.environ)
        models = len(self.config.replica_configs)
        if "OMP_NUM_THREADS" not in env and self.config.device != "cuda":
            # Replicas on one CPU share its cores instead of each taking them all.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (self.config.replicas * models)))
        for model in range(models):
            for index in range(self.config.replicas):
                name = f"replica{index}" if models == 1 else f"model{model}-replica{index}"
                self.replica_models[name] = model
                self.replica_addresses[name] = f"unix:{self._sockets.name}/{name}.sock"
                command = self._replica_command(name, model, self.replica_addresses[name])
                # If serve is killed, its gateways drain their requests first: the replicas serve them meanwhile.
                child = Child(name, command, env, self._serving_reader(name), death_signal=ORPHANED_SIGNAL)
                self.replicas.append(child)
        return self.wait(lambda: len(self.replica_serving) == len(self.replicas), self.replicas, "replicas to load")

    def _serving_reader(self, name: str) -> Callable[[str], None]:
        def read(line: str) -> None:
            if _SERVING_LINE in line:
                self.replica_serving.add(name)

        return read

    def _start_gateways(self) -> bool:
        c = self.config
        sections = {"gateway": {**c.gateway_config["gateway"], "replicas": list(self.replica_addresses.values())}}
        path = write_config_file(Path(self._sockets.name) / "gateway.json", sections)
        return self.start_gateways(path, c.workers, c.api_key)


def run_serve(config: ServeConfig) -> int:
    return ServeSupervisor(config).run()
