"""The HTTP API (the gateway and a replica in this process, tests/in_process.py), with the openai package as the
client: parity with sentence-transformers through every input form, TEI's routes, and every bad input answered with
its 4xx while good requests go on."""

from __future__ import annotations

import base64
import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import corpus
import numpy as np
import openai
import pytest
from conftest import row_cosines
from in_process import served

from bouquet.engine.engine import Engine

MODEL = "all-MiniLM-L6-v2"
API_KEY = "test-key"
MAX_INPUTS = 64
MAX_PAYLOAD = 200_000


@pytest.fixture(scope="module")
def server(minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    """In process (tests/in_process.py): a replica and the gateway app, served on a loopback port by the gateway's
    own HTTP server (bodies sent byte for byte, a client that hangs up)."""
    options = {"api_key": API_KEY, "max_inputs": MAX_INPUTS, "max_payload_bytes": MAX_PAYLOAD, "chunk_tokens": 300}
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, **options) as running:
        yield running.url


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def post(
    url: str, body: bytes | dict, key: str | None = API_KEY, headers: dict[str, str] | None = None
) -> tuple[int, object]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {
        "Content-Type": "application/json",
        **({"Authorization": f"Bearer {key}"} if key else {}),
        **(headers or {}),
    }
    request = urllib.request.Request(url, data=data, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {API_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as reply:
        return reply.status, reply.read()


def reference(model, texts: list[str], dimensions: int | None = None) -> np.ndarray:
    return model.encode(texts, convert_to_numpy=True, truncate_dim=dimensions)


def assert_parity(rows: np.ndarray, expected: np.ndarray) -> None:
    assert rows.shape == expected.shape
    assert row_cosines(rows, expected).min() >= 0.99999


def as_rows(response) -> np.ndarray:
    return np.array([item.embedding for item in response.data], dtype=np.float32)


TEXTS = [*corpus.documents(12), *corpus.queries(6), *corpus.NON_ASCII_TEXTS[:4]]


def test_a_string_matches_sentence_transformers(client, sentence_transformer):
    response = client.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float")
    assert_parity(as_rows(response), reference(sentence_transformer, TEXTS[:1]))
    assert response.model == MODEL


def test_a_list_in_order_across_chunks_with_usage(client, sentence_transformer, minilm_tokenizer):
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [item.index for item in response.data] == list(range(len(TEXTS)))
    assert_parity(as_rows(response), reference(sentence_transformer, TEXTS))
    tokens = sum(map(len, minilm_tokenizer.encode(TEXTS)))
    assert response.usage.prompt_tokens == response.usage.total_tokens == tokens


def test_token_ids_match_the_same_texts(client, sentence_transformer, minilm_tokenizer):
    ids = minilm_tokenizer.encode(TEXTS[:5])
    many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert_parity(as_rows(many), reference(sentence_transformer, TEXTS[:5]))
    one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert_parity(as_rows(one), reference(sentence_transformer, TEXTS[:1]))
    assert one.usage.prompt_tokens == len(ids[0])


def test_base64_is_little_endian_float32(client, server, sentence_transformer):
    response = client.embeddings.create(model=MODEL, input=TEXTS[:4])  # the client asks for base64 itself
    assert_parity(as_rows(response), reference(sentence_transformer, TEXTS[:4]))
    status, body = post(f"{server}/v1/embeddings", {"model": MODEL, "input": TEXTS[:2], "encoding_format": "base64"})
    assert status == 200
    rows = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in body["data"]])
    assert_parity(rows, reference(sentence_transformer, TEXTS[:2]))


def test_dimensions_truncate_then_normalise(client, sentence_transformer):
    response = client.embeddings.create(model=MODEL, input=TEXTS[:6], dimensions=64, encoding_format="float")
    rows = as_rows(response)
    assert_parity(rows, reference(sentence_transformer, TEXTS[:6], dimensions=64))
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)


def test_tei_embed(server, sentence_transformer):
    status, body = post(f"{server}/embed", {"inputs": TEXTS})
    assert status == 200
    assert_parity(np.array(body, np.float32), reference(sentence_transformer, TEXTS))
    status, body = post(f"{server}/embed", {"inputs": TEXTS[0], "normalize": False, "dimensions": 32})
    assert status == 200
    assert_parity(np.array(body, np.float32), reference(sentence_transformer, TEXTS[:1], dimensions=32))


def test_tei_left_truncation_keeps_the_end(server, sentence_transformer, minilm_tokenizer):
    long_text = " ".join(corpus.documents()[:40])
    status, body = post(f"{server}/embed", {"inputs": long_text, "truncation_direction": "Left"})
    assert status == 200
    ids = minilm_tokenizer.encode([long_text], truncate=False)[0]
    kept = [101, *ids[-255:]]  # [CLS], then the last 254 text tokens and [SEP]
    status, by_ids = post(f"{server}/embed", {"inputs": [kept]})
    assert status == 200
    assert row_cosines(np.array(body), np.array(by_ids)).min() >= 0.99999


def test_tokenize_info_models_metrics_docs(server, client):
    client.embeddings.create(model=MODEL, input="counted in the metrics")
    status, tokens = post(f"{server}/tokenize", {"inputs": "hello world"})
    assert status == 200
    assert [token["id"] for token in tokens[0]] == [101, 7592, 2088, 102]
    assert tokens[0][1] == {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5}
    info = json.loads(get(f"{server}/info")[1])
    assert (info["model_id"], info["dimension"], info["max_input_length"]) == (MODEL, 384, 256)
    models = json.loads(get(f"{server}/v1/models")[1])
    assert [model["id"] for model in models["data"]] == [MODEL]
    metrics = get(f"{server}/metrics")[1].decode()
    for name in ("requests_total", "request_seconds", "tokenize_seconds", "queue_seconds", "tokens_total",
                 "requests_in_flight"):  # fmt: skip
        assert f"bouquet_gateway_{name}" in metrics
    assert '/v1/embeddings",status="200"' in metrics
    assert "/v1/embeddings" in json.loads(get(f"{server}/openapi.json")[1])["paths"]
    assert b"swagger" in get(f"{server}/docs")[1]


_LONG = "word " * 400
TEI_ROUTES = ("/", "/embed", "/tokenize", "/similarity", "/decode", "/rerank", "/info", "/health")
BAD_INPUTS = [
    ("/v1/embeddings", b"{not json", 400, "invalid_json"),
    ("/v1/embeddings", b'{"input": "\xff\xfe bad"}', 400, "invalid_utf8"),
    ("/v1/embeddings", {"input": 5}, 422, "invalid_type"),
    ("/v1/embeddings", {"input": ["a", 3]}, 422, "invalid_type"),
    ("/v1/embeddings", {"input": "a", "dimensions": "8"}, 422, "invalid_type"),
    ("/v1/embeddings", [1, 2], 422, "invalid_type"),
    ("/v1/embeddings", {"input": ""}, 400, "empty_input"),
    ("/v1/embeddings", {"input": []}, 400, "empty_input"),
    ("/v1/embeddings", {"input": [[]]}, 400, "empty_input"),
    ("/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}, 413, "too_many_inputs"),
    ("/v1/embeddings", {"input": "a", "extra": 1}, 400, "unsupported_parameter"),
    ("/v1/embeddings", {"input": "a", "add_special_tokens": False}, 400, "unsupported_parameter"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": 0}, 400, "invalid_value"),
    # TEI's routes: its body and statuses (router/src/http/server.rs: an empty batch 400, a limit 413)
    ("/tokenize", {"inputs": ["a"] * (MAX_INPUTS + 1)}, 413, "Validation"),
    ("/embed", {"inputs": _LONG, "truncate": False}, 413, "Validation"),
    ("/embed", {"inputs": [[101] * 300], "truncate": False}, 413, "Validation"),
    ("/embed", {"inputs": []}, 400, "Empty"),
    ("/", {"inputs": ""}, 400, "Empty"),
    ("/", {"inputs": 5}, 422, "Validation"),
    ("/embed", {"inputs": "a", "dimensions": 385}, 413, "Validation"),
    ("/embed", {"inputs": "a", "unknown": True}, 422, "Validation"),
    ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty"),
    ("/similarity", {"inputs": "a"}, 422, "Validation"),
    ("/decode", {"ids": [[1, 2], "x"]}, 422, "Validation"),
    ("/decode", {"ids": [30522]}, 413, "Validation"),
    ("/v1/embeddings", {"input": [[101, 30522, 102]]}, 400, "invalid_token_id"),
    ("/v1/embeddings", {"input": [101, -1, 102]}, 400, "invalid_token_id"),
    ("/v1/embeddings", {"input": "a", "dimensions": 0}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": "a", "dimensions": 385}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "int4"}, 400, "invalid_value"),
    ("/v1/embeddings", {"input": "a", "model": "text-embedding-3-small"}, 404, "model_not_found"),
    ("/embed", {"inputs": "a", "prompt_name": "query"}, 413, "Validation"),
    ("/v1/embeddings", {"input": "a" * (MAX_PAYLOAD + 1)}, 413, "payload_too_large"),
]


@pytest.mark.parametrize(("route", "body", "status", "code"), BAD_INPUTS, ids=[c[3] for c in BAD_INPUTS])
def test_bad_input_gets_its_error_while_good_requests_succeed(server, client, route, body, status, code):
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(client.embeddings.create, model=MODEL, input=TEXTS[:8], encoding_format="float")
        got_status, error = post(f"{server}{route}", body)
        assert len(good.result().data) == 8
    assert got_status == status, error
    if route in TEI_ROUTES:
        assert set(error) == {"error", "error_type"} and error["error_type"] == code and error["error"], error
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"}
        assert error["error"]["code"] == code and error["error"]["message"]
    assert urllib.request.urlopen(f"{server}/health", timeout=10).status == 200


def _gzip(value: object) -> bytes:
    import gzip

    return gzip.compress(json.dumps(value).encode())


# Bad requests whose fault is in a header (the body's encoding, the key): (route, body, headers, key, status, code)
BAD_HEADERS = [
    ("/embed", {"inputs": "a"}, {"Content-Encoding": "br"}, API_KEY, 415, "unsupported_media_type"),
    ("/v1/embeddings", b"\x1f\x8b not gzip", {"Content-Encoding": "gzip"}, API_KEY, 400, "invalid_gzip"),
    ("/v1/embeddings", _gzip({"input": "a" * (2 * MAX_PAYLOAD)}), {"Content-Encoding": "gzip"}, API_KEY, 413,
     "payload_too_large"),
    ("/v1/embeddings", {"input": "a"}, {}, None, 401, "invalid_api_key"),
    ("/v1/embeddings", {"input": "a"}, {}, "wrong", 401, "invalid_api_key"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "headers", "key", "status", "code"), BAD_HEADERS,
                         ids=[f"{c[5]}-{c[4]}-{i}" for i, c in enumerate(BAD_HEADERS)])  # fmt: skip
def test_bad_headers_get_their_error_while_good_requests_succeed(server, client, route, body, headers, key, status,
                                                                 code):  # fmt: skip
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(client.embeddings.create, model=MODEL, input=TEXTS[:8], encoding_format="float")
        got_status, error = post(f"{server}{route}", body, key=key, headers=headers)
        assert len(good.result().data) == 8
    assert got_status == status, error
    if route in TEI_ROUTES:
        assert set(error) == {"error", "error_type"} and error["error"], error
    else:
        assert set(error["error"]) == {"message", "type", "param", "code"} and error["error"]["code"] == code, error


def test_api_key_is_required(server, client):
    status, error = post(f"{server}/v1/embeddings", {"input": "a"}, key=None)
    assert status == 401 and error["error"]["type"] == "authentication_error"
    status, _ = post(f"{server}/v1/embeddings", {"input": "a"}, key="wrong")
    assert status == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).embeddings.create(model=MODEL, input="a")
    request = urllib.request.Request(f"{server}/v1/models")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.headers["WWW-Authenticate"].startswith("Bearer")  # RFC 7235: the scheme to use
    lowercase = urllib.request.Request(f"{server}/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    with urllib.request.urlopen(lowercase, timeout=30) as reply:  # the scheme is case-insensitive
        assert reply.status == 200


def test_unknown_model_through_the_client(client):
    with pytest.raises(openai.NotFoundError) as raised:
        client.embeddings.create(model="nope", input="a")
    assert raised.value.body["code"] == "model_not_found"


def test_a_client_that_goes_away_has_its_work_cancelled(server, client, sentence_transformer):
    texts = [*corpus.documents(MAX_INPUTS)]  # about 8,000 tokens: seconds of work on this CPU
    body = json.dumps({"input": texts, "model": MODEL}).encode()
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    request = urllib.request.Request(f"{server}/v1/embeddings", data=body, headers=headers, method="POST")
    with pytest.raises(OSError):  # the client gives up long before the rows are ready
        urllib.request.urlopen(request, timeout=0.3)
    deadline = time.monotonic() + 30
    while '/v1/embeddings",status="499"' not in get(f"{server}/metrics")[1].decode():
        assert time.monotonic() < deadline, "the gateway never saw the client go"
        time.sleep(0.05)
    rows = as_rows(client.embeddings.create(model=MODEL, input=["still serving"]))
    assert_parity(rows, reference(sentence_transformer, ["still serving"]))


def test_gzip_bodies(server, sentence_transformer):
    """Clients that compress their requests: a gzip body is read (within the size limit, decompressed), any other
    encoding is a 415, a corrupt one a 400."""
    import gzip

    def send(body: bytes, encoding: str) -> tuple[int, object]:
        headers = {
            "Content-Type": "application/json",
            "Content-Encoding": encoding,
            "Authorization": f"Bearer {API_KEY}",
        }
        request = urllib.request.Request(f"{server}/embed", data=body, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                return reply.status, json.loads(reply.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    texts = TEXTS[:4]
    status, rows = send(gzip.compress(json.dumps({"inputs": texts}).encode()), "gzip")
    assert status == 200
    assert_parity(np.array(rows, dtype=np.float32), reference(sentence_transformer, texts))
    assert send(json.dumps({"inputs": texts}).encode(), "br")[0] == 415
    assert send(b"\x1f\x8b not gzip", "gzip")[0] == 400
    bomb = gzip.compress(json.dumps({"inputs": ["a" * (2 * MAX_PAYLOAD)]}).encode())  # small sent, large inflated
    status, error = send(bomb, "gzip")
    assert status == 413 and error["error_type"] == "Validation" and "limit" in error["error"]  # TEI's body


def test_a_batch_mixing_texts_and_token_ids_as_tei_takes_it(server, sentence_transformer):
    ids = sentence_transformer.tokenizer("hello world")["input_ids"]
    status, rows = post(f"{server}/embed", {"inputs": [TEXTS[0], ids, TEXTS[1]]})
    assert status == 200 and len(rows) == 3
    expected = reference(sentence_transformer, [TEXTS[0], "hello world", TEXTS[1]])
    assert_parity(np.array(rows, np.float32), expected)
