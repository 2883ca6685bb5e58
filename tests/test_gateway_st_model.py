"""`bouquet serve` on a user's sentence-transformers model (current layout: two Dense modules, no Normalize,
prompts left out of the pooling, a 40-token limit), through the openai client and TEI's route: rows as
sentence-transformers computes them, raw unless a request asks for normalisation, and the model's width and
limit in /info."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import row_cosines
from st_models import save_sentence_transformer, tiny_bert
from test_gateway_api import post
from test_st_layouts import PROMPTS, TEXTS
from torch import nn

from bouquet.gateway.testing import Process, free_port, start_serve


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, minilm_path: Path) -> Path:
    root = tmp_path_factory.mktemp("served")
    dense = [
        {"out_features": 48, "activation_function": nn.Tanh()},
        {"out_features": 32, "bias": False, "activation_function": nn.Identity()},
    ]
    return save_sentence_transformer(
        root / "tiny-dense", tiny_bert(root / "hf", minilm_path, seed=3), pooling_mode="weightedmean",
        include_prompt=False, dense=dense, normalize=False, prompts=PROMPTS, max_seq_length=40, seed=3,
    )  # fmt: skip


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[str]:
    port = free_port()
    process: Process = start_serve(port, "--device", "cpu", "--dtype", "float32", "--model", str(model_dir))
    try:
        process.wait_ready()
        yield f"http://127.0.0.1:{port}"
    finally:
        assert process.stop() == 0


@pytest.fixture(scope="module")
def reference(model_dir: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


def assert_same_rows(rows: np.ndarray, expected: np.ndarray) -> None:
    assert rows.shape == expected.shape
    assert row_cosines(rows, expected).min() >= 0.99999
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)


def test_openai_client_gets_raw_rows_of_the_dense_chain(server: str, reference) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    response = client.embeddings.create(model="tiny-dense", input=TEXTS)
    rows = np.array([item.embedding for item in response.data], dtype=np.float32)
    assert_same_rows(rows, reference.encode(TEXTS, convert_to_numpy=True))


def test_tei_prompt_left_out_of_the_pooling(server: str, reference) -> None:
    status, body = post(f"{server}/embed", {"inputs": TEXTS, "prompt_name": "query"})
    assert status == 200
    assert_same_rows(np.array(body, dtype=np.float32), reference.encode(TEXTS, prompt_name="query"))


def test_a_request_may_still_ask_for_normalised_rows(server: str, reference) -> None:
    status, body = post(f"{server}/embed", {"inputs": TEXTS, "normalize": True})
    assert status == 200
    expected = reference.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    assert_same_rows(np.array(body, dtype=np.float32), expected)


def test_info_reports_the_served_width_and_limit(server: str) -> None:
    with urllib.request.urlopen(f"{server}/info", timeout=30) as reply:
        info = json.loads(reply.read())
    assert (info["dimension"], info["max_input_length"]) == (32, 40)
    assert info["model_type"]["embedding"]["pooling"] == "weightedmean"
