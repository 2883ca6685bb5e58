"""jina-colbert-v2's layout served (issue 28 item 1): a tiny JinaEmbeddingsV3Model saved by transformers in the real
layout (tests/colbert_models.py's `build_jina_colbert`: HF_ColBERT, Jina's rotary XLM-R config, `linear.weight`
beside the encoder, its marker tokens) behind the gateway app and a real replica in this process
(tests/in_process.py): Jina's `/v1/multi-vector` gives each input's token vectors as PyLate lays the model out on
transformers' forward (markers, queries padded with the mask token and attending to it, documents without their
punctuation), and TEI's `/rerank` and vLLM's `/score` give PyLate's MaxSim of those vectors; embcli-jina, a client of
Jina's API, reads the same vectors over a real socket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from colbert_models import JINA_MARKERS, QUERY_LENGTH, build_jina_colbert, pylate_encode
from in_process import api, served
from safetensors.torch import load_file
from test_colbert import _projection
from test_colbert_scores import DOCUMENTS, QUERY
from test_multi_vector_api import TEXTS, _least_cosine

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

JINA = "tiny-jina-colbert-v2"


@pytest.fixture(scope="module")
def jina_colbert(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> tuple[Path, torch.nn.Module]:
    return build_jina_colbert(tmp_path_factory.mktemp("jina") / JINA, minilm_path)  # the directory names the model


@pytest.fixture(scope="module")
def engine(jina_colbert: tuple[Path, torch.nn.Module]) -> Iterator[Engine]:
    engine = Engine(EngineConfig(jina_colbert[0], "cpu", "float32", cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine: Engine, jina_colbert: tuple[Path, torch.nn.Module]) -> Iterator[httpx.Client]:
    with api([engine], model_dirs=(jina_colbert[0],)) as http:
        yield http


def _reference(jina_colbert: tuple[Path, torch.nn.Module], texts: list[str], is_query: bool) -> list[np.ndarray]:
    model_dir, encoder = jina_colbert
    projection = _projection(load_file(str(model_dir / "model.safetensors"))["linear.weight"])
    vectors = pylate_encode(model_dir, projection, texts, is_query, True, JINA_MARKERS, encoder)
    return [rows.numpy() for rows in vectors]


@pytest.mark.parametrize("input_type", ["query", "document"])
def test_multi_vector_route_matches_the_library(client: httpx.Client, jina_colbert, input_type: str) -> None:
    reply = client.post("/v1/multi-vector", json={"model": JINA, "input": TEXTS, "input_type": input_type})
    assert reply.status_code == 200, reply.text
    ours = [np.array(item["embeddings"], np.float32) for item in reply.json()["data"]]
    if input_type == "query":
        assert all(len(rows) == QUERY_LENGTH for rows in ours)
    assert _least_cosine(ours, _reference(jina_colbert, TEXTS, input_type == "query")) >= 0.99999


def _maxsim(jina_colbert, query: str, documents: list[str]) -> np.ndarray:
    query_vectors = _reference(jina_colbert, [query], True)[0]
    return np.array([(query_vectors @ rows.T).max(1).sum() for rows in _reference(jina_colbert, documents, False)])


def test_rerank_and_score_give_the_librarys_maxsim(client: httpx.Client, jina_colbert) -> None:
    expected = _maxsim(jina_colbert, QUERY, DOCUMENTS)
    reply = client.post("/rerank", json={"model": JINA, "query": QUERY, "texts": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    ranked = reply.json()
    assert [item["index"] for item in ranked] == list(np.argsort(-expected))
    np.testing.assert_allclose([item["score"] for item in ranked], expected[[item["index"] for item in ranked]],
                               rtol=1e-5)  # fmt: skip
    reply = client.post("/score", json={"model": JINA, "text_1": QUERY, "text_2": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    scores = [item["score"] for item in sorted(reply.json()["data"], key=lambda item: item["index"])]
    np.testing.assert_allclose(scores, expected, rtol=1e-5)


def test_embcli_jina_client_reads_the_token_vectors(
    engine: Engine, jina_colbert, monkeypatch: pytest.MonkeyPatch
) -> None:
    """embcli-jina's JinaEmbeddingModel (the pip-installable client found that speaks /v1/multi-vector) over a real
    loopback socket, the model served under the name it sends: its body (model, input, input_type, dimensions), its
    bearer key, and its reading of `data[].embeddings`, which yields each input's token rows in turn (its `embed`
    keeps the first row only: a single-vector interface)."""
    from embcli_jina.jina import JinaEmbeddingModel

    monkeypatch.setenv("JINA_API_KEY", "jina-key")
    with served([engine], ("jina-colbert-v2",), listen=True, api_key="jina-key") as running:
        model = JinaEmbeddingModel("jina-colbert-v2")
        model.endpoint = f"{running.url}/v1/multi-vector"  # the library's table names api.jina.ai's route only
        queries = np.array(list(model.embed_batch(TEXTS, None, input_type="query")), np.float32)
        documents = np.array(list(model.embed_batch_for_ingest(DOCUMENTS, 3)), np.float32)  # two requests
        narrow = np.array(list(model.embed_batch_for_ingest(DOCUMENTS[:1], None, dimensions=8)), np.float32)
        first = np.array(model.embed_for_search(QUERY), np.float32)
    expected_queries = np.concatenate(_reference(jina_colbert, TEXTS, True))
    expected_documents = _reference(jina_colbert, DOCUMENTS, False)
    assert _least_cosine([queries], [expected_queries]) >= 0.99999
    assert _least_cosine([documents], [np.concatenate(expected_documents)]) >= 0.99999
    assert narrow.shape == (len(expected_documents[0]), 8)
    assert _least_cosine([narrow], [expected_documents[0][:, :8]]) >= 0.99999
    assert _least_cosine([first[None]], [_reference(jina_colbert, [QUERY], True)[0][:1]]) >= 0.99999
