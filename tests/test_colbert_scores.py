"""A ColBERT model reranks on the replicas (issue 28 item 3): TEI's `/rerank`, Cohere's `/v2/rerank` through the real
`cohere` SDK's ClientV2, and vLLM's `/score` with several queries, against the gateway app and a real replica in
this process (tests/in_process.py), on a small PyLate-layout model. Each score is PyLate's MaxSim (`colbert_scores`:
for each query token vector, its largest dot product with the document's vectors, summed) of the vectors PyLate's
formula gives (tests/colbert_models.py); documents split over several chunks, each with its own copy of the query,
score the same; the replica refuses a MaxSim request it cannot score."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import cohere
import grpc
import httpx
import numpy as np
import pytest
from colbert_models import build_pylate, pylate_encode
from in_process import BASE_URL, api, served
from safetensors.torch import load_file
from test_colbert import _projection

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.late_interaction import lay_out, pack, token_limit
from bouquet.proto import embedding_pb2_grpc
from bouquet.replica.client import embed_request
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.replica.server import multi_vector_info
from bouquet.scoring import maxsim
from bouquet.tokenizer import TextTokenizer

COLBERT = "tiny-colbert"
QUERY = "What is late interaction, exactly?"
DOCUMENTS = [
    "Late interaction keeps a vector per token and matches each query token to its best document token.",
    "Packed sequences run without padding.",
    "one",
    "ColBERT scores a document by the sum of each query token's largest similarity: MaxSim, it is called.",
]


@pytest.fixture(scope="module")
def colbert_dir(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    return build_pylate(tmp_path_factory.mktemp("colbert-scores") / COLBERT, minilm_path)


@pytest.fixture(scope="module")
def engine(colbert_dir: Path) -> Iterator[Engine]:
    engine = Engine(EngineConfig(colbert_dir, "cpu", "float32", cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def client(engine: Engine, colbert_dir: Path) -> Iterator[httpx.Client]:
    with api([engine], model_dirs=(colbert_dir,)) as http:
        yield http


def pylate_scores(colbert_dir: Path, query: str, documents: list[str]) -> np.ndarray:
    """PyLate's colbert_scores of one query against each document, on its formula's vectors."""
    projection = _projection(load_file(str(colbert_dir / "1_Dense" / "model.safetensors"))["linear.weight"])
    query_vectors = pylate_encode(colbert_dir, projection, [query], is_query=True)[0]
    return np.array(
        [
            float((query_vectors @ vectors.T).max(dim=1).values.sum())
            for vectors in pylate_encode(colbert_dir, projection, documents, is_query=False)
        ],
        np.float32,
    )


def test_tei_rerank_gives_pylates_maxsim_best_first(client: httpx.Client, colbert_dir: Path) -> None:
    reply = client.post("/rerank", json={"model": COLBERT, "query": QUERY, "texts": DOCUMENTS, "return_text": True})
    assert reply.status_code == 200, reply.text
    ranked = reply.json()
    expected = pylate_scores(colbert_dir, QUERY, DOCUMENTS)
    assert [item["index"] for item in ranked] == list(np.argsort(-expected))
    for item in ranked:
        assert item["score"] == pytest.approx(float(expected[item["index"]]), rel=1e-5)
        assert item["text"] == DOCUMENTS[item["index"]]


def test_cohere_client_v2_reranks_by_maxsim(engine: Engine, colbert_dir: Path) -> None:
    with api([engine], model_dirs=(colbert_dir,), api_key="co-key") as http:
        client = cohere.ClientV2(api_key="co-key", base_url=BASE_URL, httpx_client=http, timeout=60)
        response = client.rerank(model=COLBERT, query=QUERY, documents=DOCUMENTS, top_n=2)
    expected = pylate_scores(colbert_dir, QUERY, DOCUMENTS)
    best = np.argsort(-expected)[:2]
    assert [result.index for result in response.results] == list(best)
    for result in response.results:
        assert result.relevance_score == pytest.approx(float(expected[result.index]), rel=1e-5)


def test_cohere_v1_rerank_gives_maxsim(client: httpx.Client, colbert_dir: Path) -> None:
    reply = client.post("/v1/rerank", json={"model": COLBERT, "query": QUERY, "documents": DOCUMENTS})
    assert reply.status_code == 200, reply.text
    expected = pylate_scores(colbert_dir, QUERY, DOCUMENTS)
    results = reply.json()["results"]
    assert [item["index"] for item in results] == list(np.argsort(-expected))
    np.testing.assert_allclose([item["relevance_score"] for item in results],
                               expected[[item["index"] for item in results]], rtol=1e-5)  # fmt: skip


def test_only_scores_cross_the_wire(engine: Engine, colbert_dir: Path) -> None:
    """The replica's answer to the gateway's MaxSim request over real gRPC (the query, then the documents, laid out as
    the gateway lays them out): one float32 a document, PyLate's score, and no token vector."""
    info = multi_vector_info(engine.spec.multi_vector, engine.max_seq_length)
    assert info is not None
    options = RowOptions(normalize=True, token_vectors=True)
    parts = []
    for texts, is_query in (([QUERY], True), (DOCUMENTS, False)):
        tokenizer = TextTokenizer(engine.spec.tokenizer_file, max_length=token_limit(info, is_query))
        parts.append(pack(lay_out(tokenizer.encode(texts), info, is_query), options))
    batch = Batch.concat(parts)
    with served([engine], model_dirs=(colbert_dir,)) as running, grpc.insecure_channel(running.replicas[0]) as channel:
        response = embedding_pb2_grpc.EmbeddingStub(channel).Embed(embed_request(batch, maxsim=True), timeout=60)
    assert (response.num_seqs, response.dimension) == (len(DOCUMENTS), 1)
    assert len(response.embeddings) == 4 * len(DOCUMENTS) and not response.token_rows and not response.sparse_values
    scores = np.frombuffer(response.embeddings, "<f4")
    np.testing.assert_allclose(scores, pylate_scores(colbert_dir, QUERY, DOCUMENTS), rtol=1e-5)


def test_vllm_score_groups_pairs_by_query(client: httpx.Client, colbert_dir: Path) -> None:
    queries = [QUERY, "packed attention", QUERY]
    body = {"model": COLBERT, "text_1": queries, "text_2": DOCUMENTS[:3]}
    reply = client.post("/score", json=body)
    assert reply.status_code == 200, reply.text
    scores = [item["score"] for item in sorted(reply.json()["data"], key=lambda item: item["index"])]
    expected = [
        pylate_scores(colbert_dir, query, [document])[0] for query, document in zip(queries, DOCUMENTS[:3], strict=True)
    ]
    np.testing.assert_allclose(scores, expected, rtol=1e-5)


def test_documents_over_several_chunks_score_the_same(engine: Engine, colbert_dir: Path) -> None:
    """A chunk budget of 48 tokens holds one document and the query's copy: four chunks, four replica calls."""
    with api([engine], model_dirs=(colbert_dir,), chunk_tokens=48) as http:
        reply = http.post("/rerank", json={"model": COLBERT, "query": QUERY, "texts": DOCUMENTS})
        assert reply.status_code == 200, reply.text
    scores = {item["index"]: item["score"] for item in reply.json()}
    expected = pylate_scores(colbert_dir, QUERY, DOCUMENTS)
    np.testing.assert_allclose([scores[i] for i in range(len(DOCUMENTS))], expected, rtol=1e-5)


def test_maxsim_sums_each_query_vectors_best_match() -> None:
    rows = np.array([[1, 0], [0, 1], [1, 0], [0.6, 0.8], [0, 1]], np.float32)  # a query of 2, documents of 2 and 1
    np.testing.assert_allclose(maxsim(rows, np.array([0, 2, 4, 5])), [1 + 0.8, 0 + 1])


@pytest.mark.parametrize(
    ("sequences", "options", "problem"),
    [
        ([[101, 7, 102]], RowOptions(normalize=True, token_vectors=True), "at least one document"),
        ([[101, 7, 102], [101, 8, 102]], RowOptions(raw_spans=True), "needs token_vectors"),
        ([[101, 7, 102], [101, 8, 102]], RowOptions(dimensions=8, token_vectors=True), "dimensions 0"),
    ],
)
def test_the_replica_refuses_maxsim_it_cannot_score(
    engine: Engine, sequences: list[list[int]], options: RowOptions, problem: str
) -> None:
    spans = [[(0, 1), (1, 2)] for _ in sequences]
    message = embed_request(Batch.pack(sequences, options, spans=spans), maxsim=True)
    with pytest.raises(InvalidInput, match=problem):
        decode_request(message, Limits.from_engine(engine))


def test_predict_is_refused_on_a_colbert_model(client: httpx.Client) -> None:
    reply = client.post("/predict", json={"model": COLBERT, "inputs": "a"})
    assert reply.status_code == 424, reply.text  # TEI's status for a model that cannot serve the route
    assert "(task 'multi_vector')" in reply.json()["error"] and "/rerank" in reply.json()["error"]
