"""TEI's `/embed_sparse` through the gateway and replicas in this process (tests/in_process.py) on three models at once:
a SPLADE model (a masked LM saved by sentence-transformers' SparseEncoder), bge-m3's layout (dense embeddings plus
`sparse_linear.pt`) and the bundled MiniLM (no sparse head). Rows against SparseEncoder.encode and FlagEmbedding's
formula, through plain HTTP and haystack's HuggingFaceTEISparseTextEmbedder; a request chunked across steps put back in
order; what each model serves in /info and /v1/models; the routes a model cannot serve refused with the model's task
named."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from corpus import documents
from in_process import engines, served
from sparse_models import build_bge_m3, build_splade
from test_gateway_api import post
from test_sparse import FLOAT32_BOUND, assert_token_weights_match, flag_embedding_rows

from bouquet.engine.engine import Engine

TEXTS = [*documents(10), "a", "🙂 café"]
VOCAB = 30522


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sparse-served")
    splade = shutil.move(build_splade(root / "splade", minilm_path), root / "tiny-splade")
    bge_m3, _ = build_bge_m3(root / "bge", minilm_path)
    return {"tiny-splade": Path(splade), "tiny-bge-m3": Path(shutil.move(bge_m3, root / "tiny-bge-m3"))}


@pytest.fixture(scope="module")
def server(models: dict[str, Path], minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    """In process (tests/in_process.py), on a loopback port: haystack's embedder takes a URL."""
    paths = (*models.values(), minilm_path)  # the SPLADE model first: clients that name no model get it
    with (
        engines(*models.values()) as others,
        served([*others, minilm_fp32], model_dirs=paths, chunk_tokens=96, listen=True) as running,
    ):
        yield running.url


def dense_rows(answer: list[list[dict]]) -> np.ndarray:
    """TEI's answer back at vocabulary width, each row's indices checked ascending and its values positive."""
    rows = np.zeros((len(answer), VOCAB), np.float32)
    for row, entries in zip(rows, answer, strict=True):
        indices = [entry["index"] for entry in entries]
        assert indices == sorted(set(indices)) and all(entry["value"] > 0 for entry in entries)
        row[indices] = [entry["value"] for entry in entries]
    return rows


def test_splade_rows_are_sparse_encoders(server: str, models: dict[str, Path]) -> None:
    from sentence_transformers import SparseEncoder

    status, answer = post(f"{server}/embed_sparse", {"inputs": TEXTS, "model": "tiny-splade"})
    assert status == 200, answer
    expected = SparseEncoder(str(models["tiny-splade"]), device="cpu").encode(TEXTS, convert_to_tensor=True)
    expected = expected.to_dense().numpy()
    rows = dense_rows(answer)
    assert ((rows > 0) == (expected > 0)).all()  # chunks of 96 tokens: several replica calls, put back in order
    np.testing.assert_allclose(rows, expected, atol=FLOAT32_BOUND, rtol=FLOAT32_BOUND)
    status, one = post(f"{server}/embed_sparse", {"inputs": TEXTS[3], "model": "tiny-splade"})
    assert status == 200 and len(one) == 1
    np.testing.assert_allclose(dense_rows(one)[0], expected[3], atol=FLOAT32_BOUND, rtol=FLOAT32_BOUND)


def test_bge_m3_gives_sparse_rows_beside_its_embeddings(server: str, models: dict[str, Path]) -> None:
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer

    model_dir = models["tiny-bge-m3"]
    status, answer = post(f"{server}/embed_sparse", {"inputs": TEXTS, "model": "tiny-bge-m3"})
    assert status == 200, answer
    ids = AutoTokenizer.from_pretrained(str(model_dir))(TEXTS, truncation=True, max_length=64)["input_ids"]
    sparse_linear = _sparse_linear(model_dir)
    assert_token_weights_match(dense_rows(answer), flag_embedding_rows(model_dir, sparse_linear, ids), "float32")
    status, embeddings = post(f"{server}/embed", {"inputs": TEXTS, "model": "tiny-bge-m3"})
    assert status == 200
    expected = SentenceTransformer(str(model_dir), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(np.array(embeddings, np.float32), expected, atol=1e-5)


def _sparse_linear(model_dir: Path):
    import torch

    linear = torch.nn.Linear(64, 1)
    linear.load_state_dict(torch.load(model_dir / "sparse_linear.pt", weights_only=True))
    return linear.eval()


def test_haystacks_tei_sparse_embedder(server: str, models: dict[str, Path]) -> None:
    pytest.importorskip("haystack_integrations.components.embedders.huggingface_api")
    from haystack_integrations.components.embedders.huggingface_api import HuggingFaceTEISparseTextEmbedder
    from sentence_transformers import SparseEncoder

    embedder = HuggingFaceTEISparseTextEmbedder(api_base_url=server)
    embedder.warm_up()
    sparse = embedder.run(text=TEXTS[0])["sparse_embedding"]
    expected = SparseEncoder(str(models["tiny-splade"]), device="cpu").encode([TEXTS[0]], convert_to_tensor=True)
    expected = expected.to_dense().numpy()[0]
    assert sparse.indices == np.flatnonzero(expected).tolist()
    np.testing.assert_allclose(sparse.values, expected[sparse.indices], atol=FLOAT32_BOUND, rtol=FLOAT32_BOUND)


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as reply:
        return json.loads(reply.read())


def test_info_and_models_say_what_each_model_serves(server: str) -> None:
    splade, bge, minilm = (_get(f"{server}/info?model={name}") for name in ("tiny-splade", "tiny-bge-m3", "model"))
    assert (splade["task"], splade["sparse"], splade["model_type"]) == (
        "sparse",
        True,
        {"embedding": {"pooling": "splade"}},
    )
    assert (bge["task"], bge["sparse"], minilm["task"], minilm["sparse"]) == ("embed", True, "embed", False)
    cards = {card["id"]: card for card in _get(f"{server}/v1/models")["data"]}
    assert (cards["tiny-splade"]["sparse"], cards["tiny-bge-m3"]["sparse"], cards["all-MiniLM-L6-v2"]["sparse"]) == (
        True, True, False,
    )  # fmt: skip


def test_routes_a_model_cannot_serve_name_its_task(server: str) -> None:
    status, error = post(f"{server}/embed_sparse", {"inputs": "a", "model": "all-MiniLM-L6-v2"})
    assert (status, error["error_type"]) == (424, "Backend") and "task 'embed'" in error["error"]
    status, error = post(f"{server}/embed", {"inputs": "a", "model": "tiny-splade"})
    assert (status, error["error_type"]) == (424, "Backend") and "/embed_sparse" in error["error"]
    status, error = post(f"{server}/v1/embeddings", {"input": "a", "model": "tiny-splade"})
    assert (status, error["error"]["code"]) == (400, "wrong_task") and "task 'sparse'" in error["error"]["message"]
    status, error = post(f"{server}/rerank", {"query": "a", "texts": ["b"], "model": "tiny-splade"})
    assert status == 424 and "task 'sparse'" in error["error"]


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({"inputs": []}, 400, "Empty"),
        ({"inputs": ["a", ""]}, 400, "Empty"),
        ({"inputs": "a", "normalize": True}, 422, "Validation"),  # not a field of TEI's /embed_sparse
        ({"inputs": "a", "dimensions": 8}, 422, "Validation"),
        ({"inputs": ["a", [101, 102]]}, 422, "Validation"),  # texts and token ids in one batch
        ({"inputs": 5}, 422, "Validation"),
    ],
)
def test_bad_bodies_get_teis_errors(server: str, body: dict, status: int, error_type: str) -> None:
    answer_status, error = post(f"{server}/embed_sparse", body)
    assert (answer_status, error["error_type"]) == (status, error_type), error
