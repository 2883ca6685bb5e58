"""`bouquet serve`: N local `bouquet replica` processes and `workers` gateway processes on one port, each its
own process (visible in `ps`, stoppable alone). Waits until the replicas serve and the gateway answers
/health; restarts a child that dies; on SIGTERM or SIGINT drains the gateways first, then the replicas."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from bouquet.config import ServeConfig

_PORT_LINE = re.compile(r"serving .* on port (\d+)")


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM if the supervisor dies without draining (killed with SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Child:
    """A subprocess whose stderr is copied to ours line by line; `on_line` sees each line first."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], on_line: Callable[[str], None]):
        self.name = name
        self.command = command
        self.env = env
        self._on_line = on_line
        self.process = self._start()

    def _start(self) -> subprocess.Popen[str]:
        # A session of its own: a Ctrl-C at the terminal reaches only the supervisor, which drains in order.
        process = subprocess.Popen(
            self.command, env=self.env, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=_die_with_parent,
        )  # fmt: skip
        threading.Thread(target=self._copy, args=(process,), name=f"{self.name}-stderr", daemon=True).start()
        return process

    def _copy(self, process: subprocess.Popen[str]) -> None:
        assert process.stderr is not None
        for line in process.stderr:
            self._on_line(line)
            sys.stderr.write(f"[{self.name}] {line}")
        process.stderr.close()

    def restart(self, command: list[str] | None = None) -> None:
        self.command = command or self.command
        self.process = self._start()

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            print(f"bouquet serve: {self.name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr)
            self.process.kill()
            self.process.wait()


class Supervisor:
    def __init__(self, config: ServeConfig):
        self.config = config
        self.stop = threading.Event()
        self.replicas: list[Child] = []
        self.replica_ports: dict[str, int] = {}
        self.gateways: list[Child] = []
        self._listening = threading.Semaphore(0)
        self._metrics_dir: tempfile.TemporaryDirectory[str] | None = None

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop.set())
        try:
            if self._start_replicas() and self._start_gateways():
                url = f"http://{self.config.host}:{self.config.port}"
                print(f"bouquet serve: ready on {url}", file=sys.stderr, flush=True)
                self._supervise()
                return 0
            return 0 if self.stop.is_set() else 1
        finally:
            self._drain()

    def _replica_command(self, listen: str) -> list[str]:
        c = self.config
        command = [sys.executable, "-m", "bouquet.cli", "replica", "--model", str(c.model_path), "--listen", listen,
                   "--device", c.device, "--dtype", c.dtype, "--drain-seconds", str(c.drain_seconds)]  # fmt: skip
        if c.max_batch_tokens:
            command += ["--max-batch-tokens", str(c.max_batch_tokens)]
        return command

    def _start_replicas(self) -> bool:
        env = dict(os.environ)
        if "OMP_NUM_THREADS" not in env and self.config.device != "cuda":
            # Replicas on one CPU share its cores instead of each taking them all.
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // self.config.replicas))
        for index in range(self.config.replicas):
            name = f"replica{index}"
            self.replicas.append(Child(name, self._replica_command("127.0.0.1:0"), env, self._port_reader(name)))
        return self._wait(lambda: len(self.replica_ports) == len(self.replicas), self.replicas, "replicas to load")

    def _port_reader(self, name: str) -> Callable[[str], None]:
        def read(line: str) -> None:
            match = _PORT_LINE.search(line)
            if match:
                self.replica_ports[name] = int(match.group(1))

        return read

    def _start_gateways(self) -> bool:
        c = self.config
        env = dict(os.environ)
        if c.api_key:
            env["BOUQUET_API_KEY"] = c.api_key  # not on the command line, where `ps` would show it
        if c.workers > 1:
            self._metrics_dir = tempfile.TemporaryDirectory(prefix="bouquet-metrics-")
            env["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir.name
        command = [sys.executable, "-m", "bouquet.cli", "gateway", "--host", c.host, "--port", str(c.port),
                   "--model", str(c.model_path), "--drain-seconds", str(c.drain_seconds), *c.gateway_args]  # fmt: skip
        for port in self.replica_ports.values():
            command += ["--replica", f"127.0.0.1:{port}"]
        for index in range(c.workers):
            self.gateways.append(Child(f"gateway{index}", command, env, self._listen_reader))
        listening = self._wait(lambda: self._listening.acquire(blocking=False), self.gateways, "gateways", c.workers)
        return listening and self._wait(self._healthy, self.gateways, "/health to answer 200")

    def _listen_reader(self, line: str) -> None:
        if "bouquet gateway: listening" in line:
            self._listening.release()

    def _healthy(self) -> bool:
        host = "127.0.0.1" if self.config.host in ("0.0.0.0", "") else self.config.host
        try:
            with urllib.request.urlopen(f"http://{host}:{self.config.port}/health", timeout=2) as reply:
                return reply.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def _wait(self, condition: Callable[[], bool], children: list[Child], what: str, times: int = 1) -> bool:
        deadline = time.monotonic() + self.config.ready_timeout
        while times:
            if condition():
                times -= 1
                continue
            if self.stop.wait(0.05):
                return False
            dead = [child.name for child in children if child.process.poll() is not None]
            if dead or time.monotonic() > deadline:
                reason = f"{', '.join(dead)} exited" if dead else f"timed out after {self.config.ready_timeout} s"
                print(f"bouquet serve: error: waiting for {what}: {reason}", file=sys.stderr, flush=True)
                return False
        return True

    def _supervise(self) -> None:
        """Restarts a child that exits while serving: a replica on its old port, so the gateways find it."""
        while not self.stop.wait(0.5):
            for child in self.replicas:
                if child.process.poll() is not None and not self.stop.is_set():
                    port = self.replica_ports[child.name]
                    print(f"bouquet serve: {child.name} exited; restarting it on port {port}", file=sys.stderr)
                    child.restart(self._replica_command(f"127.0.0.1:{port}"))
            for child in self.gateways:
                if child.process.poll() is not None and not self.stop.is_set():
                    print(f"bouquet serve: {child.name} exited; restarting it", file=sys.stderr)
                    child.restart()

    def _drain(self) -> None:
        """Gateways first (their in-flight requests still need the replicas), then the replicas."""
        print("bouquet serve: draining", file=sys.stderr, flush=True)
        for group in (self.gateways, self.replicas):
            for child in group:
                child.terminate()
            for child in group:
                child.wait(self.config.drain_seconds + 10)
        if self._metrics_dir is not None:
            self._metrics_dir.cleanup()


def run_serve(config: ServeConfig) -> int:
    return Supervisor(config).run()
