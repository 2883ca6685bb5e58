"""`bouquet gateway --replicas-dns NAME:PORT` on hosts of their own (network namespaces, tests/netns.py) with a
real DNS server on the gateway's host (tests/dns_zone_server.py): under load, a replica added to NAME's records
joins and takes work, one removed gets no new work and no request fails, and when DNS stops answering the gateway
keeps the replicas it has (the failures counted in /metrics). Marked `fault`; skipped where network namespaces
cannot be made."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import corpus
import pytest
from netns import Cluster, netns_available
from test_fault_partition import Load, scrape, served
from test_gateway_replicas import healthy_replicas, wait_for

from bouquet.gateway.testing import Process, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.process, pytest.mark.long]  # CI's long tier
NAME = "replicas.bouquet.test"
REPLICA_PORT = 50051
METRICS_PORT = 9100
GATEWAY_PORT = 8000
DNS_INTERVAL = 0.5


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    available, reason = netns_available()
    if not available:
        pytest.skip(reason)
    with Cluster(["gw", "r1", "r2"]) as cluster:
        yield cluster


def _zone(path: Path, *addresses: str) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({NAME: list(addresses)}))
    temporary.replace(path)  # the server never reads half a file


def _dns_server(cluster: Cluster, zone: Path) -> subprocess.Popen[str]:
    gw = cluster["gw"]
    gw.write_etc("resolv.conf", "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n")
    script = Path(__file__).with_name("dns_zone_server.py")
    server = gw.popen([sys.executable, str(script), str(zone)], stderr=subprocess.PIPE, text=True)
    assert server.stderr is not None and "dns ready" in server.stderr.readline()
    return server


def test_replicas_follow_dns_join_leave_and_survive_its_failure(cluster: Cluster, tmp_path: Path):
    r1, r2 = cluster["r1"], cluster["r2"]
    zone = tmp_path / "zone.json"
    _zone(zone, r1.address)
    dns = _dns_server(cluster, zone)
    processes: list[Process] = []
    try:
        for host in (r1, r2):
            args = ("--dtype", "float32", "--max-batch-tokens", "512", "--metrics-port", str(METRICS_PORT))
            processes.append(start_replica(REPLICA_PORT, *args, host=host.address, prefix=host.prefix))
        gw = cluster["gw"]
        dns_args = ("--replicas-dns", f"{NAME}:{REPLICA_PORT}", "--dns-interval", str(DNS_INTERVAL))
        processes.append(start_gateway(GATEWAY_PORT, [], *dns_args, "--host", gw.address, prefix=gw.prefix))
        for process in processes:
            process.wait_ready()
        url = f"http://{gw.forward(GATEWAY_PORT)}"
        wait_healthy(url)
        metrics = {host.name: host.forward(METRICS_PORT) for host in (r1, r2)}
        assert healthy_replicas(url) == 1
        with Load(url, corpus.queries(4), clients=4) as load:
            time.sleep(1)
            assert served(r2, metrics) == 0
            _zone(zone, r1.address, r2.address)  # a replica joins
            wait_for(lambda: healthy_replicas(url) == 2, timeout=15)
            wait_for(lambda: served(r2, metrics) > 10, timeout=15)
            _zone(zone, r2.address)  # one leaves: no new work, nothing lost
            wait_for(lambda: healthy_replicas(url) == 1, timeout=15)
            time.sleep(1)  # calls already sent finish
            left_at = served(r1, metrics)
            time.sleep(2)
            assert served(r1, metrics) == left_at
            dns.kill()  # DNS stops answering: the replicas found stay
            gateway_metrics = url.removeprefix("http://")
            name = f'name="{NAME}:{REPLICA_PORT}"'
            wait_for(lambda: scrape(gateway_metrics, "bouquet_gateway_dns_failures_total", name) >= 2, timeout=20)
            assert healthy_replicas(url) == 1
            before = served(r2, metrics)
            wait_for(lambda: served(r2, metrics) > before + 10, timeout=15)
        print(f"dns: {load.summary()}")
        assert load.failures() == [] and len(load.results) > 50
    finally:
        dns.kill()
        for process in reversed(processes):
            process.stop()
