"""The gateway in front of two models at once (in this process, tests/in_process.py), each on its own replica, routed by
name: a user's sentence-transformers model (current layout: two Dense modules, no Normalize, prompts left out of the
pooling, a 40-token limit) and the bundled MiniLM. Through the openai client and TEI's route: rows as
sentence-transformers computes them, raw unless a request asks for normalisation; each model's family, pooling, width
and limit in /info and /v1/models."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import pytest
from conftest import row_cosines
from family_models import save_sentence_transformer
from in_process import engines, served
from st_models import tiny_bert
from test_gateway_api import post
from test_st_layouts import PROMPTS, TEXTS
from torch import nn

from bouquet.engine.engine import Engine


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
def server(model_dir: Path, minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    """In process (tests/in_process.py): a replica per model, the gateway app on a loopback port."""
    with (
        engines(model_dir) as tiny,
        served([*tiny, minilm_fp32], model_dirs=(model_dir, minilm_path), listen=True) as running,
    ):
        yield running.url


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
    status, body = post(f"{server}/embed", {"inputs": TEXTS, "prompt_name": "query", "model": "tiny-dense"})
    assert status == 200
    assert_same_rows(np.array(body, dtype=np.float32), reference.encode(TEXTS, prompt_name="query"))


def test_a_request_may_still_ask_for_normalised_rows(server: str, reference) -> None:
    status, body = post(f"{server}/embed", {"inputs": TEXTS, "normalize": True, "model": "tiny-dense"})
    assert status == 200
    expected = reference.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    assert_same_rows(np.array(body, dtype=np.float32), expected)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def test_info_reports_the_served_width_and_limit(server: str) -> None:
    info = _get(f"{server}/info?model=tiny-dense")
    assert (info["dimension"], info["max_input_length"], info["family"]) == (32, 40, "bert")
    assert info["model_type"]["embedding"]["pooling"] == "weightedmean"


def test_models_lists_each_model_with_its_shape(server: str) -> None:
    cards = {card["id"]: card for card in _get(f"{server}/v1/models")["data"]}
    assert set(cards) == {"tiny-dense", "all-MiniLM-L6-v2"}
    tiny, minilm = cards["tiny-dense"], cards["all-MiniLM-L6-v2"]
    assert (tiny["family"], tiny["pooling"], tiny["dimension"], tiny["max_input_length"]) == (
        "bert",
        "weightedmean",
        32,
        40,
    )
    assert (minilm["pooling"], minilm["dimension"], minilm["max_input_length"], minilm["normalize"]) == (
        "mean",
        384,
        256,
        True,
    )
    assert _get(f"{server}/v1/models/sentence-transformers/all-MiniLM-L6-v2")["id"] == "all-MiniLM-L6-v2"


def test_each_model_is_routed_to_its_replica(server: str, reference, sentence_transformer) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)
    for model, expected in (("all-MiniLM-L6-v2", sentence_transformer), ("tiny-dense", reference)):
        rows = [item.embedding for item in client.embeddings.create(model=model, input=TEXTS).data]
        assert_same_rows(np.array(rows, dtype=np.float32), expected.encode(TEXTS, convert_to_numpy=True))
