"""bge-m3's three outputs in one request and its weighted score (issue 28), on a tiny random-weight bge-m3 with both
of FlagEmbedding's heads (tests/flag_m3.py), against FlagEmbedding's formulas (reimplemented there; the module says
why FlagEmbedding itself is not imported): `POST /encode` (dense, lexical weights, ColBERT vectors from one forward),
`/score` and `/rerank` (compute_score's 'colbert+sparse+dense', weights from the request or [1, 1, 1]),
`/compute_score` (compute_score's five keys), the combined path in bfloat16 within the issue's bound, through the
gateway and real replicas in this process (tests/in_process.py), and the `cohere` SDK's ClientV2. Also: a step
mixing all-outputs sequences with plain and token-vector ones gives each the rows it gives alone, lexical weights
and their dot products on the host, and the refusals (a model without colbert_linear.pt, one without
sparse_linear.pt, bad weights, the replica's own checks)."""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from pathlib import Path

import cohere
import httpx
import numpy as np
import pytest
from corpus import documents
from flag_m3 import FlagM3, build_m3, cosines
from in_process import BASE_URL, api, engines

from bouquet import sparse_rows
from bouquet.batch import Batch, RowOptions
from bouquet.engine.engine import Engine
from bouquet.replica.client import embed_request
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.tokenizer import TextTokenizer

M3, SPARSE_ONLY = "tiny-bge-m3", "tiny-bge-m3-sparse"
TEXTS = [*documents(5), "a", "🙂 café", "the cat and the hat and the bat and the cat"]  # [UNK]; repeated ids
QUERY = "the cat in the hat"
COSINE = 0.99999  # float32, per vector
BOUND = 1e-5  # sparse weights and scores
# and relative to them: float32 rounding over six layers and a sum of many token weights (a lexical score reaches ~10)
RELATIVE = 2e-6


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bge-m3-outputs")
    return {M3: build_m3(root, minilm_path, M3), SPARSE_ONLY: build_m3(root, minilm_path, SPARSE_ONLY, colbert=False)}


@pytest.fixture(scope="module")
def m3_engines(model_dirs: dict[str, Path]) -> Iterator[list[Engine]]:
    with engines(*model_dirs.values()) as built:
        yield built


@pytest.fixture(scope="module")
def client(m3_engines: list[Engine], model_dirs: dict[str, Path], minilm_path: Path, minilm_fp32: Engine):
    with api([*m3_engines, minilm_fp32], model_dirs=(*model_dirs.values(), minilm_path), chunk_tokens=96) as http:
        yield http


@pytest.fixture(scope="module")
def flag(model_dirs: dict[str, Path]) -> FlagM3:
    return FlagM3(model_dirs[M3])


def test_encode_gives_flag_embeddings_three_outputs(client: httpx.Client, flag: FlagM3) -> None:
    """Eight texts over chunks of 96 tokens: several replica calls, put back in order."""
    body = {"model": M3, "sentences": TEXTS, "return_dense": True, "return_sparse": True, "return_colbert_vecs": True}
    reply = client.post("/encode", json=body)
    assert reply.status_code == 200, reply.text
    ours, theirs = reply.json(), flag.encode(TEXTS)
    assert cosines(ours["dense_vecs"], np.array(theirs["dense_vecs"])).min() >= COSINE
    for mine, expected in zip(ours["lexical_weights"], theirs["lexical_weights"], strict=True):
        assert mine.keys() == expected.keys()
        np.testing.assert_allclose([mine[key] for key in expected], list(expected.values()), atol=BOUND, rtol=RELATIVE)
    for mine, expected in zip(ours["colbert_vecs"], theirs["colbert_vecs"], strict=True):
        assert np.shape(mine) == expected.shape
        assert cosines(mine, expected).min() >= COSINE
    tokens = sum(len(flag.tokenizer(text, max_length=64, truncation=True)["input_ids"]) for text in TEXTS)
    assert ours["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    pairs = zip(ours["lexical_weights"], ours["colbert_vecs"], strict=True)
    assert any(len(weights) < len(vectors) for weights, vectors in pairs)  # repeated and special ids: fewer weights


def test_encode_answers_only_what_is_asked_and_in_base64(client: httpx.Client, flag: FlagM3) -> None:
    """FlagEmbedding's defaults (dense only); base64 rows are little-endian float32; `input` names the texts too."""
    reply = client.post("/encode", json={"model": M3, "input": TEXTS[:2]})
    assert reply.status_code == 200, reply.text
    assert reply.json()["lexical_weights"] is None and reply.json()["colbert_vecs"] is None
    body = {"model": M3, "sentences": QUERY, "return_dense": False, "return_colbert_vecs": True,
            "encoding_format": "base64", "max_length": 4}  # fmt: skip
    answer = client.post("/encode", json=body).json()
    assert answer["dense_vecs"] is None and answer["lexical_weights"] is None
    vectors = np.array([np.frombuffer(base64.b64decode(row), "<f4") for row in answer["colbert_vecs"][0]])
    expected = flag.encode([QUERY], max_length=4)["colbert_vecs"][0]
    assert vectors.shape == (3, 64) and cosines(vectors, expected).min() >= COSINE


@pytest.mark.parametrize("weights", [None, [0.4, 0.2, 0.4], [0, 1, 0]])
def test_score_and_rerank_give_compute_scores_weighted_sum(
    client: httpx.Client, flag: FlagM3, weights: list[float] | None
) -> None:
    pairs = [(QUERY, text) for text in TEXTS]
    expected = flag.compute_score(pairs, weights)["colbert+sparse+dense"]
    extra = {} if weights is None else {"weights_for_different_modes": weights}
    reply = client.post("/score", json={"model": M3, "text_1": QUERY, "text_2": TEXTS, **extra})
    assert reply.status_code == 200, reply.text
    scores = [item["score"] for item in sorted(reply.json()["data"], key=lambda item: item["index"])]
    np.testing.assert_allclose(scores, expected, atol=BOUND, rtol=RELATIVE)
    ranked = client.post("/rerank", json={"model": M3, "query": QUERY, "texts": TEXTS, **extra}).json()
    assert sorted(item["index"] for item in ranked) == list(range(len(TEXTS)))
    assert all(first["score"] >= then["score"] for first, then in itertools.pairwise(ranked))  # best first
    np.testing.assert_allclose([item["score"] for item in ranked], [expected[item["index"]] for item in ranked],
                               atol=BOUND, rtol=RELATIVE)  # fmt: skip


def test_each_mode_alone_is_compute_scores(client: httpx.Client, flag: FlagM3) -> None:
    """Dense, sparse and ColBERT alone by their weights; several queries in one /score (one replica call each)."""
    queries = [QUERY, "packed sequences", QUERY]
    pairs = list(zip(queries, TEXTS[:3], strict=True))
    expected = flag.compute_score(pairs)
    for mode, weights in (("dense", [1, 0, 0]), ("sparse", [0, 1, 0]), ("colbert", [0, 0, 1])):
        body = {"model": M3, "text_1": queries, "text_2": TEXTS[:3], "weights_for_different_modes": weights}
        data = client.post("/score", json=body).json()["data"]
        np.testing.assert_allclose([item["score"] for item in data], expected[mode], atol=BOUND, rtol=RELATIVE)


MODES = ("colbert", "sparse", "dense", "sparse+dense", "colbert+sparse+dense")  # compute_score's keys


@pytest.mark.parametrize("weights", [None, [0.4, 0.2, 0.4]])
def test_compute_score_gives_flag_embeddings_five_scores(
    client: httpx.Client, flag: FlagM3, weights: list[float] | None
) -> None:
    """/compute_score answers compute_score's dict: lists for a list of pairs (several queries), each key within
    the bound of FlagEmbedding's formula, the query and passage limits applied to each side."""
    pairs = [(QUERY, text) for text in TEXTS] + [("packed sequences", TEXTS[0])]
    extra = {} if weights is None else {"weights_for_different_modes": weights}
    body = {"model": M3, "sentence_pairs": [list(pair) for pair in pairs], "max_query_length": 5,
            "max_passage_length": 12, **extra}  # fmt: skip
    reply = client.post("/compute_score", json=body)
    assert reply.status_code == 200, reply.text
    answer = reply.json()
    expected = flag.compute_score(pairs, weights, max_length=5, max_passage_length=12)
    assert set(answer) == {*MODES, "model", "usage"} and answer["model"] == M3 and answer["usage"]["total_tokens"]
    for mode in MODES:
        np.testing.assert_allclose(answer[mode], expected[mode], atol=BOUND, rtol=RELATIVE, err_msg=mode)


def test_compute_score_of_one_pair_answers_numbers(client: httpx.Client, flag: FlagM3) -> None:
    """One pair, as FlagEmbedding takes it, answers one number a key; a 'sparse+dense' of weights (0, 0, w) is not a
    number in FlagEmbedding, null here."""
    body = {"model": M3, "sentence_pairs": [QUERY, TEXTS[0]], "weights_for_different_modes": [0, 0, 1]}
    answer = client.post("/compute_score", json=body).json()
    expected = flag.compute_score([(QUERY, TEXTS[0])], [0, 0, 1])
    assert answer["sparse+dense"] is None and np.isnan(expected["sparse+dense"][0])
    for mode in ("colbert", "sparse", "dense", "colbert+sparse+dense"):
        assert isinstance(answer[mode], float)
        assert answer[mode] == pytest.approx(expected[mode][0], abs=BOUND, rel=RELATIVE)
    assert answer["colbert+sparse+dense"] == pytest.approx(answer["colbert"], abs=1e-6)


@pytest.mark.parametrize(
    ("model", "pairs", "param"),
    [
        (M3, ["just one text"], "sentence_pairs"),
        (M3, [["a", "b"], "c"], "sentence_pairs"),
        (M3, [["a", "b", "c"]], "sentence_pairs"),
        (M3, [], "sentence_pairs"),
        (M3, [["a", ""]], "sentence_pairs"),
        (SPARSE_ONLY, [["a", "b"]], "model"),
        ("all-MiniLM-L6-v2", [["a", "b"]], "model"),
    ],
)
def test_bad_compute_score_bodies_are_refused(client: httpx.Client, model: str, pairs: list, param: str) -> None:
    reply = client.post("/compute_score", json={"model": model, "sentence_pairs": pairs})
    assert 400 <= reply.status_code < 500, reply.text
    error = reply.json()["error"]
    assert error["param"] == param or param in error["message"], error


@pytest.mark.parametrize("field", ["max_query_length", "max_passage_length", "weights_for_different_modes"])
def test_bad_compute_score_options_are_refused(client: httpx.Client, field: str) -> None:
    value = [1, -1, 1] if field == "weights_for_different_modes" else 1
    reply = client.post("/compute_score", json={"model": M3, "sentence_pairs": ["a", "b"], field: value})
    assert 400 <= reply.status_code < 500, reply.text
    assert field in reply.json()["error"]["param"], reply.json()


def test_one_step_mixes_all_outputs_with_other_sequences(m3_engines: list[Engine], model_dirs: dict[str, Path]):
    """All-outputs sequences beside plain and token-vector ones in one step: each kind's rows as it gets them alone."""
    engine = m3_engines[0]
    ids = TextTokenizer(model_dirs[M3] / "tokenizer.json", max_length=64).encode(TEXTS)
    spans = [[(i, i + 1) for i in range(1, len(sequence))] for sequence in ids]
    parts = [
        Batch.pack(ids[:3]),
        Batch.pack(ids, RowOptions(token_vectors=True, all_outputs=True), spans=spans),
        Batch.pack(ids[2:5], RowOptions(token_vectors=True), spans=spans[2:5]),
        Batch.pack(ids[:2], RowOptions(all_outputs=True), spans=spans[:2]),
    ]
    mixed = engine.embed(Batch.concat(parts))
    start = 0
    for part in parts:
        alone = engine.embed(part)
        # a step's size picks its float32 linears' kernel (short steps: layers/f32_short.py), whose sums round
        # apart from oneDNN's by ~1e-6 relative
        np.testing.assert_allclose(mixed[start : start + len(alone), : alone.shape[1]], alone, atol=1e-6, rtol=1e-5)
        start += len(alone)
    assert start == len(mixed)


def test_a_model_without_a_head_is_refused(client: httpx.Client, minilm_path: Path) -> None:
    body = {"model": SPARSE_ONLY, "sentences": ["a"], "return_sparse": True, "return_colbert_vecs": True}
    reply = client.post("/encode", json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "return_colbert_vecs" and "colbert_linear.pt" in reply.text
    sparse = client.post("/encode", json={**body, "return_colbert_vecs": False})  # dense and sparse: still served
    assert sparse.status_code == 200 and len(sparse.json()["lexical_weights"]) == 1
    minilm = client.post("/encode", json={"model": minilm_path.name, "sentences": ["a"]})  # no sparse head at all
    assert minilm.status_code == 400 and minilm.json()["error"]["code"] == "wrong_task"
    for path, extra in (("/score", {"text_1": "a", "text_2": ["b"]}), ("/rerank", {"query": "a", "texts": ["b"]})):
        reply = client.post(path, json={"model": SPARSE_ONLY, **extra})
        assert reply.status_code in (400, 424) and "makes no scores" in reply.text, reply.text


def test_colbert_vectors_are_bounded_per_request(
    client: httpx.Client, m3_engines: list[Engine], model_dirs: dict[str, Path]
) -> None:
    """`--max-token-vectors` bounds /encode's colbert_vecs as it bounds /v1/multi-vector's: a request of exactly
    the limit is served, one vector over it is a 413; dense and sparse alone are not bounded by it."""
    body = {"model": M3, "sentences": ["What is BGE M3?", "BM25 is a bag-of-words retrieval function"],
            "return_sparse": True, "return_colbert_vecs": True}  # fmt: skip
    served = client.post("/encode", json=body)
    assert served.status_code == 200, served.text
    vectors = sum(map(len, served.json()["colbert_vecs"]))
    with api(m3_engines[:1], model_dirs=(model_dirs[M3],), max_token_vectors=vectors) as http:
        assert http.post("/encode", json=body).status_code == 200
    with api(m3_engines[:1], model_dirs=(model_dirs[M3],), max_token_vectors=vectors - 1) as http:
        refused = http.post("/encode", json=body)
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "too_many_token_vectors"
        assert refused.json()["error"]["param"] == "sentences"  # the route's own field
        assert http.post("/encode", json={**body, "return_colbert_vecs": False}).status_code == 200


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"sentences": ["a"], "input": ["b"]}, "sentences"),
        ({"sentences": ["a"], "return_dense": False}, "return_dense"),
        ({"sentences": ["a"], "max_length": 1}, "max_length"),
        ({"sentences": ["a"], "encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_bad_encode_bodies_are_refused(client: httpx.Client, body: dict, param: str) -> None:
    reply = client.post("/encode", json={"model": M3, **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


@pytest.mark.parametrize("weights", [[1, 1], [-1, 1, 1], [0, 0, 0]])
def test_bad_weights_are_refused(client: httpx.Client, weights: list[float], minilm_path: Path) -> None:
    body = {"model": M3, "text_1": "a", "text_2": ["b"], "weights_for_different_modes": weights}
    reply = client.post("/score", json=body)
    assert reply.status_code in (400, 422) and "weights_for_different_modes" in reply.text, reply.text
    body = {"model": minilm_path.name, "text_1": "a", "text_2": ["b"], "weights_for_different_modes": [1, 1, 1]}
    reply = client.post("/score", json=body)  # the bundled MiniLM: not a bge-m3
    assert reply.status_code == 400 and "wrong_task" in reply.text, reply.text


@pytest.mark.parametrize(
    ("options", "spans", "maxsim", "problem"),
    [
        (RowOptions(all_outputs=True), [[(1, 3)], [(1, 2)]], False, "every span is one token"),
        (RowOptions(all_outputs=True, dimensions=8), [[(1, 2)], [(1, 2)]], False, "full width"),
        (RowOptions(all_outputs=True), [[(1, 2)], [(1, 2)]], True, "set token_vectors"),
    ],
)
def test_the_replica_refuses_all_outputs_it_cannot_give(
    m3_engines: list[Engine], options: RowOptions, spans: list, maxsim: bool, problem: str
) -> None:
    message = embed_request(Batch.pack([[101, 7, 8, 102], [101, 9, 102]], options, spans=spans), maxsim=maxsim)
    with pytest.raises(InvalidInput, match=problem):
        decode_request(message, Limits.from_engine(m3_engines[0]))


def test_a_model_without_token_weights_refuses_all_outputs(minilm_fp32: Engine) -> None:
    batch = Batch.pack([[101, 7, 102]], RowOptions(all_outputs=True), spans=[[(1, 2)]])
    with pytest.raises(InvalidInput, match="no token-weight sparse head"):
        decode_request(embed_request(batch), Limits.from_engine(minilm_fp32))


def test_lexical_weights_keep_each_ids_largest_and_leave_out_special_ids() -> None:
    rows = np.array([0, 0, 0, 0, 1, 1, 2])
    ids = np.array([7, 5, 7, 3, 3, 9, 9])
    weights = np.array([0.2, 0.5, 0.4, 0.9, 0.0, 0.3, 0.6], np.float32)
    sparse = sparse_rows.max_by_id(rows, ids, weights, 4, skip_ids=(3,))  # row 3 has no tokens
    assert sparse.cu_offsets.tolist() == [0, 2, 3, 4, 4]  # row 1: a zero weight and a special id, 9 kept
    assert [sparse.row(index)[0].tolist() for index in range(4)] == [[5, 7], [9], [9], []]
    np.testing.assert_allclose(sparse.values, [0.5, 0.4, 0.3, 0.6])
    np.testing.assert_allclose(sparse_rows.dot(sparse), [0.41, 0.0, 0.0, 0.0], rtol=1e-6)
    np.testing.assert_allclose(sparse_rows.dot(sparse, 1), [0.0, 0.09, 0.18, 0.0], rtol=1e-6)
    np.testing.assert_allclose(sparse_rows.dot(sparse, 3), [0, 0, 0, 0])  # an empty row shares nothing


def test_cohere_client_v2_reranks_a_bge_m3(m3_engines: list[Engine], model_dirs: dict[str, Path], flag: FlagM3):
    """The `cohere` SDK's ClientV2 against /v2/rerank: compute_score's 'colbert+sparse+dense', default weights."""
    expected = np.array(flag.compute_score([(QUERY, text) for text in TEXTS])["colbert+sparse+dense"])
    with api(m3_engines[:1], model_dirs=(model_dirs[M3],), api_key="co-key") as http:
        client = cohere.ClientV2(api_key="co-key", base_url=BASE_URL, httpx_client=http, timeout=60)
        response = client.rerank(model=M3, query=QUERY, documents=TEXTS, top_n=3)
    assert [result.index for result in response.results] == list(np.argsort(-expected)[:3])
    for result in response.results:
        assert result.relevance_score == pytest.approx(float(expected[result.index]), abs=BOUND, rel=RELATIVE)


BFLOAT16_BOUND = 1e-2  # the issue's: 1 - cosine, per vector
# compute_score's scores in bfloat16, as a share of the mode's largest: a dense or ColBERT score is the dot product
# of two bfloat16 vectors, each within 1e-4 of cosine here (~1% off in direction); a sparse score sums products of
# two forwards' token weights, each off by ~1% (docs/late-interaction.md has the measured errors).
SCORE_BOUNDS = {"dense": 2e-2, "colbert": 2e-2, "sparse": 3e-2, "sparse+dense": 3e-2, "colbert+sparse+dense": 3e-2}


def _sparse_cosines(ours: list[dict[str, float]], theirs: list[dict[str, float]]) -> np.ndarray:
    """Each text's lexical weights as vectors over the ids either side has (a weight near zero may drop out)."""
    values = []
    for mine, expected in zip(ours, theirs, strict=True):
        ids = sorted({*mine, *expected})
        rows = np.array([[mine.get(i, 0.0) for i in ids], [expected.get(i, 0.0) for i in ids]])
        values.append(cosines(rows[:1], rows[1:])[0])
    return np.array(values)


def test_bfloat16_all_outputs_stay_within_the_bound(model_dirs: dict[str, Path], flag: FlagM3) -> None:
    """The combined path (dense, sparse and ColBERT from one forward) in bfloat16 against FlagEmbedding's float32:
    each dense row, each text's lexical weights and each token vector within 1e-2 of cosine, and compute_score's
    five scores within SCORE_BOUNDS."""
    with engines(model_dirs[M3], dtype="bfloat16") as built, api(built, model_dirs=(model_dirs[M3],)) as http:
        body = {"model": M3, "sentences": TEXTS, "return_sparse": True, "return_colbert_vecs": True}
        ours = http.post("/encode", json=body).json()
        pairs = [(QUERY, text) for text in TEXTS]
        scores = http.post("/compute_score", json={"model": M3, "sentence_pairs": [list(p) for p in pairs]}).json()
    theirs = flag.encode(TEXTS)
    vectors = zip(ours["colbert_vecs"], theirs["colbert_vecs"], strict=True)
    worst = {
        "dense": cosines(ours["dense_vecs"], np.array(theirs["dense_vecs"])).min(),
        "sparse": _sparse_cosines(ours["lexical_weights"], theirs["lexical_weights"]).min(),
        "colbert": min(cosines(mine, expected).min() for mine, expected in vectors),
    }
    print("least cosines (bfloat16):", {key: f"{value:.5f}" for key, value in worst.items()})
    assert min(worst.values()) >= 1 - BFLOAT16_BOUND, worst
    expected = flag.compute_score(pairs)
    for mode in MODES:
        scale = np.abs(expected[mode]).max()
        error = np.abs(np.array(scores[mode]) - expected[mode]).max() / scale
        print(f"{mode}: largest error {error:.5f} of {scale:.3f}")
        assert error <= SCORE_BOUNDS[mode], mode
