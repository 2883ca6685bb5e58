"""TLS to replicas found by DNS, across hosts (network namespaces, tests/netns.py; a real DNS server on the
gateway's host, tests/dns_zone_server.py; a CA made by openssl): both replicas present one certificate for the
Service's name and none of their addresses, as a certificate for a headless Service does. A gateway given
`--replica-tls-server-name` checks that name on each address the name resolves to and computes on both; one
without it checks the address, is refused by every replica, and says why in its log and /health. Marked `long`;
skipped where network namespaces cannot be made or openssl is missing."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import corpus
import pytest
from netns import Cluster, netns_available
from test_fault_dns import _dns_server
from test_fault_partition import scrape
from test_gateway_replicas import embed, healthy_replicas, wait_for
from test_replica_tls import _health, make_certificates

from bouquet.gateway.testing import Process, start_gateway, start_replica, wait_healthy

pytestmark = [
    pytest.mark.long,
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]
NAME = "replica.bouquet.test"  # the name make_certificates' "named" certificate carries, and nothing else
REPLICA_PORT = 50051
NAMED_PORT, BY_ADDRESS_PORT = 8000, 8001


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    available, reason = netns_available()
    if not available:
        pytest.skip(reason)
    with Cluster(["gw", "r1", "r2"]) as cluster:
        yield cluster


def test_a_name_certificate_serves_replicas_found_by_dns_only_with_the_server_name(
    cluster: Cluster, tmp_path: Path
) -> None:
    (tmp_path / "tls").mkdir()
    c = make_certificates(tmp_path / "tls")
    r1, r2, gw = cluster["r1"], cluster["r2"], cluster["gw"]
    zone = tmp_path / "zone.json"
    zone.write_text(json.dumps({NAME: [r1.address, r2.address]}))
    dns = _dns_server(cluster, zone)
    processes: list[Process] = []
    try:
        tls = ("--tls-cert", str(c / "named.pem"), "--tls-key", str(c / "named.key"))
        for host in (r1, r2):
            processes.append(start_replica(REPLICA_PORT, "--dtype", "float32", *tls, host=host.address,
                                           prefix=host.prefix))  # fmt: skip
        common = ("--replicas-dns", f"{NAME}:{REPLICA_PORT}", "--host", gw.address, "--chunk-tokens", "128",
                  "--replica-tls-ca", str(c / "ca.pem"))  # fmt: skip
        named = start_gateway(NAMED_PORT, [], *common, "--replica-tls-server-name", NAME, prefix=gw.prefix)
        by_address = start_gateway(BY_ADDRESS_PORT, [], *common, prefix=gw.prefix)
        processes += [named, by_address]
        for process in processes:
            process.wait_ready()
        url = f"http://{gw.forward(NAMED_PORT)}"
        try:
            wait_healthy(url)
        except TimeoutError as error:
            raise AssertionError("".join(named.lines[-20:])) from error
        wait_for(lambda: healthy_replicas(url) == 2, timeout=30)
        for _ in range(4):  # several chunks a request: least outstanding tokens gives both replicas some
            assert embed(url, corpus.documents(6))[0] == 200
        gateway = url.removeprefix("http://")
        for host in (r1, r2):
            computed = scrape(gateway, "bouquet_gateway_replica_tokens_total", f'replica="{host.addr(REPLICA_PORT)}"')
            assert computed > 0, host

        refused = f"http://{gw.forward(BY_ADDRESS_PORT)}"
        assert embed(refused, ["by address"])[0] == 503
        status, body = _health(refused)
        assert status == 503, body
        for host in (r1, r2):
            assert f"{host.addr(REPLICA_PORT)}: " in body, body
        assert "TLS handshake failed" in body and "--replica-tls-server-name" in body, body
        marker = "cannot be used: "
        said = [line for line in by_address.lines if marker in line and "WARNING" in line]
        assert {host.addr(REPLICA_PORT) for host in (r1, r2)} <= _addresses(said), said
    finally:
        dns.kill()
        for process in reversed(processes):
            process.stop()


def _addresses(lines: list[str]) -> set[str]:
    """The replica addresses the gateway's 'replica A cannot be used' warnings name."""
    return {line.split("replica ", 1)[1].split(" cannot be used", 1)[0] for line in lines}
