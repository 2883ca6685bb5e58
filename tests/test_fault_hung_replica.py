"""A replica that hangs (SIGSTOP: the process is there, its socket open, nothing answers) behind a gateway with a
second, healthy one, under 8 concurrent clients: no request fails, and none waits more than 3 s, or, on a machine
whose own requests are slower, more than the bound the run's own requests give (below). Marked `long`: it runs for
about half a minute; CI's long tier runs it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import corpus
import pytest
from test_fault_partition import Load, latency_bound, marked_down, phases
from test_gateway_replicas import healthy_replicas, wait_for

from bouquet.gateway.testing import free_port, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.process, pytest.mark.long]  # half a minute: CI's long tier
HANG_SECONDS = 20
WARM_SECONDS = 2


@pytest.mark.parametrize("transport", ["tcp", "lane"])
def test_a_hung_replica_is_routed_around(transport: str, tmp_path: Path):
    """On TCP the gateway's calls go by gRPC; on Unix sockets by the replicas' local lanes, which a hung replica
    keeps open: its calls there end when gRPC's pings find the replica gone and the gateway closes the lane."""
    ports = [free_port(), free_port()]
    addresses = [f"127.0.0.1:{port}" if transport == "tcp" else f"unix:{tmp_path}/r{port}.sock" for port in ports]
    replicas = [
        start_replica(port, "--dtype", "float32", "--max-batch-tokens", "512", listen=address)
        for port, address in zip(ports, addresses, strict=True)
    ]
    gateway_port = free_port()
    gateway = start_gateway(gateway_port, addresses, "--chunk-tokens", "128", "--log-level", "INFO")
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        for process in (*replicas, gateway):
            process.wait_ready()
        wait_healthy(url)
        wait_for(lambda: healthy_replicas(url) == 2)
        with Load(url, corpus.documents(6)) as load:
            time.sleep(WARM_SECONDS)
            hung_at = time.monotonic()
            os.kill(replicas[0].process.pid, signal.SIGSTOP)
            time.sleep(HANG_SECONDS)
            os.kill(replicas[0].process.pid, signal.SIGCONT)
            woke_at = time.monotonic()
            wait_for(lambda: healthy_replicas(url) == 2, timeout=30)  # it rejoins once it answers again
    finally:
        os.kill(replicas[0].process.pid, signal.SIGCONT)
        for process in (gateway, *replicas):
            process.stop()
    bound, how = latency_bound(load)
    left = marked_down(gateway, addresses[1])
    print(
        f"hung replica: {load.summary()}; {phases(load, hung_at, woke_at, 'hang')}; bound {bound:.2f} s ({how}); "
        f"the replica left {left}"
    )
    assert load.failures() == [] and len(load.results) > 50, load.summary()
    lanes = sum("Embed calls on its local lane" in line for line in gateway.lines)
    assert lanes >= (2 if transport == "lane" else 0) and (lanes == 0) == (transport == "tcp")
    assert load.latencies()[-1] <= bound < HANG_SECONDS, load.slowest(hung_at)
