"""Reranking through the gateway and replicas in this process (tests/in_process.py; a cross-encoder saved by
sentence-transformers, a three-label classifier, a Qwen3-Reranker, beside the bundled MiniLM): TEI's /rerank and
/predict, Cohere's and Jina's /v1/rerank, vLLM's /score, each answered in its server's shape with the scores
sentence-transformers' CrossEncoder (or, for the decoder reranker, transformers' causal LM on its model card's template)
gives; a route a model cannot serve is refused naming its task (TEI's 424 on TEI's routes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from in_process import engines, served
from test_cross_encoders import LIMIT, _tiny_classifier
from test_gateway_api import get, post
from test_qwen3_reranker import (
    DEFAULT_INSTRUCTION,
    reference_ids,
    reference_scores,
    save_qwen_tokenizer,
    save_reranker,
    yes_no_ids,
)

from bouquet.engine.engine import Engine

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


LABELS = {"0": "entailment", "1": "neutral", "2": "contradiction"}


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory, minilm_path: Path) -> Path:
    """Three labels with names of their own, for /predict (a plain Hugging Face directory)."""
    return _tiny_classifier("bert", tmp_path_factory.mktemp("nli") / "tiny-nli", minilm_path, 3, id2label=LABELS)


@pytest.fixture(scope="module")
def qwen_reranker(tmp_path_factory):
    """A tiny Qwen3-Reranker as sentence-transformers saves it (Transformer, then LogitScore), with the reference
    scores for QUERY and DOCUMENTS: the default instruction's, and another's."""
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("qwen3-reranker")
    save_qwen_tokenizer(root / "tokenizer")
    model = save_reranker(root / "hf", root / "tokenizer")
    CrossEncoder(str(root / "hf"), device="cpu").save(str(root / "tiny-qwen3-reranker"))
    pairs = [(QUERY, document) for document in DOCUMENTS]
    yes, no = yes_no_ids(root / "tokenizer")
    expected = {
        instruction: reference_scores(model, reference_ids(root / "tokenizer", pairs, instruction), yes, no)
        for instruction in (DEFAULT_INSTRUCTION, OTHER_INSTRUCTION)
    }
    return root / "tiny-qwen3-reranker", expected


OTHER_INSTRUCTION = "Find the passage that answers the question"


@pytest.fixture(scope="module")
def server(
    cross_encoder_dir: Path, classifier_dir: Path, qwen_reranker, minilm_path: Path, minilm_fp32: Engine
) -> Iterator[str]:
    """In process (tests/in_process.py): a replica per model, the gateway app on a loopback port."""
    models = (cross_encoder_dir, minilm_path, classifier_dir, qwen_reranker[0])
    with (
        engines(cross_encoder_dir, classifier_dir, qwen_reranker[0]) as others,
        served([minilm_fp32, *others], model_dirs=models, chunk_tokens=64, listen=True) as running,
    ):
        yield running.url


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
    # Cohere's body on /rerank, and the other routes: OpenAI's error body (TEI's bodies: BAD_TEI below)
    "documents on /rerank, empty": ("/rerank", {"query": "q", "documents": [], "model": "tiny-reranker"}, 400),
    "a reranker asked for embeddings": ("/v1/embeddings", {"input": "a", "model": "tiny-reranker"}, 400),
    "an embedding model asked to rerank, Cohere's body": (
        "/v1/rerank", {"query": "q", "documents": ["a"], "model": "all-MiniLM-L6-v2"}, 400,
    ),
    "documents not a list": ("/v1/rerank", {"query": "q", "documents": "a", "model": "tiny-reranker"}, 422),
    "an empty document": ("/v1/rerank", {"query": "q", "documents": [""], "model": "tiny-reranker"}, 400),
    "top_n of 0": ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": 0, "model": "tiny-reranker"}, 400),
    "lists of other lengths": ("/score", {"text_1": ["a", "b"], "text_2": ["c"], "model": "tiny-reranker"}, 400),
    "a field it does not honour": (
        "/v1/rerank",
        {"query": "q", "documents": ["a"], "max_chunks_per_doc": 2, "model": "tiny-reranker"},
        400,
    ),
    "vLLM's truncate_prompt_tokens": ("/score", {"text_1": "q", "text_2": ["a"], "truncate_prompt_tokens": 8}, 400),
    "an instruction to an encoder": (
        "/score", {"text_1": "q", "text_2": ["a"], "instruction": "x", "model": "tiny-reranker"}, 400,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_bad_rerank_requests_get_their_4xx(server: str, case: str) -> None:
    route, body, status = BAD[case]
    got, answer = post(f"{server}{route}", body)
    assert got == status and "message" in answer["error"], answer
    if answer["error"]["code"] == "unsupported_parameter":
        assert answer["error"]["param"] in {"max_chunks_per_doc", "truncate_prompt_tokens", "instruction"}


# TEI's routes answer TEI's body, {"error", "error_type"}, with TEI's status for the kind of error.
BAD_TEI = {
    "an embedding model asked to rerank": (
        "/rerank", {"query": "q", "texts": ["a"], "model": "all-MiniLM-L6-v2"}, 424, "Backend",
    ),
    "an embedding model asked to predict": ("/predict", {"inputs": "a", "model": "all-MiniLM-L6-v2"}, 424, "Backend"),
    "no query": ("/rerank", {"texts": ["a"], "model": "tiny-reranker"}, 422, "Validation"),  # axum's missing field
    "texts not a list": ("/rerank", {"query": "q", "texts": "a", "model": "tiny-reranker"}, 422, "Validation"),
    "left truncation of pairs": (
        "/rerank", {"query": "q", "texts": ["a"], "truncation_direction": "left"}, 422, "Validation",
    ),
    "no inputs": ("/predict", {"model": "tiny-reranker"}, 422, "Validation"),
    "an empty batch": ("/predict", {"inputs": [], "model": "tiny-reranker"}, 400, "Empty"),
    "three texts": ("/predict", {"inputs": ["a", "b", "c"], "model": "tiny-reranker"}, 422, "Validation"),
    "a batch of bare strings": ("/predict", {"inputs": [["a"], "b"], "model": "tiny-reranker"}, 422, "Validation"),
    "a pair truncated from the left": (
        "/predict", {"inputs": ["a", "b"], "truncation_direction": "left", "model": "tiny-reranker"}, 422, "Validation",
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_TEI))
def test_bad_tei_requests_get_teis_errors(server: str, case: str) -> None:
    route, body, status, error_type = BAD_TEI[case]
    got, answer = post(f"{server}{route}", body)
    assert (got, answer["error_type"]) == (status, error_type) and isinstance(answer["error"], str), answer


def _logits(model_dir: Path, inputs: list) -> np.ndarray:  # [N, labels]: transformers, one input at a time
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    with torch.no_grad():
        return np.concatenate([model(**tokenizer(*item, return_tensors="pt")).logits.numpy() for item in inputs])


def test_tei_predict_one_label(server: str, cross_encoder_dir: Path) -> None:
    """A text, a pair, and a batch of both: a sigmoid of the one logit, labelled with transformers' name."""
    inputs = [["what is packed attention"], [QUERY, DOCUMENTS[0]], ["one"], [QUERY, DOCUMENTS[1]]]
    expected = 1 / (1 + np.exp(-_logits(cross_encoder_dir, inputs)[:, 0]))
    status, answer = post(f"{server}/predict", {"inputs": inputs, "model": "tiny-reranker"})
    assert status == 200 and [len(row) for row in answer] == [1] * 4
    np.testing.assert_allclose([row[0]["score"] for row in answer], expected, atol=1e-4)
    assert {row[0]["label"] for row in answer} == {"LABEL_0"}
    status, single = post(f"{server}/predict", {"inputs": "what is packed attention", "model": "tiny-reranker"})
    assert status == 200 and abs(single[0]["score"] - expected[0]) < 1e-4
    status, pair = post(f"{server}/predict", {"inputs": [QUERY, DOCUMENTS[0]], "model": "tiny-reranker"})
    assert status == 200 and abs(pair[0]["score"] - expected[1]) < 1e-4


def test_tei_predict_labels(server: str, classifier_dir: Path) -> None:
    """Several labels: a softmax over them (TEI's rule), every label by its id2label name, best first; /info
    calls the model a classifier with those labels, as TEI does."""
    status, info = get(f"{server}/info?model=tiny-nli")
    assert json.loads(info)["model_type"]["classifier"]["id2label"] == LABELS
    inputs = [[QUERY, DOCUMENTS[0]], ["a text alone"]]
    logits = _logits(classifier_dir, inputs)
    status, answer = post(f"{server}/predict", {"inputs": inputs, "model": "tiny-nli"})
    assert status == 200
    for row, expected in zip(answer, logits, strict=True):
        probabilities = np.exp(expected) / np.exp(expected).sum()
        assert [item["label"] for item in row] == [LABELS[str(i)] for i in np.argsort(-probabilities)]
        np.testing.assert_allclose([item["score"] for item in row], np.sort(probabilities)[::-1], atol=1e-4)
    status, raw = post(f"{server}/predict", {"inputs": inputs[1], "model": "tiny-nli", "raw_scores": True})
    np.testing.assert_allclose(sorted(item["score"] for item in raw), np.sort(logits[1]), atol=1e-4)


@pytest.mark.parametrize("instruction", [None, OTHER_INSTRUCTION])
def test_qwen3_reranker_on_every_route(server: str, qwen_reranker, instruction: str | None) -> None:
    """Each pair read through the model card's template (the gateway picks it from the replica's architecture), with
    the default instruction or the request's."""
    name, expected = "tiny-qwen3-reranker", qwen_reranker[1][instruction or DEFAULT_INSTRUCTION]
    extra = {} if instruction is None else {"instruction": instruction}
    status, tei = post(f"{server}/rerank", {"query": QUERY, "texts": DOCUMENTS, "model": name, **extra})
    assert status == 200 and [item["index"] for item in tei] == np.argsort(-expected, kind="stable").tolist()
    np.testing.assert_allclose([item["score"] for item in sorted(tei, key=lambda i: i["index"])], expected, atol=1e-4)
    status, cohere = post(f"{server}/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "model": name, **extra})
    assert status == 200
    for result in cohere["results"]:
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-4
    status, vllm = post(f"{server}/score", {"text_1": QUERY, "text_2": DOCUMENTS, "model": name, **extra})
    np.testing.assert_allclose([item["score"] for item in vllm["data"]], expected, atol=1e-4)
    batch = [[QUERY, document] for document in DOCUMENTS]
    status, predicted = post(f"{server}/predict", {"inputs": batch, "model": name, **extra})
    np.testing.assert_allclose([row[0]["score"] for row in predicted], expected, atol=1e-4)


def test_qwen3_reranker_refuses_a_text_alone(server: str) -> None:
    status, answer = post(f"{server}/predict", {"inputs": "just a text", "model": "tiny-qwen3-reranker"})
    assert status == 413 and "pairs" in answer["error"], answer  # TEI's validation error
