"""A replica that hangs (SIGSTOP: the process is there, its socket open, nothing answers) behind a gateway with a
second, healthy one, under 8 concurrent clients: no request fails, and none waits more than 3 s. Marked `fault`: it
runs for about half a minute; CI runs it (`make test` includes the fault suite)."""

from __future__ import annotations

import os
import signal
import statistics
import threading
import time

import corpus
import pytest
from test_gateway_replicas import embed, healthy_replicas, wait_for

from bouquet.gateway.testing import free_port, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.process, pytest.mark.long]  # half a minute: CI's long tier
HANG_SECONDS = 20


def test_a_hung_replica_is_routed_around():
    ports = [free_port(), free_port()]
    replicas = [start_replica(port, "--dtype", "float32", "--max-batch-tokens", "512") for port in ports]
    gateway_port = free_port()
    gateway = start_gateway(gateway_port, [f"127.0.0.1:{port}" for port in ports], "--chunk-tokens", "128")
    url = f"http://127.0.0.1:{gateway_port}"
    texts = corpus.documents(6)
    latencies: list[float] = []
    failures: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            started = time.monotonic()
            status, _ = embed(url, texts)
            latencies.append(time.monotonic() - started)
            if status != 200:
                failures.append(status)

    try:
        for process in (*replicas, gateway):
            process.wait_ready()
        wait_healthy(url)
        wait_for(lambda: healthy_replicas(url) == 2)
        clients = [threading.Thread(target=client) for _ in range(8)]
        for thread in clients:
            thread.start()
        time.sleep(2)
        os.kill(replicas[0].process.pid, signal.SIGSTOP)
        time.sleep(HANG_SECONDS)
        os.kill(replicas[0].process.pid, signal.SIGCONT)
        wait_for(lambda: healthy_replicas(url) == 2, timeout=30)  # it rejoins once it answers again
        stop.set()
        for thread in clients:
            thread.join(timeout=120)
    finally:
        stop.set()
        os.kill(replicas[0].process.pid, signal.SIGCONT)
        for process in (gateway, *replicas):
            process.stop()
    print(f"hung replica: {len(latencies)} requests, {len(failures)} failed, max latency {max(latencies):.2f} s")
    assert failures == [] and len(latencies) > 50
    # A request caught on the hung replica is moved once a keepalive ping goes unanswered (1-2 s) and keeps its place
    # in line at the other: 1.7-2.2 s on Zen 5, never the hang's 20 s. The bound allows for a slower machine's own
    # request time (4.1 s max against a 1.6 s median under AVX2 emulation on a slow VM).
    typical = statistics.median(latencies)
    assert max(latencies) <= max(3.0, 2.0 + 2 * typical) < HANG_SECONDS, (typical, sorted(latencies)[-5:])
