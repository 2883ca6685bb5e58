"""Local child processes for `bouquet serve` and `bouquet gateway --workers N`: each its own process (visible in
`ps`, stoppable alone) whose stderr is copied to ours under its name. A supervisor starts them, restarts one that
dies while serving, and on SIGTERM or SIGINT drains them group by group."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import multiprocess


def log_level_args() -> list[str]:
    """This process's log level, for a child's command line (not part of any config)."""
    return ["--log-level", logging.getLevelName(logging.getLogger().getEffectiveLevel())]


def _die_with_parent(signum: int) -> Callable[[], None]:
    """Linux: the child gets `signum` if the supervisor dies without draining (killed with SIGKILL)."""

    def set_death_signal() -> None:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG

    return set_death_signal


class Child:
    """A subprocess whose stderr is copied to ours line by line; `on_line` sees each line first. `death_signal`
    reaches it if the supervisor dies: SIGTERM (drain now), or a signal the child takes as "drain once the
    processes in front of you have" (a replica, whose gateways drain their requests first)."""

    def __init__(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        on_line: Callable[[str], None],
        death_signal: int = signal.SIGTERM,
    ):
        self.name = name
        self.command = command
        self.env = env
        self._on_line = on_line
        self._death_signal = death_signal
        self.process = self._start()

    def _start(self) -> subprocess.Popen[str]:
        # A session of its own: a Ctrl-C at the terminal reaches only the supervisor, which drains in order.
        process = subprocess.Popen(
            self.command, env=self.env, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=_die_with_parent(self._death_signal),
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
            print(f"bouquet: {self.name} did not stop in {timeout:.0f} s; killing it", file=sys.stderr)
            self.process.kill()
            self.process.wait()


class Supervisor:
    """Runs until SIGTERM or SIGINT: `start` starts the children, one that exits while serving is restarted, and
    at the end every group in `groups()` is drained in turn. Subclasses add their children and their order."""

    def __init__(self, name: str, ready_timeout: float, drain_seconds: float):
        self.name = name  # the prefix of its messages, as in "bouquet serve: ready"
        self.ready_timeout = ready_timeout
        self.drain_seconds = drain_seconds
        self.stop = threading.Event()
        self.gateways: list[Child] = []
        self._listening = threading.Semaphore(0)
        self._metrics_dir: tempfile.TemporaryDirectory[str] | None = None

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: self.stop.set())
        try:
            if self.start():
                self._supervise()
                return 0
            return 0 if self.stop.is_set() else 1
        finally:
            self._drain()

    def start(self) -> bool:
        """Starts the children and waits until they serve; False when one exits first, on a timeout or a signal."""
        raise NotImplementedError

    def groups(self) -> list[list[Child]]:
        """The children, in the order they drain."""
        return [self.gateways]

    def restart(self, child: Child) -> None:
        print(f"{self.name}: {child.name} exited; restarting it", file=sys.stderr)
        self.forget_metrics(child)
        child.restart()

    def forget_metrics(self, child: Child) -> None:
        """Drops a dead gateway's live gauges (requests and tokens in flight) from the shared metrics, which
        would otherwise count its last values for as long as the others serve."""
        if self._metrics_dir is not None and child in self.gateways:
            multiprocess.mark_process_dead(child.process.pid, self._metrics_dir.name)

    def start_gateways(self, config_file: Path, workers: int, api_key: str | None) -> bool:
        """`workers` `bouquet gateway` processes given the config in `config_file` (flags.py's JSON), on one port
        through SO_REUSEPORT; True once all listen."""
        env = dict(os.environ)
        if api_key:
            env["BOUQUET_API_KEY"] = api_key  # not on the command line, where `ps` would show it
        if workers > 1:
            # Each worker writes its metrics here and /metrics sums them, so any worker answers for all.
            self._metrics_dir = tempfile.TemporaryDirectory(prefix="bouquet-metrics-")
            env["PROMETHEUS_MULTIPROC_DIR"] = self._metrics_dir.name
        command = [sys.executable, "-m", "bouquet.cli", "gateway", "--config", str(config_file), *log_level_args()]
        for index in range(workers):
            self.gateways.append(Child(f"gateway{index}", command, env, self._listen_reader))
        return self.wait(lambda: self._listening.acquire(blocking=False), self.gateways, "gateways", workers)

    def _listen_reader(self, line: str) -> None:
        if "bouquet gateway: listening" in line:
            self._listening.release()

    def wait(self, condition: Callable[[], bool], children: list[Child], what: str, times: int = 1) -> bool:
        """Until `condition` has held `times` times; False when a child exits first, on a timeout or a signal."""
        deadline = time.monotonic() + self.ready_timeout
        while times:
            if condition():
                times -= 1
                continue
            if self.stop.wait(0.05):
                return False
            dead = [child.name for child in children if child.process.poll() is not None]
            if dead or time.monotonic() > deadline:
                reason = f"{', '.join(dead)} exited" if dead else f"timed out after {self.ready_timeout} s"
                print(f"{self.name}: error: waiting for {what}: {reason}", file=sys.stderr, flush=True)
                return False
        return True

    def _supervise(self) -> None:
        while not self.stop.wait(0.5):
            for child in [child for group in self.groups() for child in group]:
                if child.process.poll() is not None and not self.stop.is_set():
                    self.restart(child)

    def _drain(self) -> None:
        print(f"{self.name}: draining", file=sys.stderr, flush=True)
        for group in self.groups():
            for child in group:
                child.terminate()
            for child in group:
                child.wait(self.drain_seconds + 10)
        if self._metrics_dir is not None:
            self._metrics_dir.cleanup()
        self.cleanup()

    def cleanup(self) -> None:
        """What a supervisor made for its children, removed once they are gone."""
