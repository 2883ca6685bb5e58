"""TLS between a gateway and a replica on another host, as processes: certificates made by openssl in the test (a
CA, the replica's for 127.0.0.1, a gateway's client certificate). A gateway that trusts the CA and presents its
certificate is served; one without a client certificate, or speaking plaintext, never reaches the replica."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from bouquet.gateway.testing import free_port, start_gateway, start_replica

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
    directory = tmp_path_factory.mktemp("tls")
    ca_key, ca = directory / "ca.key", directory / "ca.pem"
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", ca_key, "-out", ca, "-days", "1", "-subj", "/CN=test-ca")  # fmt: skip
    _signed(directory, "replica", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    _signed(directory, "gateway", "extendedKeyUsage=clientAuth\n")
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


@pytest.mark.process
def test_mutual_tls_serves_the_gateway_with_a_certificate_and_no_other(certificates: Path) -> None:
    c = certificates
    port = free_port()
    replica = start_replica(
        port, "--dtype", "float32", "--tls-cert", str(c / "replica.pem"), "--tls-key", str(c / "replica.key"),
        "--tls-client-ca", str(c / "ca.pem"),
    )  # fmt: skip
    trusted = ["--replica-tls-ca", str(c / "ca.pem")]
    client = ["--replica-tls-cert", str(c / "gateway.pem"), "--replica-tls-key", str(c / "gateway.key")]
    gateways = {
        "mutual": start_gateway(free_port(), [f"127.0.0.1:{port}"], *trusted, *client),
        "no client certificate": start_gateway(free_port(), [f"127.0.0.1:{port}"], *trusted),
        "plaintext": start_gateway(free_port(), [f"127.0.0.1:{port}"]),
    }
    try:
        replica.wait_ready()
        urls = {}
        for name, gateway in gateways.items():
            gateway.wait_ready()
            urls[name] = f"http://127.0.0.1:{gateway.process.args[gateway.process.args.index('--port') + 1]}"
        assert _status_after(urls["mutual"], 30) == 200
        assert _status_after(urls["no client certificate"], 3) == 503
        assert _status_after(urls["plaintext"], 3) == 503
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
