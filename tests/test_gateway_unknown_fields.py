"""`--allow-unknown-fields` relaxes the refusal of fields a route does not read on every route, not only the
embedding ones: a sloppy client's extra field is ignored and the request answered as without it. (Without the
flag each route refuses it: tests/test_gateway_api.py and the per-route tests.) The API runs in this process
(tests/in_process.py): real replicas and the real gateway app, without a `bouquet serve` start."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from in_process import api
from test_cross_encoders import LIMIT, _tiny_classifier

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

EXTRA = {"x_client_trace": "abc", "user": "someone"}  # fields no route reads
EMBEDDER, RERANKER = "all-MiniLM-L6-v2", "tiny-reranker"
ROUTES = {
    "/v1/embeddings": {"input": "a", "model": EMBEDDER},
    "/v1/embeddings (vLLM chat)": {"messages": [{"role": "user", "content": "a"}], "model": EMBEDDER},
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
def client(tmp_path_factory, minilm_path: Path, minilm_fp32: Engine) -> Iterator[httpx.Client]:
    """In process (tests/in_process.py): the bundled model's engine and a tiny cross-encoder's, each behind a real
    replica, in front of them the gateway app with --allow-unknown-fields."""
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("unknown-fields")
    hf_dir = _tiny_classifier("bert", root / "hf", minilm_path, labels=1)
    CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT).save(str(root / RERANKER))
    reranker = Engine(EngineConfig(root / RERANKER, "cpu", "float32", cpu_warmup_tokens=0))
    try:
        with api([minilm_fp32, reranker], model_dirs=(minilm_path,), allow_unknown_fields=True) as client:
            yield client
    finally:
        reranker.close()


@pytest.mark.parametrize("case", list(ROUTES))
def test_every_route_ignores_fields_it_does_not_read(client: httpx.Client, case: str) -> None:
    route = case.split(" ")[0]
    body = ROUTES[case]
    plain = client.post(route, json=body)
    assert plain.status_code == 200, plain.text
    relaxed = client.post(route, json={**body, **EXTRA})
    assert relaxed.status_code == 200, relaxed.text
    assert _without_ids(relaxed.json()) == _without_ids(plain.json())


def test_similarity_parameters_ignore_fields_too(client: httpx.Client) -> None:
    body = {"inputs": {"source_sentence": "a", "sentences": ["b"]}, "parameters": {"truncate": True, **EXTRA}}
    answer = client.post("/similarity", json=body)
    assert answer.status_code == 200 and len(answer.json()) == 1, answer.text


def _without_ids(answer: object) -> object:
    """The answer less what may differ between two identical requests: response ids and timings, and the last
    digits of a float (a step of one request may run on one thread or two, which sum in another order)."""
    if isinstance(answer, dict):
        return {key: _without_ids(value) for key, value in answer.items() if key not in {"id", "created", "meta"}}
    if isinstance(answer, list):
        return [_without_ids(value) for value in answer]
    return round(answer, 4) if isinstance(answer, float) else answer
