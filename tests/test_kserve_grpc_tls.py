"""The gateway's own TLS (--tls-cert, --tls-key, --tls-client-ca) on both of its ports, in process (tests/in_process.py,
the bundled MiniLM): certificates made by openssl (test_replica_tls's CA, a server certificate for 127.0.0.1 and a
client one); the Open Inference Protocol through a real gRPC secure channel and its REST twin over HTTPS give the same
rows; a plaintext client, and under mutual TLS a client without a certificate, never reach either."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from in_process import Served, served
from test_kserve_grpc import MODEL, TEXTS, infer_request, rows_of
from test_replica_tls import make_certificates

from bouquet.config import GatewayConfig
from bouquet.engine.engine import Engine
from bouquet.proto import open_inference_pb2 as pb
from bouquet.proto import open_inference_pb2_grpc as pb_grpc

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")

# make_certificates' names: "replica" is a server certificate for 127.0.0.1 (here the gateway's), "gateway" a client's
SERVER, CLIENT = "replica", "gateway"


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("gateway-tls"))


def tls_options(certificates: Path, mutual: bool) -> dict[str, Path]:
    options = {"tls_cert": certificates / f"{SERVER}.pem", "tls_key": certificates / f"{SERVER}.key"}
    return {**options, "tls_client_ca": certificates / "ca.pem"} if mutual else options


@pytest.fixture(scope="module")
def mutual(certificates: Path, minilm_path: Path, minilm_fp32: Engine) -> Iterator[Served]:
    options = tls_options(certificates, mutual=True)
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, grpc_port=0, **options) as running:
        yield running


def grpc_address(running: Served) -> str:
    assert running.app is not None
    return f"127.0.0.1:{running.app.state.grpc_port}"


def channel_credentials(certificates: Path, with_certificate: bool = True) -> grpc.ChannelCredentials:
    if not with_certificate:
        return grpc.ssl_channel_credentials((certificates / "ca.pem").read_bytes())
    return grpc.ssl_channel_credentials(
        (certificates / "ca.pem").read_bytes(),
        private_key=(certificates / f"{CLIENT}.key").read_bytes(),
        certificate_chain=(certificates / f"{CLIENT}.pem").read_bytes(),
    )


def https_context(certificates: Path, with_certificate: bool = True) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=certificates / "ca.pem")
    if with_certificate:
        context.load_cert_chain(certificates / f"{CLIENT}.pem", certificates / f"{CLIENT}.key")
    return context


def rest_rows(url: str, context: ssl.SSLContext) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}]}
    with httpx.Client(verify=context, timeout=60) as client:
        answer = client.post(f"{url}/v2/models/{MODEL}/infer", json=body)
    assert answer.status_code == 200, answer.text
    output = answer.json()["outputs"][0]
    return np.array(output["data"], np.float32).reshape(output["shape"])


def grpc_rows(address: str, credentials: grpc.ChannelCredentials) -> np.ndarray:
    with grpc.secure_channel(address, credentials) as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
        return rows_of(stub.ModelInfer(infer_request(TEXTS), timeout=60))


def refused(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.RpcError:
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    with channel, pytest.raises(grpc.RpcError) as caught:
        pb_grpc.GRPCInferenceServiceStub(channel).ServerLive(pb.ServerLiveRequest(), timeout=10)
    return caught.value


def test_mutual_tls_rows_equal_the_rest_routes_over_https(mutual: Served, certificates: Path) -> None:
    assert mutual.url.startswith("https://")
    rows = grpc_rows(grpc_address(mutual), channel_credentials(certificates))
    assert rows.shape == (len(TEXTS), 384)
    np.testing.assert_array_equal(rows, rest_rows(mutual.url, https_context(certificates)))


def test_mutual_tls_refuses_plaintext_and_clients_without_a_certificate(mutual: Served, certificates: Path) -> None:
    address = grpc_address(mutual)
    for credentials in (None, channel_credentials(certificates, with_certificate=False)):
        assert refused(address, credentials).code() == grpc.StatusCode.UNAVAILABLE
    plain = mutual.url.replace("https://", "http://")
    with httpx.Client(timeout=10) as client, pytest.raises(httpx.TransportError):
        client.get(f"{plain}/v2/health/live")
    without = https_context(certificates, with_certificate=False)
    with httpx.Client(verify=without, timeout=10) as client, pytest.raises(httpx.TransportError):
        client.get(f"{mutual.url}/v2/health/live")


def test_tls_without_a_client_ca_serves_any_client_that_trusts_it(
    certificates: Path, minilm_path: Path, minilm_fp32: Engine
) -> None:
    options = tls_options(certificates, mutual=False)
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, grpc_port=0, **options) as running:
        address = grpc_address(running)
        rows = grpc_rows(address, channel_credentials(certificates, with_certificate=False))
        np.testing.assert_array_equal(rows, rest_rows(running.url, https_context(certificates, False)))
        assert refused(address, None).code() == grpc.StatusCode.UNAVAILABLE


def test_a_certificate_needs_its_key_and_a_client_ca_needs_both(certificates: Path) -> None:
    cert, key, ca = (certificates / name for name in (f"{SERVER}.pem", f"{SERVER}.key", "ca.pem"))
    with pytest.raises(ValueError, match="certificate and its key together"):
        GatewayConfig(replicas=("127.0.0.1:9",), tls_cert=cert)
    with pytest.raises(ValueError, match="mutual TLS is TLS first"):
        GatewayConfig(replicas=("127.0.0.1:9",), tls_client_ca=ca)
    assert GatewayConfig(replicas=("127.0.0.1:9",), tls_cert=cert, tls_key=key, tls_client_ca=ca).tls_client_ca == ca
