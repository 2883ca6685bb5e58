"""The routes and behaviours of the servers people switch from, on the real gateway and a replica in this process
(tests/in_process.py): TEI's `POST /`, `/similarity`, `/decode` and error bodies; vLLM's `/tokenize` shape,
`truncate_prompt_tokens` and `normalize`; Infinity's `/embeddings` and `/models`; `x-request-id` on every answer; CORS
for the origins allowed; public /metrics counting unmatched routes; and a server that takes text only."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import corpus
import numpy as np
import pytest
from conftest import row_cosines
from in_process import served

from bouquet.engine.engine import Engine

MODEL = "all-MiniLM-L6-v2"
API_KEY = "routes-key"
ALLOWED_ORIGIN = "http://allowed.example"
TEXTS = [*corpus.documents(3), *corpus.queries(3)]


@pytest.fixture(scope="module")
def server(minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    """In process (tests/in_process.py), on a loopback port of the gateway's own HTTP server."""
    options = {"api_key": API_KEY, "cors_allow_origin": (ALLOWED_ORIGIN,), "token_id_input": False}
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, **options) as running:
        yield running.url


def call(
    url: str, body: dict | None = None, headers: dict[str, str] | None = None, method: str | None = None
) -> tuple[int, dict[str, str], object]:
    data = None if body is None else json.dumps(body).encode()
    all_headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}", **(headers or {})}
    request = urllib.request.Request(url, data=data, headers=all_headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            raw, status, got = reply.read(), reply.status, reply.headers
    except urllib.error.HTTPError as error:
        raw, status, got = error.read(), error.code, error.headers
    try:
        value: object = json.loads(raw)
    except ValueError:
        value = raw.decode()
    return status, {k.lower(): v for k, v in got.items()}, value


def test_tei_root_route_is_embed(server, sentence_transformer):
    status, _, rows = call(f"{server}/", {"inputs": TEXTS})
    assert status == 200
    _, _, embed_rows = call(f"{server}/embed", {"inputs": TEXTS})
    assert np.allclose(np.array(rows), np.array(embed_rows), atol=1e-6)
    expected = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    assert row_cosines(np.array(rows, np.float32), expected).min() >= 0.99999


def test_similarity_is_the_cosine_of_the_embeddings(server, sentence_transformer):
    body = {"inputs": {"source_sentence": TEXTS[0], "sentences": TEXTS[1:]}, "parameters": {"truncate": True}}
    status, _, values = call(f"{server}/similarity", body)
    assert status == 200
    vectors = sentence_transformer.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    assert np.allclose(values, vectors[1:] @ vectors[0], atol=1e-5)


def test_decode_reverses_tokenize(server):
    _, _, tokens = call(f"{server}/tokenize", {"inputs": ["Hello world", "tokens back to text"]})
    ids = [[token["id"] for token in sequence] for sequence in tokens]
    status, _, texts = call(f"{server}/decode", {"ids": ids})
    assert status == 200 and texts == ["hello world", "tokens back to text"]
    assert call(f"{server}/decode", {"ids": ids[0], "skip_special_tokens": False})[2] == ["[CLS] hello world [SEP]"]


def test_vllm_tokenize_shape(server):
    status, _, body = call(f"{server}/tokenize", {"model": MODEL, "prompt": "hello world", "return_token_strs": True})
    assert status == 200
    assert body == {"count": 4, "max_model_len": 256, "tokens": [101, 7592, 2088, 102],
                    "token_strs": ["[CLS]", "hello", "world", "[SEP]"]}  # fmt: skip


def test_infinity_routes_without_the_v1_prefix(server):
    status, _, body = call(f"{server}/embeddings", {"model": MODEL, "input": TEXTS[:2], "modality": "text"})
    assert status == 200 and len(body["data"]) == 2
    status, _, models = call(f"{server}/models")
    assert status == 200 and models["data"][0]["id"] == MODEL


def test_vllm_truncate_prompt_tokens_and_normalize(server, sentence_transformer):
    text = corpus.documents(1)[0]
    body = {"model": MODEL, "input": [text], "truncate_prompt_tokens": 16, "normalize": False}
    status, _, reply = call(f"{server}/v1/embeddings", body)
    assert status == 200 and reply["usage"]["prompt_tokens"] == 16
    row = np.array(reply["data"][0]["embedding"], np.float32)
    tokenizer, limit = sentence_transformer.tokenizer, sentence_transformer.max_seq_length
    tokenizer.truncation_side, sentence_transformer.max_seq_length = "right", 16  # vLLM 0.32's: the first k tokens
    try:
        expected = sentence_transformer.encode([text], convert_to_numpy=True, normalize_embeddings=False)[0]
    finally:
        tokenizer.truncation_side, sentence_transformer.max_seq_length = "right", limit
    assert np.linalg.norm(row) > 1.5  # normalize=false: the pooled row as it is (the model's Normalize skipped)
    assert row_cosines(row[None], expected[None]).min() >= 0.99999


@pytest.mark.parametrize(("cap", "status", "tokens"), [(-1, 200, 256), (256, 200, 256), (0, 400, 0), (-2, 400, 0),
                                                       (257, 400, 0)])  # fmt: skip
def test_truncate_prompt_tokens_within_the_model_limit(server, cap: int, status: int, tokens: int):
    """-1 is the model's limit (256), as is 256 itself; 0, below -1 and over the limit are refused naming the field,
    as vLLM refuses them."""
    body = {"model": MODEL, "input": "word " * 400, "truncate_prompt_tokens": cap}
    got, _, reply = call(f"{server}/v1/embeddings", body)
    assert got == status, reply
    if status == 200:
        assert reply["usage"]["prompt_tokens"] == tokens
    else:
        assert (reply["error"]["code"], reply["error"]["param"]) == ("invalid_value", "truncate_prompt_tokens")
        assert str(cap) in reply["error"]["message"]


def test_cohere_max_tokens_over_the_limit_is_refused_by_its_name(server):
    got, _, reply = call(f"{server}/v2/embed", {"model": MODEL, "texts": ["a"], "input_type": "search_query",
                                                "embedding_types": ["float"], "max_tokens": 257})  # fmt: skip
    assert got == 400 and reply["message"].startswith("'max_tokens' must be"), reply


def test_every_answer_has_a_request_id(server):
    _, headers, _ = call(f"{server}/embed", {"inputs": "a"}, {"x-request-id": "client-id-42"})
    assert headers["x-request-id"] == "client-id-42"
    _, first, _ = call(f"{server}/info")
    _, second, _ = call(f"{server}/no/such/route")
    assert len(first["x-request-id"]) == 32 and first["x-request-id"] != second["x-request-id"]
    _, unsafe, _ = call(f"{server}/info", headers={"x-request-id": "bad id\twith spaces"})
    assert unsafe["x-request-id"] != "bad id\twith spaces"


def test_cors_only_for_the_allowed_origin(server):
    preflight = {"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}  # fmt: skip
    status, headers, _ = call(f"{server}/v1/embeddings", headers=preflight, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == ALLOWED_ORIGIN
    status, _, _ = call(f"{server}/v1/embeddings", headers={**preflight, "Origin": "http://other.example"},
                        method="OPTIONS")  # fmt: skip
    assert status == 400
    _, headers, _ = call(f"{server}/embed", {"inputs": "a"}, {"Origin": ALLOWED_ORIGIN})
    assert (
        headers["access-control-allow-origin"] == ALLOWED_ORIGIN
        and "x-request-id" in headers["access-control-expose-headers"]
    )


def test_metrics_are_public_and_count_unmatched_routes(server):
    call(f"{server}/wp-login.php")
    request = urllib.request.Request(f"{server}/metrics")  # no key
    with urllib.request.urlopen(request, timeout=30) as reply:
        text = reply.read().decode()
    assert 'route="unmatched",status="404"' in text


def test_vllms_ping_answers_as_health_without_the_key(server):
    for method, body in (("GET", None), ("POST", {})):
        request = urllib.request.Request(f"{server}/ping", None if body is None else b"{}", method=method)
        with urllib.request.urlopen(request, timeout=30) as reply:
            assert (reply.status, json.loads(reply.read())["status"]) == (200, "ok")


def test_a_text_only_server_refuses_token_ids(server):
    status, _, error = call(f"{server}/v1/embeddings", {"input": [[101, 7592, 102]]})
    assert status == 400 and error["error"]["code"] == "token_ids_refused"


def test_info_has_teis_router_fields(server):
    _, _, info = call(f"{server}/info")
    for field in ("served_model_name", "max_concurrent_requests", "auto_truncate", "tokenization_workers"):
        assert field in info
    assert info["model_type"] == {"embedding": {"pooling": "mean"}}


def test_long_input_chunk_embeds_the_whole_text_in_averaged_windows(server, sentence_transformer):
    """An input of ~3 windows: the average of its windows' pooled rows (each [CLS] piece [SEP], weighted by its text
    tokens), normalised, computed here with sentence-transformers' own Transformer and Pooling modules."""
    import torch

    text = " ".join(corpus.documents(12))
    status, _, reply = call(f"{server}/v1/embeddings", {"input": [text, "short"], "long_input": "chunk"})
    assert status == 200
    tokenizer = sentence_transformer.tokenizer
    content = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(content) > 2 * 254
    pieces = [content[start : start + 254] for start in range(0, len(content), 254)]
    pooled = []
    for piece in pieces:
        ids = torch.tensor([[tokenizer.cls_token_id, *piece, tokenizer.sep_token_id]])
        features = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
        with torch.no_grad():
            features = sentence_transformer[1](sentence_transformer[0](features))  # Transformer, Pooling
        pooled.append(features["sentence_embedding"][0].numpy())
    weights = np.array([len(piece) for piece in pieces], np.float64)
    expected = (np.array(pooled, np.float64) * weights[:, None]).sum(0) / weights.sum()
    row = np.array(reply["data"][0]["embedding"], np.float32)
    assert row_cosines(row[None], expected[None].astype(np.float32)).min() >= 0.99999
    assert abs(np.linalg.norm(row) - 1) < 1e-5
    assert reply["usage"]["prompt_tokens"] == len(content) + 2 * len(pieces) + 3  # every window's frame counted
    short = sentence_transformer.encode(["short"], convert_to_numpy=True)
    assert row_cosines(np.array([reply["data"][1]["embedding"]], np.float32), short).min() >= 0.99999
    truncated = call(f"{server}/v1/embeddings", {"input": [text]})[2]["data"][0]["embedding"]
    assert row_cosines(row[None], np.array([truncated], np.float32)).min() < 0.999  # the whole text, not its start
    status, _, error = call(f"{server}/embed", {"inputs": text, "truncate": False})
    assert status == 413 and error["error_type"] == "Validation"  # truncate=false stays an error
