"""Triton's real gRPC client (`tritonclient.grpc`, in .venv-oip: `make oip`) against `bouquet gateway --grpc-port`
and a `bouquet replica` of the bundled MiniLM, as processes: the client's messages have bouquet's field names and
numbers (the wire is the same); health, server and model metadata; infer with a BYTES input (the client sends it as
`raw_input_contents`) equal to the REST infer route's rows (cosine 1 within 1e-6), `dimensions` as a request
parameter; each error as the client raises it (status code and message), overload included; `--workers 2`
gateway processes sharing the gRPC port, each answering; and a gateway with `--tls-cert` and `--tls-client-ca`
(openssl's CA) called over mutual TLS, its rows the HTTPS route's."""

from __future__ import annotations

import json
import re
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from conftest import row_cosines
from google.protobuf import descriptor_pb2
from test_replica_tls import make_certificates

from bouquet.gateway.testing import Process, free_port, start_gateway, start_replica, wait_healthy
from bouquet.proto import open_inference_pb2 as pb
from bouquet.proto import open_inference_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.long, pytest.mark.process]

ROOT = Path(__file__).resolve().parents[1]
OIP_PYTHON = ROOT / ".venv-oip" / "bin" / "python"
CLIENT = Path(__file__).with_name("oip_grpc_client.py")
MODEL = "all-MiniLM-L6-v2"  # the replica's directory name, so its Info names the model so
KEY = "oip-key"
TEXTS = ["Packed sequences run without padding.", "Lisbon is mild in December.", "one", "naïve café ☕"]

if not OIP_PYTHON.exists():
    pytest.skip(
        "no .venv-oip: `make oip` installs Triton's gRPC client there (it pins protobuf < 7, so never into .venv)",
        allow_module_level=True,
    )


@pytest.fixture(scope="module")
def replica(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = tmp_path_factory.mktemp("models") / MODEL
    model_dir.symlink_to(minilm_path, target_is_directory=True)
    port = free_port()
    process = start_replica(port, "--model", str(model_dir), "--dtype", "float32")
    try:
        process.wait_ready()
        yield f"127.0.0.1:{port}"
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway(replica: str) -> Iterator[tuple[str, str]]:
    """The HTTP base URL and the gRPC address; one request at a time, so that overload needs no race."""
    port, grpc_port = free_port(), free_port()
    process: Process = start_gateway(
        port, [replica], "--api-key", KEY, "--grpc-port", str(grpc_port), "--max-concurrent-requests", "1"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_ready()
        wait_healthy(url)
        assert any(re.search(rf"Open Inference Protocol \(gRPC\) on 127.0.0.1:{grpc_port}", x) for x in process.lines)
        yield url, f"127.0.0.1:{grpc_port}"
    finally:
        assert process.stop() == 0


def run_client(address: str, mode: str = "calls", tls: dict[str, str] | None = None) -> dict:
    job = {"url": address, "model": MODEL, "key": KEY, "texts": TEXTS, "mode": mode, "tls": tls}
    done = subprocess.run(
        [str(OIP_PYTHON), str(CLIENT)], input=json.dumps(job), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def answer(gateway: tuple[str, str]) -> dict:
    return run_client(gateway[1])


def rest_rows(url: str, context: ssl.SSLContext | None = None, **parameters: object) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}]}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    body |= {"parameters": parameters} if parameters else {}
    request = urllib.request.Request(f"{url}/v2/models/{MODEL}/infer", json.dumps(body).encode(), headers)
    with urllib.request.urlopen(request, timeout=120, context=context) as reply:
        output = json.loads(reply.read())["outputs"][0]
    return np.array(output["data"], np.float32).reshape(output["shape"])


def ours() -> dict[str, list[list[object]]]:
    proto = descriptor_pb2.FileDescriptorProto()
    pb.DESCRIPTOR.CopyToProto(proto)
    found: dict[str, list[list[object]]] = {}

    def walk(messages: object, prefix: str) -> None:
        for message in messages:  # type: ignore[attr-defined]
            found[prefix + message.name] = [
                [f.name, f.number, f.type, f.label, f.type_name.rsplit(".", 1)[-1]] for f in message.field
            ]
            walk(message.nested_type, prefix + message.name + ".")

    walk(proto.message_type, "")
    return found


def test_the_wire_is_tritons(answer: dict) -> None:
    # every message and field bouquet declares is Triton's, by name, number, type and label (Triton has more:
    # calls and fields bouquet does not serve, which the wire skips)
    triton = answer["triton_proto"]
    assert triton["package"] == pb.DESCRIPTOR.package == "inference"
    for message, fields in ours().items():
        assert message in triton["messages"], message
        for field in fields:
            assert field in triton["messages"][message], (message, field)


def test_health_and_metadata(answer: dict) -> None:
    assert answer["live"] and answer["ready"] and answer["model_ready"]
    assert answer["server"]["name"] == "bouquet"
    metadata = answer["metadata"]
    assert (metadata["name"], metadata["versions"], metadata["platform"]) == (MODEL, ["1"], "bouquet")
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": ["-1"]}]  # int64 in JSON: strings
    assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": ["-1", "384"]}]


def test_infer_equals_the_rest_route(answer: dict, gateway: tuple[str, str]) -> None:
    rows, expected = np.array(answer["infer"]["rows"], np.float32), rest_rows(gateway[0])
    assert rows.shape == expected.shape == (len(TEXTS), 384)
    assert np.abs(row_cosines(rows, expected) - 1).max() < 1e-6
    assert (answer["infer"]["model_name"], answer["infer"]["id"]) == (MODEL, "r-1")
    cut = np.array(answer["dimensions"]["rows"], np.float32)
    assert cut.shape == (len(TEXTS), 32)
    assert np.abs(row_cosines(cut, rest_rows(gateway[0], dimensions=32)) - 1).max() < 1e-6


@pytest.mark.parametrize(
    ("case", "status", "message"),
    [
        ("unknown_model", "StatusCode.NOT_FOUND", "no-such-model"),
        ("metadata_of_unknown", "StatusCode.NOT_FOUND", "no-such-model"),
        ("fp32_tensor", "StatusCode.INVALID_ARGUMENT", "the input's datatype must be BYTES (texts), got 'FP32'"),
        ("empty_text", "StatusCode.INVALID_ARGUMENT", "holds an empty text"),
        ("bad_dimensions", "StatusCode.INVALID_ARGUMENT", "dimensions must be between 1 and 384"),
        ("no_key", "StatusCode.UNAUTHENTICATED", "a valid API key is required"),
    ],
)
def test_errors_as_the_client_raises_them(answer: dict, case: str, status: str, message: str) -> None:
    error = answer["errors"][case]
    assert error is not None, f"{case} was answered"
    assert error["status"] == status and message in error["message"], error


def test_workers_share_the_grpc_port(replica: str) -> None:
    # each of --workers 2 gateway processes binds the port (SO_REUSEPORT, as the HTTP one); each connection lands on
    # one of them, and every one answers
    grpc_port = free_port()
    process = start_gateway(free_port(), [replica], "--workers", "2", "--api-key", KEY, "--grpc-port", str(grpc_port))
    try:
        process.wait_ready()
        for _ in range(600):
            if sum("Open Inference Protocol (gRPC) on" in line for line in process.lines) == 2:
                break
            time.sleep(0.1)
        else:
            raise AssertionError("".join(process.lines[-20:]))
        contents = pb.InferTensorContents(bytes_contents=[b"one"])
        tensor = pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[1], contents=contents)
        request = pb.ModelInferRequest(model_name=MODEL, inputs=[tensor])
        for _ in range(8):  # a connection each
            with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                for _ in range(100):  # a worker answers once it has found the replica
                    try:
                        answer = stub.ModelInfer(request, metadata=(("authorization", f"Bearer {KEY}"),), timeout=60)
                        break
                    except grpc.RpcError as error:
                        assert error.code() == grpc.StatusCode.UNAVAILABLE, error.details()
                        time.sleep(0.1)
                assert list(answer.outputs[0].shape) == [1, 384]
    finally:
        assert process.stop() == 0


def test_overload_is_resource_exhausted(gateway: tuple[str, str]) -> None:
    # an HTTP request whose body has not come holds the process's one request slot meanwhile
    host, port = gateway[0].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as held:
        held.sendall(
            f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode()
        )
        error = run_client(gateway[1], "overload")["overload"]
    assert error is not None and error["status"] == "StatusCode.RESOURCE_EXHAUSTED", error
    assert "its limit" in error["message"]


def test_tritons_client_over_mutual_tls(replica: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    # `bouquet gateway` with a server certificate for 127.0.0.1 and a client CA: HTTPS on --port, TLS on --grpc-port
    certs = make_certificates(tmp_path_factory.mktemp("gateway-tls"))
    port, grpc_port = free_port(), free_port()
    tls_args = ["--tls-cert", str(certs / "replica.pem"), "--tls-key", str(certs / "replica.key"),
                "--tls-client-ca", str(certs / "ca.pem")]  # fmt: skip
    process = start_gateway(port, [replica], "--api-key", KEY, "--grpc-port", str(grpc_port), *tls_args)
    context = ssl.create_default_context(cafile=certs / "ca.pem")
    context.load_cert_chain(certs / "gateway.pem", certs / "gateway.key")
    url = f"https://127.0.0.1:{port}"
    try:
        process.wait_ready()
        assert any(f"listening on {url}" in line for line in process.lines)
        for _ in range(600):  # until the gateway has the replica's model
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=5, context=context):
                    break
            except urllib.error.HTTPError:
                time.sleep(0.1)
        assert any(f"(gRPC over TLS) on 127.0.0.1:{grpc_port}" in line for line in process.lines)
        tls = {"ca": str(certs / "ca.pem"), "cert": str(certs / "gateway.pem"), "key": str(certs / "gateway.key")}
        found = run_client(f"127.0.0.1:{grpc_port}", "tls", tls)
        assert found["ready"] and found["model_ready"]
        rows = np.array(found["infer"]["rows"], np.float32)
        assert np.abs(row_cosines(rows, rest_rows(url, context)) - 1).max() < 1e-6
    finally:
        assert process.stop() == 0
