"""`--served-model-name`: the bundled model served under the names clients default to (haystack's OpenAI
embedders ask for text-embedding-3-small, langchain-openai's for text-embedding-ada-002), each accepted and each
listed by /v1/models, the first the one reported; and serve's MODEL=NAME form for several models."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import numpy as np
import openai
import pytest
from conftest import row_cosines

from bouquet.cli import served_names_by_model
from bouquet.config import ReplicaConfig
from bouquet.gateway.testing import Process, free_port, start_serve

NAMES = ("text-embedding-3-small", "text-embedding-ada-002")
TEXTS = ["packed attention without padding", "a second, longer text about serving embeddings fast"]


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    port = free_port()
    names = [arg for name in NAMES for arg in ("--served-model-name", name)]
    process: Process = start_serve(port, "--device", "cpu", "--dtype", "float32", *names)
    try:
        process.wait_ready()
        yield f"http://127.0.0.1:{port}"
    finally:
        assert process.stop() == 0


@pytest.fixture(scope="module")
def expected(sentence_transformer) -> np.ndarray:
    return sentence_transformer.encode(TEXTS, convert_to_numpy=True)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


@pytest.mark.process
def test_every_name_is_listed_and_the_first_is_reported(server: str) -> None:
    models = get(f"{server}/v1/models")
    assert [card["id"] for card in models["data"]] == list(NAMES)
    assert {card["root"] for card in models["data"]} == {"model"}  # the bundled model's directory
    info = get(f"{server}/info")
    assert info["model_id"] == info["served_model_name"] == NAMES[0]
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    assert client.models.retrieve(NAMES[1]).id == NAMES[1]


@pytest.mark.parametrize("name", [*NAMES, "all-MiniLM-L6-v2"])
@pytest.mark.process
def test_the_openai_client_embeds_under_each_name(server: str, expected: np.ndarray, name: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=60)
    response = client.embeddings.create(model=name, input=TEXTS, encoding_format="float")
    assert response.model == name  # as OpenAI answers: the name asked for
    rows = np.array([item.embedding for item in response.data], np.float32)
    assert row_cosines(rows, expected).min() >= 0.99999


@pytest.mark.process
def test_clients_default_model_names_work(server: str, expected: np.ndarray) -> None:
    from haystack.components.embedders import OpenAITextEmbedder
    from haystack.utils import Secret
    from langchain_openai import OpenAIEmbeddings

    haystack = OpenAITextEmbedder(api_key=Secret.from_token("unused"), api_base_url=f"{server}/v1", max_retries=0)
    assert haystack.model == NAMES[0]  # its default, not given here
    rows = np.array([haystack.run(text=text)["embedding"] for text in TEXTS], np.float32)
    assert row_cosines(rows, expected).min() >= 0.99999
    langchain = OpenAIEmbeddings(
        base_url=f"{server}/v1", api_key="unused", max_retries=0, check_embedding_ctx_length=False
    )
    assert langchain.model == NAMES[1]  # its default
    assert row_cosines(np.array(langchain.embed_documents(TEXTS), np.float32), expected).min() >= 0.99999


def test_serve_splits_names_per_model() -> None:
    models = ["/models/bge-small", "/models/reranker"]
    given = ["bge-small=text-embedding-3-small", "/models/reranker=rerank-v3", "bge-small=ada"]
    assert served_names_by_model(models, given) == [("text-embedding-3-small", "ada"), ("rerank-v3",)]
    assert served_names_by_model(["/m/one"], ["a", "b"]) == [("a", "b")]
    with pytest.raises(ValueError, match="MODEL=NAME"):
        served_names_by_model(models, ["bare"])
    with pytest.raises(ValueError, match="no --model called 'other'"):
        served_names_by_model(models, ["other=x"])
    with pytest.raises(ValueError, match="more than one model"):
        served_names_by_model(models, ["bge-small=x", "reranker=x"])
    with pytest.raises(ValueError, match="given twice"):
        ReplicaConfig(served_model_names=("a", "a"))
