"""Reranking through `bouquet serve` (a cross-encoder saved by sentence-transformers, beside the bundled MiniLM):
TEI's /rerank, Cohere's and Jina's /v1/rerank, vLLM's /score, each answered in its server's shape with the scores
sentence-transformers' CrossEncoder gives; a route a model cannot serve is a 400 naming its task."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from test_cross_encoders import LIMIT, _tiny_classifier
from test_gateway_api import post

from bouquet.gateway.testing import Process, free_port, start_serve

QUERY = "what is packed attention"
DOCUMENTS = [
    "Packed sequences run without padding, as an LLM's prefill does.",
    "The weather in Lisbon is mild in December.",
    "Ünïcödé façade, naïve café: 東京で会いましょう.",
    "Every token of a long passage counts. " * 40,
    "one",
]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, minilm_path: Path) -> Path:
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("reranker")
    hf_dir = _tiny_classifier("bert", root / "hf", minilm_path, labels=1)
    CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT).save(str(root / "tiny-reranker"))
    return root / "tiny-reranker"


@pytest.fixture(scope="module")
def expected(cross_encoder_dir: Path) -> np.ndarray:
    from sentence_transformers import CrossEncoder

    reference = CrossEncoder(str(cross_encoder_dir), device="cpu", max_length=LIMIT)
    return reference.predict([(QUERY, document) for document in DOCUMENTS], convert_to_numpy=True)


@pytest.fixture(scope="module")
def server(cross_encoder_dir: Path, minilm_path: Path) -> Iterator[str]:
    port = free_port()
    models = ("--model", str(cross_encoder_dir), "--model", str(minilm_path))
    process: Process = start_serve(port, "--device", "cpu", "--dtype", "float32", "--chunk-tokens", "64", *models)
    try:
        process.wait_ready()
        yield f"http://127.0.0.1:{port}"
    finally:
        assert process.stop() == 0


def test_tei_rerank(server: str, expected: np.ndarray) -> None:
    body = {"query": QUERY, "texts": DOCUMENTS, "return_text": True, "model": "tiny-reranker"}
    status, answer = post(f"{server}/rerank", body)
    assert status == 200
    assert [item["index"] for item in answer] == np.argsort(-expected, kind="stable").tolist()  # best first
    for item in answer:
        assert abs(item["score"] - expected[item["index"]]) < 1e-4 and item["text"] == DOCUMENTS[item["index"]]
    status, raw = post(f"{server}/rerank", {**body, "raw_scores": True, "return_text": False})
    logits = np.log(expected / (1 - expected))  # the sigmoid undone
    assert all(abs(item["score"] - logits[item["index"]]) < 1e-3 and "text" not in item for item in raw)


@pytest.mark.parametrize("route", ["/v1/rerank", "/rerank"])
def test_cohere_and_jina_rerank(server: str, expected: np.ndarray, route: str) -> None:
    documents = [{"text": text} for text in DOCUMENTS]  # Jina's form; Cohere's plain strings below
    body = {"model": "tiny-reranker", "query": QUERY, "documents": documents, "top_n": 3}
    status, answer = post(f"{server}{route}", body)
    assert status == 200 and answer["model"] == "tiny-reranker" and answer["usage"]["total_tokens"] > 0
    best = np.argsort(-expected, kind="stable")[:3].tolist()
    assert [result["index"] for result in answer["results"]] == best
    for result in answer["results"]:
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-4
        assert result["document"]["text"] == DOCUMENTS[result["index"]]
    status, plain = post(f"{server}{route}", {**body, "documents": DOCUMENTS, "return_documents": False})
    assert status == 200 and all("document" not in result for result in plain["results"])


def test_vllm_score(server: str, expected: np.ndarray) -> None:
    status, answer = post(f"{server}/score", {"model": "tiny-reranker", "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200 and answer["object"] == "list"
    np.testing.assert_allclose([item["score"] for item in answer["data"]], expected, atol=1e-4)
    pairs = {"model": "tiny-reranker", "text_1": [QUERY, QUERY], "text_2": DOCUMENTS[:2]}
    status, answer = post(f"{server}/v1/score", pairs)
    np.testing.assert_allclose([item["score"] for item in answer["data"]], expected[:2], atol=1e-4)


BAD = {
    # TEI's /rerank (a `texts` body): TEI's statuses and error body; a model of the wrong kind is its 424 backend
    "an embedding model asked to rerank": ("/rerank", {"query": "q", "texts": ["a"], "model": "all-MiniLM-L6-v2"}, 424),
    "no query": ("/rerank", {"texts": ["a"], "model": "tiny-reranker"}, 422),
    "texts not a list": ("/rerank", {"query": "q", "texts": "a", "model": "tiny-reranker"}, 422),
    "left truncation of pairs": ("/rerank", {"query": "q", "texts": ["a"], "truncation_direction": "left"}, 422),
    # Cohere's body on /rerank, and the other routes: OpenAI's error body
    "documents on /rerank, empty": ("/rerank", {"query": "q", "documents": [], "model": "tiny-reranker"}, 400),
    "a reranker asked for embeddings": ("/v1/embeddings", {"input": "a", "model": "tiny-reranker"}, 400),
    "an empty document": ("/v1/rerank", {"query": "q", "documents": [""], "model": "tiny-reranker"}, 400),
    "top_n of 0": ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0, "model": "tiny-reranker"}, 400),
    "lists of other lengths": ("/score", {"text_1": ["a", "b"], "text_2": ["c"], "model": "tiny-reranker"}, 400),
    "a field it does not honour": (
        "/v1/rerank",
        {"query": "q", "documents": ["a"], "max_chunks_per_doc": 2, "model": "tiny-reranker"},
        400,
    ),
    "vLLM's truncate_prompt_tokens": ("/score", {"text_1": "q", "text_2": ["a"], "truncate_prompt_tokens": 8}, 400),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rerank_requests_get_their_4xx(server: str, case: str) -> None:
    route, body, status = BAD[case]
    got, answer = post(f"{server}{route}", body)
    assert got == status, answer
    if route == "/rerank" and "documents" not in body:
        assert set(answer) == {"error", "error_type"} and answer["error"], answer  # TEI's body
        return
    assert "message" in answer["error"], answer
    if answer["error"]["code"] == "unsupported_parameter":
        assert answer["error"]["param"] in {"max_chunks_per_doc", "truncate_prompt_tokens", "truncation_direction"}
