"""`--allow-unknown-fields` relaxes the refusal of fields a route does not read on every route, not only the
embedding ones: a sloppy client's extra field is ignored and the request answered as without it. (Without the
flag each route refuses it: tests/test_gateway_api.py and the per-route tests.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from test_cross_encoders import LIMIT, _tiny_classifier
from test_gateway_api import post

from bouquet.gateway.testing import Process, free_port, start_serve

EXTRA = {"x_client_trace": "abc", "user": "someone"}  # fields no route reads
EMBEDDER, RERANKER = "all-MiniLM-L6-v2", "tiny-reranker"
ROUTES = {
    "/v1/embeddings": {"input": "a", "model": EMBEDDER},
    "/embed": {"inputs": "a", "model": EMBEDDER},
    "/": {"inputs": "a", "model": EMBEDDER},
    "/similarity": {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": EMBEDDER},
    "/ (similarity)": {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "model": EMBEDDER},
    "/tokenize": {"inputs": "a", "model": EMBEDDER},
    "/tokenize (vLLM)": {"prompt": "a", "model": EMBEDDER},
    "/decode": {"ids": [101, 102], "model": EMBEDDER},
    "/detokenize": {"tokens": [101, 102], "model": EMBEDDER},
    "/embed_all": {"inputs": "a", "model": EMBEDDER},
    "/v1/contextualizedembeddings": {"input": [["a", "b"]], "model": EMBEDDER},
    "/rerank": {"query": "q", "texts": ["a"], "model": RERANKER},
    "/rerank (Cohere)": {"query": "q", "documents": ["a"], "model": RERANKER},
    "/v1/rerank": {"query": "q", "documents": ["a"], "model": RERANKER},
    "/score": {"text_1": "q", "text_2": ["a"], "model": RERANKER},
    "/predict": {"inputs": ["q", "a"], "model": RERANKER},
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, minilm_path: Path) -> Iterator[str]:
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("unknown-fields")
    hf_dir = _tiny_classifier("bert", root / "hf", minilm_path, labels=1)
    CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT).save(str(root / RERANKER))
    port = free_port()
    models = ("--model", str(minilm_path), "--model", str(root / RERANKER))
    process: Process = start_serve(port, "--device", "cpu", "--dtype", "float32", "--allow-unknown-fields", *models)
    try:
        process.wait_ready()
        yield f"http://127.0.0.1:{port}"
    finally:
        assert process.stop() == 0


@pytest.mark.parametrize("case", list(ROUTES))
def test_every_route_ignores_fields_it_does_not_read(server: str, case: str) -> None:
    route = case.split(" ")[0]
    body = ROUTES[case]
    status, plain = post(f"{server}{route}", body, key=None)
    assert status == 200, plain
    status, relaxed = post(f"{server}{route}", {**body, **EXTRA}, key=None)
    assert status == 200, relaxed
    assert _without_ids(relaxed) == _without_ids(plain)


def test_similarity_parameters_ignore_fields_too(server: str) -> None:
    body = {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"truncate": True, **EXTRA}}
    status, answer = post(f"{server}/similarity", body, key=None)
    assert status == 200 and len(answer) == 1, answer


def _without_ids(answer: object) -> object:
    """The answer less what may differ between two identical requests: response ids and timings, and the last
    digits of a float (a step of one request may run on one thread or two, which sum in another order)."""
    if isinstance(answer, dict):
        return {key: _without_ids(value) for key, value in answer.items() if key not in {"id", "created", "meta"}}
    if isinstance(answer, list):
        return [_without_ids(value) for value in answer]
    return round(answer, 4) if isinstance(answer, float) else answer
