"""Jina's `/v1/multi-vector` over real HTTP against the gateway app and a real replica in this process
(tests/in_process.py), on a small PyLate-layout ColBERT model (tests/colbert_models.py): each input's token vectors
as PyLate's formula gives them (reimplemented there: PyLate's releases pin older transformers), as queries ([MASK]
expansion kept) and as documents (punctuation skipped); base64 rows; `dimensions`; the model's task refused on the
dense routes and the reverse, with the routes to use named."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from colbert_models import DOCUMENT_LENGTH, QUERY_LENGTH, build_pylate, pylate_encode
from in_process import api
from safetensors.torch import load_file
from sentence_transformers.util.quantization import quantize_embeddings
from test_colbert import _projection

from bouquet.config import EngineConfig
from bouquet.encodings import int8_rows
from bouquet.engine.engine import Engine

COLBERT = "tiny-colbert"
TEXTS = ["Packed sequences run without padding.", "What is late interaction, exactly?", "one"]


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    return build_pylate(tmp_path_factory.mktemp("colbert") / COLBERT, minilm_path)  # the directory names the model


@pytest.fixture(scope="module")
def client(colbert_dir: Path, minilm_path: Path, minilm_fp32: Engine) -> Iterator[httpx.Client]:
    engine = Engine(EngineConfig(colbert_dir, "cpu", "float32", cpu_warmup_tokens=0))
    try:
        with api([engine, minilm_fp32], model_dirs=(colbert_dir, minilm_path)) as http:
            yield http
    finally:
        engine.close()


def _theirs(colbert_dir: Path, is_query: bool) -> list[np.ndarray]:
    projection = _projection(load_file(str(colbert_dir / "1_Dense" / "model.safetensors"))["linear.weight"])
    return [vectors.numpy() for vectors in pylate_encode(colbert_dir, projection, TEXTS, is_query)]


def _least_cosine(ours: list[np.ndarray], theirs: list[np.ndarray]) -> float:
    worst = 1.0
    for mine, expected in zip(ours, theirs, strict=True):
        assert mine.shape == expected.shape
        cosines = (mine * expected).sum(1) / np.linalg.norm(mine, axis=1) / np.linalg.norm(expected, axis=1)
        worst = min(worst, float(cosines.min()))
    return worst


@pytest.mark.parametrize("input_type", ["query", "document"])
def test_token_vectors_match_pylate(client: httpx.Client, colbert_dir: Path, input_type: str) -> None:
    body = {"model": COLBERT, "input": TEXTS, "input_type": input_type}
    reply = client.post("/v1/multi-vector", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    assert answer["model"] == COLBERT and [item["index"] for item in answer["data"]] == [0, 1, 2]
    ours = [np.array(item["embeddings"], np.float32) for item in answer["data"]]
    if input_type == "query":
        assert all(len(rows) == QUERY_LENGTH for rows in ours)  # padded with [MASK], each kept as a vector
    assert _least_cosine(ours, _theirs(colbert_dir, input_type == "query")) >= 0.99999
    assert answer["usage"]["total_tokens"] > 0


def test_base64_rows_and_dimensions(client: httpx.Client, colbert_dir: Path) -> None:
    body = {"model": COLBERT, "input": [{"text": t} for t in TEXTS], "embedding_type": "base64", "dimensions": 8}
    reply = client.post("/v1/multi-vector", json=body)
    assert reply.status_code == 200, reply.text
    ours = [
        np.stack([np.frombuffer(base64.b64decode(row), "<f4") for row in item["embeddings"]])
        for item in reply.json()["data"]
    ]
    assert all(rows.shape[1] == 8 for rows in ours)
    np.testing.assert_allclose(np.linalg.norm(ours[0], axis=1), 1.0, atol=1e-5)  # cut, then normalised
    theirs = [rows[:, :8] for rows in _theirs(colbert_dir, is_query=False)]
    assert _least_cosine(ours, theirs) >= 0.99999


def test_float16_rows_in_base64(client: httpx.Client) -> None:
    """vLLM's embed_dtype on base64: each token row the base64 of its float16 bytes, the float rows' own rounding."""
    body = {"model": COLBERT, "input": TEXTS, "embedding_type": "base64"}
    halves = client.post("/v1/multi-vector", json={**body, "embed_dtype": "float16"})
    assert halves.status_code == 200, halves.text
    floats = client.post("/v1/multi-vector", json={**body, "embedding_type": "float"}).json()["data"]
    for item, expected in zip(halves.json()["data"], floats, strict=True):
        rows = np.stack([np.frombuffer(base64.b64decode(row), "<f2") for row in item["embeddings"]])
        np.testing.assert_array_equal(rows, np.array(expected["embeddings"], np.float32).astype(np.float16))


@pytest.mark.parametrize(
    ("embedding_type", "dimensions"), [("int8", None), ("uint8", None), ("binary", None), ("ubinary", None),
                                       ("int8", 12), ("ubinary", 12)],
)  # fmt: skip
def test_compact_rows_are_each_token_rows_own(
    client: httpx.Client, embedding_type: str, dimensions: int | None
) -> None:
    """Each token row encoded alone at the model's (or the asked) width, not at the step's padded one: int8 as
    bouquet's rows (round(127 x / |x|), uint8 that + 128), binary and ubinary as sentence-transformers'
    quantize_embeddings packs the float rows the route answers (12 dimensions: the last byte's low bits unused)."""
    body = {"model": COLBERT, "input": TEXTS, "dimensions": dimensions}
    floats = client.post("/v1/multi-vector", json=body)
    compact = client.post("/v1/multi-vector", json={**body, "embedding_type": embedding_type})
    assert floats.status_code == 200 and compact.status_code == 200, compact.text
    for item, expected in zip(compact.json()["data"], floats.json()["data"], strict=True):
        rows, reference = np.array(item["embeddings"]), np.array(expected["embeddings"], np.float32)
        if embedding_type in ("binary", "ubinary"):
            wanted = quantize_embeddings(reference, precision=embedding_type)
        else:
            wanted = int8_rows(reference).astype(np.int64) + (128 if embedding_type == "uint8" else 0)
        assert rows.shape == wanted.shape
        np.testing.assert_array_equal(rows, wanted)


def test_each_task_is_refused_on_the_others_routes(client: httpx.Client) -> None:
    dense = client.post("/v1/embeddings", json={"model": COLBERT, "input": "a"})
    assert dense.status_code == 400 and dense.json()["error"]["code"] == "wrong_task"
    assert "/v1/multi-vector" in dense.json()["error"]["message"]
    multi = client.post("/v1/multi-vector", json={"model": "all-MiniLM-L6-v2", "input": "a"})
    assert multi.status_code == 400 and multi.json()["error"]["code"] == "wrong_task"
    card = client.get(f"/v1/models/{COLBERT}").json()
    assert card["task"] == "multi_vector"
    listed = {card["id"]: card["task"] for card in client.get("/v1/models").json()["data"]}
    assert listed == {COLBERT: "multi_vector", "all-MiniLM-L6-v2": "embed"}
    info = client.get("/info", params={"model": COLBERT}).json()
    assert info["task"] == "multi_vector" and info["model_id"] == COLBERT
    tei = client.post("/embed", json={"model": COLBERT, "inputs": "a"})
    assert tei.status_code == 424 and "/v1/multi-vector" in tei.json()["error"], tei.text  # TEI's wrong-model status


@pytest.mark.parametrize("input_type", ["query", "document"])
def test_long_inputs_are_cut_as_pylate_cuts_them_unless_truncate_is_false(
    client: httpx.Client, colbert_dir: Path, input_type: str
) -> None:
    """Over the query or document length, an input is cut to it as PyLate's tokenize cuts it (length - 1 tokens,
    then the prefix). With `truncate: false`: over the model's limit (the document length) the 413 every route gives
    (`input_too_long`); a query over the query length but within the model's limit, the same 413."""
    long_text = " ".join(f"word{i}" for i in range(3 * DOCUMENT_LENGTH))
    body = {"model": COLBERT, "input": [long_text], "input_type": input_type}
    reply = client.post("/v1/multi-vector", json=body)
    assert reply.status_code == 200, reply.text
    ours = [np.array(reply.json()["data"][0]["embeddings"], np.float32)]
    assert len(ours[0]) == (QUERY_LENGTH if input_type == "query" else DOCUMENT_LENGTH)  # no punctuation to skip
    projection = _projection(load_file(str(colbert_dir / "1_Dense" / "model.safetensors"))["linear.weight"])
    theirs = [pylate_encode(colbert_dir, projection, [long_text], input_type == "query")[0].numpy()]
    assert _least_cosine(ours, theirs) >= 0.99999
    refused = client.post("/v1/multi-vector", json={**body, "truncate": False})
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "input_too_long", refused.text
    between = " ".join(["word"] * (QUERY_LENGTH + 4))  # over the query length, under the model's
    reply = client.post("/v1/multi-vector", json={**body, "input": [between], "truncate": False})
    if input_type == "query":
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "input_too_long", reply.text
        assert reply.json()["error"]["param"] == "input"
    else:
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": COLBERT, "input": []}, 400, "input"),
        ({"model": COLBERT, "input": ["a"], "input_type": "passage"}, 400, "input_type"),
        ({"model": COLBERT, "input": ["a"], "embedding_type": "fp8"}, 400, "embedding_type"),
        ({"model": COLBERT, "input": ["a"], "dimensions": 999}, 400, "dimensions"),
        ({"model": COLBERT, "input": ["a"], "embed_dtype": "float16"}, 400, "embed_dtype"),
        ({"model": COLBERT, "input": ["a"], "embedding_type": "base64", "embed_dtype": "int4"}, 400, "embed_dtype"),
        ({"model": COLBERT, "input": ["a"], "task": "retrieval"}, 400, "task"),
        ({"model": COLBERT, "input": [1]}, 422, "input[0]"),
    ],
)
def test_bad_requests_name_their_field(client: httpx.Client, body: dict[str, object], status: int, param: str) -> None:
    reply = client.post("/v1/multi-vector", json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_token_vectors_are_bounded_per_request(colbert_dir: Path, minilm_fp32: Engine) -> None:
    """As sparse rows are: two queries give 2 x QUERY_LENGTH vectors, over a limit of QUERY_LENGTH + 1 (413);
    one is under it."""
    engine = Engine(EngineConfig(colbert_dir, "cpu", "float32", cpu_warmup_tokens=0))
    try:
        with api([engine], model_dirs=(colbert_dir,), max_token_vectors=QUERY_LENGTH + 1) as http:
            body = {"model": COLBERT, "input": TEXTS[:2], "input_type": "query"}
            refused = http.post("/v1/multi-vector", json=body)
            assert refused.status_code == 413 and refused.json()["error"]["code"] == "too_many_token_vectors"
            assert http.post("/v1/multi-vector", json={**body, "input": TEXTS[:1]}).status_code == 200
    finally:
        engine.close()
