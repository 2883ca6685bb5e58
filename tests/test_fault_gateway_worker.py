"""A gateway worker killed (SIGKILL) under load, measured as issue 27 asks: what it costs, and what a client must do.
`bouquet gateway --workers 2` shares one port between two processes (SO_REUSEPORT); the kernel hands each new
connection to a live one, and the supervisor restarts the dead one. What the dead worker held in flight is lost
with its process: those clients see their connection reset, and no 503 can be sent from a dead process. So the
client must retry, and the real `openai` client does by default (a connection error is retried, `max_retries` 2):
through it, no request is lost. Counted twice: raw HTTP clients without retries (the loss is at most the requests in
flight on the killed worker) and the openai client with its defaults (none lost). Marked long: CI runs it."""

from __future__ import annotations

import http.client
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import corpus
import openai
import pytest
from test_gateway_process import API_KEY, MODEL, linked_copy

from bouquet.gateway.testing import free_port, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.long, pytest.mark.process]
CLIENTS = 6
SECONDS_AFTER_KILL = 4.0
TEXTS = corpus.documents(8)


@pytest.fixture(scope="module")
def gateway(minilm_path, tmp_path_factory) -> Iterator[tuple[str, int]]:
    model_dir = linked_copy(minilm_path, tmp_path_factory.mktemp("models") / MODEL)
    replica_port, port = free_port(), free_port()
    replica = start_replica(replica_port, "--model", str(model_dir), "--dtype", "float32")
    # The replica serves before the gateway starts: a worker that met it still loading would answer 503 until its
    # next health probe while its sibling already served (each learns on its own schedule), and those start-up 503s
    # are not what a worker's death costs.
    replica.wait_ready()
    parent = start_gateway(port, [f"127.0.0.1:{replica_port}"], "--workers", "2", "--api-key", API_KEY)
    try:
        parent.wait_ready()
        wait_healthy(f"http://127.0.0.1:{port}")
        yield f"http://127.0.0.1:{port}", parent.process.pid
    finally:
        parent.stop()
        replica.stop()


class Load:
    """Clients posting TEXTS in a loop until stopped; each outcome counted."""

    def __init__(self, call) -> None:
        self.call = call
        self.stop = threading.Event()
        self.ok = 0
        self.failed: list[str] = []
        self._lock = threading.Lock()

    def client(self) -> None:
        while not self.stop.is_set():
            try:
                self.call()
                outcome = None
            except Exception as error:  # the client's own error type, whatever the library: counted, not raised
                outcome = f"{type(error).__name__}: {error}"[:200]
            with self._lock:
                if outcome is None:
                    self.ok += 1
                else:
                    self.failed.append(outcome)


def _kill_a_worker_under(load: Load, parent_pid: int) -> None:
    threads = [threading.Thread(target=load.client, daemon=True) for _ in range(CLIENTS)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while load.ok < 2 * CLIENTS:
        assert time.monotonic() < deadline, f"no load got through: {load.failed[:3]}"
        time.sleep(0.05)
    assert _wait_for_restart(parent_pid), "the supervisor did not hold two workers"
    workers = [int(c.split()[0]) for c in _worker_pids(parent_pid)]
    os.kill(workers[0], signal.SIGKILL)
    served_before = load.ok
    time.sleep(SECONDS_AFTER_KILL)
    load.stop.set()
    for thread in threads:
        thread.join(timeout=120)
    assert load.ok > served_before, "nothing was served after the kill: the sibling took no connection"


def _worker_pids(parent_pid: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            command = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == parent_pid and "bouquet.cli gateway" in command:
            found.append(f"{stat.parent.name} {command}")
    return found


def test_raw_clients_lose_at_most_what_the_killed_worker_held(gateway: tuple[str, int]) -> None:
    url, parent_pid = gateway
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"input": TEXTS, "model": MODEL})
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}

    def call() -> None:  # a new connection each time: no retry, as a bare client does
        connection = http.client.HTTPConnection(host, int(port), timeout=60)
        try:
            connection.request("POST", "/v1/embeddings", body, headers)
            reply = connection.getresponse()
            reply.read()
            assert reply.status == 200, reply.status
        finally:
            connection.close()

    load = Load(call)
    _kill_a_worker_under(load, parent_pid)
    print(f"raw clients: {load.ok} answered, {len(load.failed)} lost with the killed worker: {load.failed[:3]}")
    assert len(load.failed) <= CLIENTS  # at most one request in flight per client was on the dead worker
    assert _wait_for_restart(parent_pid), "the killed worker was not restarted"


def test_the_openai_client_with_its_default_retries_loses_nothing(gateway: tuple[str, int]) -> None:
    url, parent_pid = gateway
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=60)  # max_retries: its default, 2

    def call() -> None:
        assert len(client.embeddings.create(model=MODEL, input=TEXTS).data) == len(TEXTS)

    load = Load(call)
    _kill_a_worker_under(load, parent_pid)
    print(f"openai client: {load.ok} answered, {len(load.failed)} failed")
    assert load.failed == []


def _wait_for_restart(parent_pid: int) -> bool:
    """Whether the supervisor holds two workers again within a minute."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if len(_worker_pids(parent_pid)) == 2:
            return True
        time.sleep(0.2)
    return False
