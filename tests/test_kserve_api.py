"""KServe's Open Inference Protocol (v2) through Triton's real HTTP client (`tritonclient.http`) against the
gateway's own HTTP server and real replicas in this process (tests/in_process.py; the bundled MiniLM): health,
server and model metadata, and infer with the texts as a BYTES tensor in JSON and in the binary tensor data
extension (the client's default), answered as JSON and as binary; the rows match sentence-transformers'. Bad
requests get the protocol's `{"error"}` body with a 4xx, which the client raises."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.http as triton
from conftest import row_cosines
from in_process import served
from tritonclient.utils import InferenceServerException

from bouquet.engine.engine import Engine

MODEL = "all-MiniLM-L6-v2"
TEXTS = ["Packed sequences run without padding.", "The weather in Lisbon is mild in December.", "one"]


@pytest.fixture(scope="module")
def url(minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, api_key="oip-key") as running:
        yield running.url


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[triton.InferenceServerClient]:
    client = triton.InferenceServerClient(url.removeprefix("http://"), connection_timeout=60, network_timeout=60)
    yield client
    client.close()


HEADERS = {"Authorization": "Bearer oip-key"}  # copied for each call: the client adds its own headers to the dict given


@pytest.fixture(scope="module")
def expected(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)


def _infer(client: triton.InferenceServerClient, binary_in: bool, binary_out: bool) -> np.ndarray:
    tensor = triton.InferInput("text", [len(TEXTS)], "BYTES")
    tensor.set_data_from_numpy(np.array(TEXTS, dtype=object), binary_data=binary_in)
    output = triton.InferRequestedOutput("embedding", binary_data=binary_out)
    result = client.infer(MODEL, [tensor], outputs=[output], headers=dict(HEADERS))
    rows = result.as_numpy("embedding")
    assert result.get_response()["model_name"] == MODEL
    return rows


def test_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, model_version="1")
    assert not client.is_model_ready("no-such-model")
    assert "binary_tensor_data" in client.get_server_metadata(headers=dict(HEADERS))["extensions"]
    metadata = client.get_model_metadata(MODEL, headers=dict(HEADERS))
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 384]}]


@pytest.mark.parametrize(("binary_in", "binary_out"), [(False, False), (True, False), (False, True), (True, True)])
def test_infer_matches_sentence_transformers(
    client: triton.InferenceServerClient, expected: np.ndarray, binary_in: bool, binary_out: bool
) -> None:
    rows = _infer(client, binary_in, binary_out)
    assert rows.shape == (len(TEXTS), 384) and rows.dtype == np.float32
    assert row_cosines(rows, expected).min() > 0.99999


def test_parameters_and_a_version(url: str, expected: np.ndarray) -> None:
    # the protocol's objects are open: fields this server does not read (Triton's "priority", a tensor's "shape
    # hint") are ignored, not refused
    body = {"inputs": [{"name": "text", "shape": [3, 1], "datatype": "BYTES", "data": [[t] for t in TEXTS],
                        "parameters": {"shape_hint": 1}}],
            "parameters": {"dimensions": 64, "normalize": False, "priority": 1}, "id": "r-7", "x": {}}  # fmt: skip
    reply = httpx.post(f"{url}/v2/models/{MODEL}/versions/1/infer", json=body, headers=HEADERS, timeout=60)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["id"] == "r-7" and answer["outputs"][0]["shape"] == [3, 64]
    rows = np.array(answer["outputs"][0]["data"], np.float32).reshape(3, 64)
    assert row_cosines(rows, expected[:, :64]).min() > 0.99999


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [1], "datatype": "FP32", "data": ["a"]}]},
         400, "BYTES"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": [1]}]}, 422,
         "'inputs[0].data[0]' must be a string or a list"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES"}]}, 400,
         "'inputs[0].data' is required"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"]}],
                                       "parameters": {"dimensions": True}}, 422, "'parameters.dimensions' must be"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [-1], "datatype": "BYTES", "data": ["a"]}]},
         400, "'inputs[0].shape[0]' must be >= 0"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [2], "datatype": "BYTES", "data": ["a"]}]},
         400, "shape"),
        (f"/v2/models/{MODEL}/infer", {"inputs": []}, 400, "'inputs' must not be empty"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"]}] * 2},
         400, "'inputs' must be of length <= 1"),
        (f"/v2/models/{MODEL}/infer", [], 422, "a JSON object"),
        (f"/v2/models/{MODEL}/infer", {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": [""]}]},
         400, "'inputs[0].data[0]' is an empty string"),
        (f"/v2/models/{MODEL}/infer",
         {"inputs": [{"name": "t", "shape": [1], "datatype": "BYTES", "data": ["a"]}], "outputs": [{"name": "x"}]},
         400, "embedding"),
        (f"/v2/models/{MODEL}/versions/2/infer", {"inputs": []}, 404, "version"),
        ("/v2/models/no-such-model/infer", {"inputs": []}, 404, "no-such-model"),
    ],
)  # fmt: skip
def test_bad_requests_get_the_protocols_error_body(
    url: str, path: str, body: dict[str, object], status: int, words: str
) -> None:
    reply = httpx.post(f"{url}{path}", json=body, headers=HEADERS, timeout=60)
    assert reply.status_code == status, reply.text
    assert list(reply.json()) == ["error"] and words in reply.json()["error"]


def test_binary_data_that_does_not_fit_is_refused(url: str) -> None:
    header = b'{"inputs":[{"name":"t","shape":[1],"datatype":"BYTES","parameters":{"binary_data_size":9}}]}'
    body = header + b"\x05\x00\x00\x00abc"  # claims 9 bytes, holds 7, and an element of 5 with 3
    headers = {**HEADERS, "Inference-Header-Content-Length": str(len(header))}
    reply = httpx.post(f"{url}/v2/models/{MODEL}/infer", content=body, headers=headers, timeout=60)
    assert reply.status_code == 400 and "binary_data_size" in reply.json()["error"]


def test_the_client_raises_the_servers_message(client: triton.InferenceServerClient) -> None:
    tensor = triton.InferInput("text", [1], "BYTES")
    tensor.set_data_from_numpy(np.array([""], dtype=object))
    with pytest.raises(InferenceServerException, match="empty text"):
        client.infer(MODEL, [tensor], headers=dict(HEADERS))
