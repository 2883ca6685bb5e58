"""Processes for tests and benchmarks: `bouquet serve`, `bouquet gateway` and `bouquet replica` on loopback."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@dataclass
class Process:
    """A child process whose stderr is kept (and scanned for `ready`) by a thread."""

    process: subprocess.Popen[str]
    ready_pattern: str
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)
            if re.search(self.ready_pattern, line):
                self.ready.set()

    def wait_ready(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.wait(0.05):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("process did not become ready:\n" + "".join(self.lines[-30:]))

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            _report_hang(self.process.pid, timeout, self.lines)
            self.process.kill()
            return self.process.wait()


def _report_hang(pid: int, timeout: float, lines: list[str]) -> None:
    """A process that ignored SIGTERM for `timeout` s: its last lines and, where py-spy is installed, the Python
    stacks of it and its children, on stderr (a test's teardown shows them), before it is killed."""
    print(f"process {pid} did not stop in {timeout:.0f} s of SIGTERM; its last lines:", file=sys.stderr)
    sys.stderr.write("".join(lines[-60:]))
    spy = shutil.which("py-spy") or shutil.which("py-spy", path=str(Path(sys.executable).parent))
    if spy is None:
        return
    for each in [pid, *descendants(pid)]:
        dump = subprocess.run([spy, "dump", "--pid", str(each)], capture_output=True, text=True, timeout=30)
        sys.stderr.write(f"py-spy dump of {each}:\n{dump.stdout}{dump.stderr}")


def child_pids(pid: int) -> list[int]:
    """The ids of the processes whose parent is `pid`."""
    found: list[int] = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return found


def descendants(pid: int) -> list[int]:
    """The process ids below `pid`, children first."""
    found = child_pids(pid)
    return [*found, *(below for child in found for below in descendants(child))]


def children(pid: int) -> list[str]:
    """Command lines of the processes whose parent is `pid`."""
    found = []
    for child in child_pids(pid):
        try:
            found.append(Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # it exited meanwhile
            continue
    return found


# Options put before a command's own (which override them), by command; the test suite's conftest sets
# `--cpu-warmup-tokens 0` here, as LLM servers' suites skip graph capture: a start 0.5-1 s shorter, times 100+.
DEFAULT_ARGS: dict[str, tuple[str, ...]] = {}


def _bouquet(command_name: str, *args: str, ready: str, prefix: Sequence[str] = ()) -> Process:
    """`prefix` wraps the command, e.g. ["ip", "netns", "exec", NS] to run it on another (namespace) host."""
    defaults = DEFAULT_ARGS.get(command_name, ())
    command = [*prefix, sys.executable, "-m", "bouquet.cli", command_name, *defaults, *args]
    return Process(subprocess.Popen(command, stderr=subprocess.PIPE, text=True), ready)


def start_serve(port: int, *args: str) -> Process:
    return _bouquet("serve", "--port", str(port), *args, ready=r"bouquet serve: ready")


def start_gateway(port: int, replicas: list[str], *args: str, prefix: Sequence[str] = ()) -> Process:
    replica_args = [arg for address in replicas for arg in ("--replica", address)]
    ready = r"bouquet gateway: listening"
    return _bouquet("gateway", "--port", str(port), *replica_args, *args, ready=ready, prefix=prefix)


def start_replica(
    port: int, *args: str, host: str = "127.0.0.1", prefix: Sequence[str] = (), listen: str | None = None
) -> Process:
    """`bouquet replica` on HOST:PORT, or at `listen` (unix:PATH: with its local lane)."""
    where = listen or f"{host}:{port}"
    ready = r"serving .* on (port|unix:)"
    return _bouquet("replica", "--listen", where, "--device", "cpu", *args, ready=ready, prefix=prefix)


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{base_url}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url}/health did not answer 200 in {timeout} s")


def wait_models(base_url: str, count: int, api_key: str | None = None, timeout: float = 60.0) -> None:
    """Until GET /v1/models lists `count` models: `bouquet serve` is ready once its replicas serve, and its gateway
    registers each model when it first hears from that replica, a moment later."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(
                urllib.request.Request(f"{base_url}/v1/models", headers=headers), timeout=2
            ) as r:
                if len(json.loads(r.read())["data"]) >= count:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{base_url}/v1/models did not list {count} models in {timeout} s")
