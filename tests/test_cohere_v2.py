"""Cohere's API v2 through the real `cohere` SDK's `ClientV2` against the gateway app and real replicas in this
process (tests/in_process.py; the bundled MiniLM and a tiny cross-encoder saved by sentence-transformers):
`/v2/embed` in every embedding type, each computed from the float rows that match sentence-transformers,
`output_dimension`, `input_type` as the model's prompt of that role; `/v2/rerank` with CrossEncoder's scores,
best first; errors in Cohere's body, raised as the SDK's classes."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import cohere
import numpy as np
import pytest
from conftest import row_cosines
from in_process import BASE_URL, api
from test_cross_encoders import LIMIT, _tiny_classifier

from bouquet.config import EngineConfig
from bouquet.encodings import Encoding, encode_rows
from bouquet.engine.engine import Engine
from bouquet.gateway.api.cohere import prompt_name

EMBEDDER, RERANKER = "all-MiniLM-L6-v2", "tiny-reranker"
TEXTS = ["Packed sequences run without padding.", "The weather in Lisbon is mild in December.", "one"]
QUERY = "what is packed attention"


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory, minilm_path: Path) -> Path:
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("cohere-v2")
    hf_dir = _tiny_classifier("bert", root / "hf", minilm_path, labels=1)
    CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT).save(str(root / RERANKER))
    return root / RERANKER


@pytest.fixture(scope="module")
def client(minilm_path: Path, minilm_fp32: Engine, reranker_dir: Path) -> Iterator[cohere.ClientV2]:
    """In process (tests/in_process.py): real replicas over the two engines and the gateway app, with an API key;
    the SDK on an httpx client that hands its requests to the app."""
    reranker = Engine(EngineConfig(reranker_dir, "cpu", "float32", cpu_warmup_tokens=0))
    try:
        with api([minilm_fp32, reranker], model_dirs=(minilm_path,), api_key="co-key") as http:
            yield cohere.ClientV2(api_key="co-key", base_url=BASE_URL, httpx_client=http, timeout=60)
    finally:
        reranker.close()


def test_embed_in_every_type(client: cohere.ClientV2, sentence_transformer) -> None:
    types = ["float", "int8", "uint8", "binary", "ubinary", "base64"]
    response = client.embed(
        model=EMBEDDER,
        texts=TEXTS,
        input_type="search_document",
        embedding_types=types,  # type: ignore[arg-type]
    )
    floats = np.array(response.embeddings.float_, np.float32)
    assert row_cosines(floats, sentence_transformer.encode(TEXTS)).min() >= 0.99999
    assert response.texts == TEXTS and response.meta.billed_units.input_tokens > len(TEXTS)
    for name in ("int8", "uint8", "binary", "ubinary"):
        expected = encode_rows(floats, Encoding[name.upper()]).astype(np.int64)
        assert np.abs(np.array(getattr(response.embeddings, name)) - expected).max() <= 1, name  # a rounding apart
    decoded = np.stack([np.frombuffer(base64.b64decode(row), "<f4") for row in response.embeddings.base64])
    np.testing.assert_allclose(decoded, floats, atol=1e-6)


def test_embed_takes_output_dimension_and_inputs(client: cohere.ClientV2, sentence_transformer) -> None:
    response = client.embed(model=EMBEDDER, texts=TEXTS, input_type="search_query", output_dimension=128)
    rows = np.array(response.embeddings.float_, np.float32)
    assert rows.shape == (len(TEXTS), 128)
    assert row_cosines(rows, sentence_transformer.encode(TEXTS, truncate_dim=128)).min() >= 0.99999
    inputs = [{"content": [{"type": "text", "text": text}]} for text in TEXTS]
    by_inputs = client.embed(model=EMBEDDER, inputs=inputs, input_type="clustering")  # type: ignore[arg-type]
    np.testing.assert_allclose(np.array(by_inputs.embeddings.float_), np.array(client.embed(
        model=EMBEDDER, texts=TEXTS, input_type="clustering").embeddings.float_), atol=1e-5)  # fmt: skip


def test_input_type_takes_the_models_prompt_of_that_role() -> None:
    prompts = {"query": "query: ", "passage": "passage: "}
    assert prompt_name(prompts, "search_query") == "query"
    assert prompt_name(prompts, "search_document") == "passage"
    assert prompt_name(prompts, "classification") is None  # then the model's default prompt, if any
    assert prompt_name({}, "search_query") is None


def test_rerank_scores_as_the_cross_encoder_best_first(client: cohere.ClientV2, reranker_dir: Path) -> None:
    from sentence_transformers import CrossEncoder

    expected = CrossEncoder(str(reranker_dir), device="cpu", max_length=LIMIT).predict([(QUERY, t) for t in TEXTS])
    response = client.rerank(model=RERANKER, query=QUERY, documents=TEXTS, top_n=2)
    assert [result.index for result in response.results] == list(np.argsort(-expected, kind="stable")[:2])
    for result in response.results:
        assert result.relevance_score == pytest.approx(float(expected[result.index]), abs=1e-5)


@pytest.mark.parametrize(
    ("call", "error", "says"),
    [
        (lambda c: c.embed(model=EMBEDDER, texts=[], input_type="search_query"), cohere.BadRequestError, "empty"),
        (lambda c: c.embed(model="nope", texts=["a"], input_type="search_query"), cohere.NotFoundError, "nope"),
        (lambda c: c.embed(model=EMBEDDER, texts=["a"], input_type="search_query", embedding_types=["int4"]),
         cohere.BadRequestError, "int4"),
        (lambda c: c.embed(model=EMBEDDER, images=["data:image/png;base64,AAAA"], input_type="image"),
         cohere.BadRequestError, "image"),
        (lambda c: c.rerank(model=EMBEDDER, query="q", documents=["a"]), cohere.BadRequestError, "task"),
        (lambda c: c.rerank(model=RERANKER, query="q", documents=["a"], max_tokens_per_doc=8),
         cohere.BadRequestError, "max_tokens_per_doc"),
        (lambda c: c.embed(model=EMBEDDER, texts=["a"], input_type="search_query", priority=1),
         cohere.BadRequestError, "priority"),
    ],
)  # fmt: skip
def test_errors_have_coheres_body(client: cohere.ClientV2, call, error, says: str) -> None:
    with pytest.raises(error) as raised:
        call(client)
    assert set(raised.value.body) == {"message"} and says in raised.value.body["message"]
