"""TLS between a gateway and a replica on another host, as processes: certificates made by openssl in the test (a
CA, the replica's for 127.0.0.1, a gateway's client certificate). A gateway that trusts the CA and presents its
certificate is served; one without a client certificate, or speaking plaintext, never reaches the replica."""

from __future__ import annotations

import http.client
import json
import shutil
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bouquet.gateway.testing import Process, free_port, start_gateway, start_replica

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


def _signed(directory: Path, name: str, extensions: str) -> tuple[Path, Path]:
    key, request, cert, ext = (directory / f"{name}.{suffix}" for suffix in ("key", "csr", "pem", "ext"))
    ext.write_text(extensions)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", key,
             "-out", request, "-subj", f"/CN={name}")  # fmt: skip
    _openssl("x509", "-req", "-in", request, "-CA", directory / "ca.pem", "-CAkey", directory / "ca.key",
             "-CAcreateserial", "-out", cert, "-days", "1", "-extfile", ext)  # fmt: skip
    return cert, key


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("tls"))


def make_certificates(directory: Path) -> Path:
    """A CA, and certificates it signed: a replica's for 127.0.0.1, a gateway's client one, one for a name."""
    ca_key, ca = directory / "ca.key", directory / "ca.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test-ca")  # fmt: skip
    _signed(directory, "replica", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _signed(directory, "gateway", "extendedKeyUsage=clientAuth\n")
    _signed(directory, "named", "subjectAltName=DNS:replica.bouquet.test\nextendedKeyUsage=serverAuth\n")
    return directory


def _embed(url: str) -> int:
    data = json.dumps({"input": ["over TLS"]}).encode()
    request = urllib.request.Request(f"{url}/v1/embeddings", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert len(json.loads(reply.read())["data"][0]["embedding"]) == 384
            return reply.status
    except urllib.error.HTTPError as error:
        return error.code


def _status_after(url: str, seconds: float) -> int:
    """The embedding status once the gateway has had `seconds` to reach the replica (200 as soon as it has)."""
    deadline = time.monotonic() + seconds
    while (status := _embed(url)) != 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    return status


def _health(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=10) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _ready_urls(gateways: dict[str, Process]) -> dict[str, str]:
    """Each gateway's URL, once it listens."""
    urls = {}
    for name, gateway in gateways.items():
        gateway.wait_ready()
        urls[name] = f"http://127.0.0.1:{gateway.process.args[gateway.process.args.index('--port') + 1]}"
    return urls


def _with_token(token: str) -> list[str]:
    return ["env", f"BOUQUET_REPLICA_TOKEN={token}"]  # a secret goes by environment, never argv


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_mutual_tls_serves_the_gateway_with_a_certificate_and_no_other(certificates: Path) -> None:
    """Also: a gateway that cannot use its replica says why, once, at the default log level, and in /health's 503
    (before, a wrong token or a TLS mismatch left only 503s and a silent log)."""
    c = certificates
    port = free_port()
    replica = start_replica(
        port, "--dtype", "float32", "--tls-cert", str(c / "replica.pem"), "--tls-key", str(c / "replica.key"),
        "--tls-client-ca", str(c / "ca.pem"), prefix=_with_token("right"),
    )  # fmt: skip
    trusted = ["--replica-tls-ca", str(c / "ca.pem")]
    client = ["--replica-tls-cert", str(c / "gateway.pem"), "--replica-tls-key", str(c / "gateway.key")]
    address = f"127.0.0.1:{port}"
    often = ["--probe-interval", "0.1"]  # the failing ones retry ten times a second: each cause is still said once
    gateways = {
        "mutual": start_gateway(free_port(), [address], *trusted, *client, prefix=_with_token("right")),
        "wrong token": start_gateway(free_port(), [address], *trusted, *client, *often, prefix=_with_token("wrong")),
        "no client certificate": start_gateway(free_port(), [address], *trusted, *often, prefix=_with_token("right")),
        "plaintext": start_gateway(free_port(), [address], *often, prefix=_with_token("right")),
    }
    try:
        replica.wait_ready()
        urls = _ready_urls(gateways)
        assert _status_after(urls["mutual"], 30) == 200
        for name in ("wrong token", "no client certificate", "plaintext"):
            assert _status_after(urls[name], 3) == 503, name
            time.sleep(0.5)  # five probe intervals: the cause is said once, however often it is seen
            status, body = _health(urls[name])
            assert status == 503 and f"{address}: " in body, (name, body)
            marker = f"replica {address} cannot be used: "
            causes = [line.split(marker, 1)[1].strip() for line in gateways[name].lines if marker in line]
            assert causes and len(causes) == len(set(causes)), (name, causes)
        assert "token" in _health(urls["wrong token"])[1]
    finally:
        for gateway in gateways.values():
            gateway.stop()
        replica.stop()


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_a_certificate_for_a_name_and_metrics_over_https(certificates: Path) -> None:
    """Replicas found by DNS are dialled by their pods' addresses, while their certificates carry a name: with
    --replica-tls-server-name the gateway checks that name (served), without it the address (refused, and said
    why). The replica's metrics port serves HTTPS with the same certificate: no plain HTTP beside TLS gRPC."""
    c = certificates
    port, metrics_port = free_port(), free_port()
    replica = start_replica(
        port, "--dtype", "float32", "--tls-cert", str(c / "named.pem"), "--tls-key", str(c / "named.key"),
        "--metrics-port", str(metrics_port), prefix=_with_token("right"),
    )  # fmt: skip
    address, trusted = f"127.0.0.1:{port}", ["--replica-tls-ca", str(c / "ca.pem")]
    named = ["--replica-tls-server-name", "replica.bouquet.test"]
    gateways = {
        "named": start_gateway(free_port(), [address], *trusted, *named, prefix=_with_token("right")),
        "by address": start_gateway(free_port(), [address], *trusted, prefix=_with_token("right")),
    }
    try:
        replica.wait_ready()
        urls = _ready_urls(gateways)
        assert _status_after(urls["named"], 30) == 200
        assert _status_after(urls["by address"], 3) == 503
        status, body = _health(urls["by address"])
        assert status == 503 and "TLS handshake failed" in body and "--replica-tls-server-name" in body, body
        context = ssl.create_default_context(cafile=str(c / "ca.pem"))
        context.check_hostname = False  # dialled by address, as Prometheus scrapes a pod; the chain is still verified
        with urllib.request.urlopen(f"https://127.0.0.1:{metrics_port}/metrics", context=context, timeout=10) as reply:
            assert reply.status == 200 and b"bouquet_" in reply.read()
        with pytest.raises((urllib.error.URLError, ConnectionError, http.client.HTTPException)):
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    finally:
        for gateway in gateways.values():
            gateway.stop()
        replica.stop()


def test_a_certificate_without_its_key_is_refused_at_start() -> None:
    from bouquet.config import GatewayConfig, ReplicaConfig

    with pytest.raises(ValueError, match="together"):
        ReplicaConfig(tls_cert=Path("cert.pem"))
    with pytest.raises(ValueError, match="needs --replica-tls-ca"):
        GatewayConfig(replicas=("a:1",), replica_tls_cert=Path("c.pem"), replica_tls_key=Path("k.pem"))


@pytest.mark.parametrize("listen", ["127.0.0.1:0", "127.0.0.2:50051", "localhost:50051", "[::1]:50051", "unix:/r.sock"])
def test_a_replica_on_loopback_needs_no_token(listen: str) -> None:
    from bouquet.config import ReplicaConfig

    assert ReplicaConfig(listen=listen).token is None


def test_a_replica_beyond_loopback_without_a_token_is_refused_unless_insecure() -> None:
    from bouquet.config import ReplicaConfig

    for listen in ("0.0.0.0:50051", "10.0.0.7:50051", "[::]:50051"):
        with pytest.raises(ValueError, match=r"\$BOUQUET_REPLICA_TOKEN.*--insecure"):
            ReplicaConfig(listen=listen)
        assert ReplicaConfig(listen=listen, token="secret").token == "secret"
        assert ReplicaConfig(listen=listen, insecure=True).insecure


@pytest.mark.process
def test_the_refusal_is_one_line_at_start_not_a_traceback() -> None:
    import os
    import sys

    env = {k: v for k, v in os.environ.items() if k != "BOUQUET_REPLICA_TOKEN"}
    command = [sys.executable, "-m", "bouquet.cli", "replica", "--listen", "0.0.0.0:0", "--device", "cpu"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "--insecure" in result.stderr, result.stderr
