"""The peers' own HTTP API tests, replayed against the real gateway and replicas in this process (tests/in_process.py):
vLLM's OpenAI-compatible pooling tests (embeddings, truncation, tokenization, score and rerank),
text-embeddings-inference's router tests and snapshots and its integration tests, and Infinity's end-to-end tests. Each
test names the peer test it mirrors (repository, path, test). The checks are re-expressed here, not copied: where a peer
compares with numbers its own model computed, this compares with sentence-transformers (or its CrossEncoder) on the
model served here, the bundled all-MiniLM-L6-v2 in float32, beside a tiny random-weight cross-encoder for the rerank and
score routes.

What is not replayed, and why (a peer-only extension, a model difference, a deliberate or conflicting behaviour),
is listed in docs/peer-api-suites.md."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import permutations
from pathlib import Path

import corpus
import numpy as np
import pytest
from conftest import row_cosines
from in_process import engines, served
from test_cross_encoders import LIMIT, _tiny_classifier

from bouquet.engine.engine import Engine

MODEL = "all-MiniLM-L6-v2"
RERANKER = "tiny-reranker"
API_KEY = "peers-key"
MAX_MODEL_LEN = 256  # MiniLM's limit, as vLLM's /tokenize reports it
MIN_COSINE = 0.99999

# vLLM's inputs (tests/entrypoints/pooling/embed/test_online.py and neighbours)
VLLM_TEXT = "The best thing about vLLM is that it supports many different models"
VLLM_TRUNCATION_TEXT = "Como o Brasil pode fomentar o desenvolvimento de modelos de IA?"
QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "The capital of France is Paris.", "Cross-encoder models are neat"]


# -- the server and the references ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory, minilm_path: Path) -> Path:
    from sentence_transformers import CrossEncoder

    root = tmp_path_factory.mktemp("peer-reranker")
    hf_dir = _tiny_classifier("bert", root / "hf", minilm_path, labels=1)
    CrossEncoder(str(hf_dir), device="cpu", max_length=LIMIT).save(str(root / RERANKER))
    return root / RERANKER


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir: Path):
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(cross_encoder_dir), device="cpu", max_length=LIMIT)


@pytest.fixture(scope="module")
def server(minilm_path: Path, minilm_fp32: Engine, cross_encoder_dir: Path) -> Iterator[str]:
    """One server for all three peers' tests, in process (tests/in_process.py) on a loopback port: MiniLM and the
    tiny reranker, an API key (Infinity's authentication test), token ids taken as input (vLLM's and TEI's tests
    send them)."""
    models = (minilm_path, cross_encoder_dir)
    with (
        engines(cross_encoder_dir) as reranker,
        served([minilm_fp32, *reranker], model_dirs=models, api_key=API_KEY, listen=True) as running,
    ):
        yield running.url


def call(url: str, body: object = None, key: str | None = API_KEY) -> tuple[int, dict[str, str], object]:
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            raw, status, got = reply.read(), reply.status, reply.headers
    except urllib.error.HTTPError as error:
        raw, status, got = error.read(), error.code, error.headers
    try:
        value: object = json.loads(raw)
    except ValueError:
        value = raw.decode()
    return status, {k.lower(): v for k, v in got.items()}, value


def ok(url: str, body: object = None) -> object:
    status, _, value = call(url, body)
    assert status == 200, value
    return value


def openai_client(server: str, key: str = API_KEY):
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=key, max_retries=0)


def token_ids(sentence_transformer, text: str, special: bool = True) -> list[int]:
    return sentence_transformer.tokenizer(text, add_special_tokens=special, truncation=True)["input_ids"]


def st_rows(sentence_transformer, texts: list[str], normalize: bool = True) -> np.ndarray:
    return sentence_transformer.encode(texts, convert_to_numpy=True, normalize_embeddings=normalize)


def assert_rows(rows, expected: np.ndarray) -> None:
    rows = np.asarray(rows, dtype=np.float32)
    assert rows.shape == expected.shape
    assert row_cosines(rows, expected.astype(np.float32)).min() >= MIN_COSINE
    assert np.allclose(rows, expected, atol=1e-4)


# -- vLLM ----------------------------------------------------------------------------------------------------------


def test_vllm_basic_models_and_tokenize(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_basic
    models = ok(f"{server}/v1/models")
    assert MODEL in [model["id"] for model in models["data"]]  # data[0] there: it serves one model
    assert MODEL in [model.id for model in openai_client(server).models.list().data]
    tokens = ok(f"{server}/tokenize", {"model": MODEL, "prompt": VLLM_TEXT})["tokens"]
    assert tokens == token_ids(sentence_transformer, VLLM_TEXT)


def test_vllm_completion_request(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_completion_request
    # (and tests/entrypoints/pooling/openai/test_embedding.py::test_single_embedding)
    ids = token_ids(sentence_transformer, VLLM_TEXT)
    body = ok(f"{server}/v1/embeddings", {"model": MODEL, "input": VLLM_TEXT, "encoding_format": "float"})
    assert body["id"] and body["object"] == "list" and isinstance(body["created"], int) and body["model"] == MODEL
    assert len(body["data"]) == 1 and len(body["data"][0]["embedding"]) == 384
    assert body["usage"] == {"prompt_tokens": len(ids), "total_tokens": len(ids), "completion_tokens": 0}
    expected = st_rows(sentence_transformer, [VLLM_TEXT])
    assert_rows([body["data"][0]["embedding"]], expected)
    by_ids = openai_client(server).embeddings.create(model=MODEL, input=ids, encoding_format="float")
    assert by_ids.usage.prompt_tokens == by_ids.usage.total_tokens == len(ids)
    assert_rows([by_ids.data[0].embedding], expected)
    ones = openai_client(server).embeddings.create(model=MODEL, input=[1, 1, 1, 1, 1], encoding_format="float")
    assert len(ones.data[0].embedding) == 384 and ones.usage.prompt_tokens == 5


def test_vllm_completion_request_batched(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_completion_request_batched
    # (and tests/entrypoints/pooling/openai/test_embedding.py::test_batch_embedding)
    n, ids = 10, token_ids(sentence_transformer, VLLM_TEXT)
    client = openai_client(server)
    texts = client.embeddings.create(model=MODEL, input=[VLLM_TEXT] * n, encoding_format="float")
    assert len(texts.data) == n and [d.index for d in texts.data] == list(range(n))
    assert texts.usage.prompt_tokens == texts.usage.total_tokens == len(ids) * n
    expected = st_rows(sentence_transformer, [VLLM_TEXT] * n)
    assert_rows([d.embedding for d in texts.data], expected)
    lists = client.embeddings.create(model=MODEL, input=[ids] * n, encoding_format="float")
    assert lists.usage.prompt_tokens == len(ids) * n
    assert_rows([d.embedding for d in lists.data], expected)
    ragged = [[4, 5, 7, 9, 20], [15, 29, 499], [24, 24, 24, 24, 24], [25, 32, 64, 77]]
    answer = client.embeddings.create(model=MODEL, input=ragged, encoding_format="float")
    assert len(answer.data) == 4 and answer.usage.prompt_tokens == 17


def test_vllm_truncate_prompt_tokens(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_truncate_prompt_tokens
    client = openai_client(server)
    for text_or_ids in (
        [VLLM_TRUNCATION_TEXT],
        token_ids(sentence_transformer, VLLM_TRUNCATION_TEXT + " " + VLLM_TRUNCATION_TEXT),
    ):
        answer = client.embeddings.create(model=MODEL, input=text_or_ids, extra_body={"truncate_prompt_tokens": 10})
        assert len(answer.data) == 1 and len(answer.data[0].embedding) == 384
        assert answer.usage.prompt_tokens == answer.usage.total_tokens == 10


@pytest.mark.parametrize("size", [10, MAX_MODEL_LEN + 1, 8193, -1])
def test_vllm_truncation_sizes(server, size):
    # vllm-project/vllm tests/entrypoints/pooling/basic/test_truncation.py::test_smaller_truncation_size,
    # ::test_bigger_truncation_size, ::test_max_truncation_size; test_online.py::test_truncate_prompt_tokens (8193)
    long_text = " ".join(corpus.documents(4))
    status, _, body = call(
        f"{server}/v1/embeddings", {"model": MODEL, "input": long_text, "truncate_prompt_tokens": size}
    )
    if size > MAX_MODEL_LEN:
        assert status == 400 and "truncate_prompt_tokens" in body["error"]["message"]
        assert body["error"]["param"] == "truncate_prompt_tokens"
    else:
        assert status == 200 and body["usage"]["prompt_tokens"] == (MAX_MODEL_LEN if size == -1 else size)


def test_vllm_base64_embedding(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_base64_embedding
    # (and tests/entrypoints/pooling/openai/test_embedding.py::test_batch_base64_embedding)
    texts = ["Hello my name is", VLLM_TEXT]
    client = openai_client(server)
    floats = [d.embedding for d in client.embeddings.create(input=texts, model=MODEL, encoding_format="float").data]
    expected = st_rows(sentence_transformer, texts)
    assert_rows(floats, expected)
    encoded = ok(f"{server}/v1/embeddings", {"model": MODEL, "input": texts, "encoding_format": "base64"})
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in encoded["data"]]
    assert np.array_equal(np.array(decoded), np.array(floats, dtype=np.float32))
    default = [d.embedding for d in client.embeddings.create(input=texts, model=MODEL).data]  # base64 underneath
    assert np.array_equal(np.array(default, dtype=np.float32), np.array(floats, dtype=np.float32))


def _decode(text: str, embed_dtype: str, endianness: str) -> np.ndarray:
    order = ">" if endianness == "big" else "<"
    raw = base64.b64decode(text)
    if embed_dtype == "bfloat16":
        halves = np.frombuffer(raw, dtype=f"{order}u2").astype(np.uint32)
        return (halves << 16).view(np.float32)
    return np.frombuffer(raw, dtype=f"{order}{'f4' if embed_dtype == 'float32' else 'f2'}").astype(np.float32)


def test_vllm_base64_embed_dtype_and_endianness(server):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_base64_embed_dtype_and_endianness
    texts = [VLLM_TEXT] * 3
    floats = np.array([d["embedding"] for d in ok(f"{server}/v1/embeddings", {"model": MODEL, "input": texts})["data"]])
    for embed_dtype in ("float32", "float16", "bfloat16"):
        for endianness in ("native", "little", "big"):
            body = {"model": MODEL, "input": texts, "encoding_format": "base64", "embed_dtype": embed_dtype,
                    "endianness": endianness}  # fmt: skip
            rows = [
                _decode(d["embedding"], embed_dtype, endianness) for d in ok(f"{server}/v1/embeddings", body)["data"]
            ]
            assert np.allclose(np.array(rows), floats, atol=1e-2)


@pytest.mark.parametrize(
    "param",
    ["encoding_format", "embed_dtype",
     "endianness"],
)  # fmt: skip
def test_vllm_params_not_supported(server, param):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online.py::test_params_not_supported
    body = {"model": MODEL, "input": VLLM_TEXT, "encoding_format": "base64", param: f"bad_{param}"}
    status, _, answer = call(f"{server}/v1/embeddings", body)
    assert status == 400 and f"bad_{param}" in answer["error"]["message"]


@pytest.mark.parametrize("field", ["normalize", "use_activation"])
def test_vllm_normalize_and_use_activation(server, field):
    # vllm-project/vllm tests/entrypoints/pooling/openai/test_embedding.py::test_normalize
    # and tests/entrypoints/pooling/embed/test_online.py::test_use_activation
    def rows(value):
        body = {"model": MODEL, "input": [VLLM_TEXT], "encoding_format": "float", field: value}
        return np.array([d["embedding"] for d in ok(f"{server}/v1/embeddings", body)["data"]])

    default, with_norm, without = rows(None), rows(True), rows(False)
    assert np.allclose(default, with_norm, atol=1e-2)
    assert not np.allclose(with_norm, without, atol=1e-2)
    assert np.allclose(with_norm, without / np.linalg.norm(without, axis=1, keepdims=True), atol=1e-2)


def test_vllm_dimensions(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/embed/test_online_dimensions.py::test_matryoshka
    # (the valid None and the invalid -1; vLLM's refusal of a width on a model without Matryoshka training is not
    # replayed: see docs/peer-api-suites.md)
    import openai

    client = openai_client(server)
    answer = client.embeddings.create(model=MODEL, input=["The chef prepared a delicious meal."] * 3)
    assert len(answer.data) == 3 and answer.usage.prompt_tokens > 0 and answer.usage.total_tokens > 0
    assert_rows(
        [d.embedding for d in answer.data], st_rows(sentence_transformer, ["The chef prepared a delicious meal."] * 3)
    )
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input=["The chef prepared a delicious meal."], dimensions=-1)


def test_vllm_long_text_chunked(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/pooling/openai/test_embedding_long_text.py
    # (::test_long_text_embedding_1500_chars, ::test_batch_long_text_embedding, ::test_chunked_vs_normal_consistency,
    # ::test_chunked_processing_response_format); vLLM turns chunking on for the server, bouquet per request
    # ("long_input": "chunk") or with --long-input chunk
    # vLLM's 1,500 and 2,500 words over a 512-token limit, halved for MiniLM's 256
    words = " ".join(corpus.documents(40)).split()
    long_1, long_2, short = " ".join(words[:750]), " ".join(words[-1250:]), "This is a short text test."
    body = ok(f"{server}/v1/embeddings", {"model": MODEL, "input": [long_1, long_2, short], "long_input": "chunk"})
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    rows = np.array([d["embedding"] for d in body["data"]])
    assert rows.shape == (3, 384) and np.abs(rows).sum(axis=1).min() > 0
    assert np.allclose(np.linalg.norm(rows, axis=1), 1, atol=1e-5)
    assert body["usage"]["prompt_tokens"] > 2000 and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    assert_rows(rows[2:], st_rows(sentence_transformer, [short]))
    single = ok(f"{server}/v1/embeddings", {"model": MODEL, "input": [long_1], "long_input": "chunk"})
    assert single["usage"]["prompt_tokens"] > 3 * MAX_MODEL_LEN
    assert np.allclose(single["data"][0]["embedding"], rows[0], atol=1e-5)


@pytest.mark.parametrize("add_special", [False, True])
def test_vllm_tokenize_completions(server, sentence_transformer, add_special):
    # vllm-project/vllm tests/entrypoints/openai/test_tokenization.py::test_tokenize_completions
    prompt = "vllm1 This is a test prompt."
    result = ok(f"{server}/tokenize", {"add_special_tokens": add_special, "model": MODEL, "prompt": prompt})
    tokens = token_ids(sentence_transformer, prompt, add_special)
    assert result == {"count": len(tokens), "max_model_len": MAX_MODEL_LEN, "tokens": tokens, "token_strs": None}


def test_vllm_tokenize_with_return_token_strs(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/openai/test_tokenization.py::test_tokenize_with_return_token_strs
    prompt = "This is a token_strs test prompt! vllm1"
    result = ok(f"{server}/tokenize", {"prompt": prompt, "model": MODEL, "return_token_strs": True})
    tokens = token_ids(sentence_transformer, prompt)
    assert result["tokens"] == tokens and result["count"] == len(tokens)
    assert result["token_strs"] == sentence_transformer.tokenizer.convert_ids_to_tokens(tokens)


def test_vllm_detokenize(server, sentence_transformer):
    # vllm-project/vllm tests/entrypoints/openai/test_tokenization.py::test_detokenize
    prompt = "This is a test prompt. vllm1"
    tokens = token_ids(sentence_transformer, prompt, special=False)
    result = ok(f"{server}/detokenize", {"model": MODEL, "tokens": tokens})
    assert result == {"prompt": sentence_transformer.tokenizer.decode(tokens)}  # an uncased model: lower case


def test_vllm_health(server):
    # vllm-project/vllm tests/entrypoints/openai/basic/test_basic.py::test_check_health
    assert call(f"{server}/health")[0] == 200


@pytest.mark.parametrize("route", ["/rerank", "/v1/rerank"])
def test_vllm_rerank_texts_and_top_n(server, cross_encoder, route):
    # vllm-project/vllm tests/entrypoints/pooling/openai/test_rerank.py::test_rerank_texts, ::test_top_n
    # (tests/entrypoints/pooling/scoring/test_cross_encoder_online.py::test_rerank_api_texts, ::test_rerank_api_top_n)
    expected = cross_encoder.predict([(QUERY, d) for d in DOCUMENTS])
    body = ok(f"{server}{route}", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS[:2]})
    assert body["id"] and body["model"] == RERANKER and len(body["results"]) == 2
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    for result in body["results"]:
        assert abs(result["relevance_score"] - expected[result["index"]]) < 1e-4
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    top = ok(f"{server}{route}", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert [r["index"] for r in top["results"]] == np.argsort(-expected, kind="stable")[:2].tolist()


@pytest.mark.parametrize("field", ["activation", "use_activation"])
@pytest.mark.parametrize("route", ["/rerank", "/score"])
def test_vllm_rerank_and_score_activation(server, field, route):
    # vllm-project/vllm tests/entrypoints/pooling/openai/test_rerank.py::test_activation,
    # tests/entrypoints/pooling/openai/test_score.py::TestModel::test_activation,
    # tests/entrypoints/pooling/scoring/test_cross_encoder_online.py::test_use_activation
    def scores(value):
        if route == "/rerank":
            body = ok(f"{server}/rerank", {"model": RERANKER, "query": QUERY, "documents": DOCUMENTS[:2], field: value})
            return np.array([r["relevance_score"] for r in sorted(body["results"], key=lambda r: r["index"])])
        body = ok(f"{server}/score", {"model": RERANKER, "text_1": QUERY, "text_2": DOCUMENTS[:2], field: value})
        return np.array([d["score"] for d in body["data"]])

    default, activated, raw = scores(None), scores(True), scores(False)
    assert np.allclose(default, activated, atol=1e-6)
    assert not np.allclose(activated, raw, atol=1e-2)
    assert np.allclose(1 / (1 + np.exp(-raw)), activated, atol=1e-5)


SCORE_SHAPES = {
    "text_1 str, text_2 list": ({"text_1": QUERY, "text_2": DOCUMENTS[:2]}, [(QUERY, d) for d in DOCUMENTS[:2]]),
    "text_1 list, text_2 list": (
        {"text_1": ["What is the capital of the United States?", QUERY], "text_2": DOCUMENTS[:2]},
        [("What is the capital of the United States?", DOCUMENTS[0]), (QUERY, DOCUMENTS[1])],
    ),
    "text_1 str, text_2 str": ({"text_1": QUERY, "text_2": DOCUMENTS[1]}, [(QUERY, DOCUMENTS[1])]),
    "queries str, documents str": ({"queries": QUERY, "documents": DOCUMENTS[1]}, [(QUERY, DOCUMENTS[1])]),
    "queries str, documents list": (
        {"queries": QUERY, "documents": DOCUMENTS[:2]},
        [(QUERY, d) for d in DOCUMENTS[:2]],
    ),
    "queries list, items list": (
        {"queries": [QUERY, QUERY], "items": DOCUMENTS[:2]},
        [(QUERY, d) for d in DOCUMENTS[:2]],
    ),
    "data_1 list, data_2 list": (
        {"data_1": [QUERY, QUERY], "data_2": DOCUMENTS[:2]},
        [(QUERY, d) for d in DOCUMENTS[:2]],
    ),
}


@pytest.mark.parametrize("shape", list(SCORE_SHAPES))
def test_vllm_score_shapes(server, cross_encoder, shape):
    # vllm-project/vllm tests/entrypoints/pooling/openai/test_score.py::TestModel::test_text_1_str_text_2_list,
    # ::test_text_1_list_text_2_list, ::test_text_1_str_text_2_str; and the newer field names of
    # tests/entrypoints/pooling/scoring/test_cross_encoder_online.py::test_score_api_queries_str_1_documents_str_1,
    # ::test_score_api_queries_str_1_documents_str_n, ::test_score_api_queries_vs_items,
    # ::test_score_api_data_1_vs_data_2
    fields, pairs = SCORE_SHAPES[shape]
    body = ok(f"{server}/score", {"model": RERANKER, **fields})
    assert body["id"] and body["object"] == "list" and len(body["data"]) == len(pairs)
    assert [d["index"] for d in body["data"]] == list(range(len(pairs)))
    np.testing.assert_allclose([d["score"] for d in body["data"]], cross_encoder.predict(pairs), atol=1e-4)


# -- text-embeddings-inference ---------------------------------------------------------------------------------------


def test_tei_embeddings(server, sentence_transformer):
    # huggingface/text-embeddings-inference router/tests/test_http_embed.rs::test_embeddings (the same MiniLM there;
    # its snapshots test_http_embed__embeddings_single.snap and __embeddings_batch.snap hold sentence-transformers'
    # row for "test", compared here with sentence-transformers itself)
    single = ok(f"{server}/embed", {"inputs": "test"})
    assert_rows(single, st_rows(sentence_transformer, ["test"]))
    assert token_ids(sentence_transformer, "test") == [101, 3231, 102]
    by_ids = ok(f"{server}/embed", {"inputs": [[101, 3231, 102]]})
    assert np.allclose(by_ids, single, atol=4e-3)  # TEI's Score tolerance
    for inputs in (["test"] * 5, [[101, 3231, 102]] * 5):
        batch = ok(f"{server}/embed", {"inputs": inputs})
        assert len(batch) == 5 and all(np.allclose(row, single[0], atol=4e-3) for row in batch)


def test_tei_embed_all(server, sentence_transformer):
    # huggingface/text-embeddings-inference router/tests/test_http_embed.rs::test_embeddings (/embed_all, snapshot
    # test_http_embed__embeddings_raw.snap: one [tokens, width] array per input)
    raw = ok(f"{server}/embed_all", {"inputs": "test"})
    expected = sentence_transformer.encode(["test"], output_value="token_embeddings")[0].numpy()
    assert np.array(raw).shape == (1, *expected.shape) and np.allclose(raw[0], expected, atol=1e-4)


def test_tei_mrl_embeddings(server, sentence_transformer):
    # huggingface/text-embeddings-inference router/tests/snapshots/test_http_embed__mrl_embeddings_single.snap and
    # __mrl_embeddings_batch.snap (`dimensions`: 128-wide rows, scaled to unit length again)
    full = st_rows(sentence_transformer, ["test", "test"], normalize=False)[:, :128]
    expected = full / np.linalg.norm(full, axis=1, keepdims=True)
    single = ok(f"{server}/embed", {"inputs": "test", "dimensions": 128})
    assert_rows(single, expected[:1])
    assert_rows(ok(f"{server}/embed", {"inputs": ["test", "test"], "dimensions": 128}), expected)


def test_tei_rerank_ranks(server, cross_encoder):
    # huggingface/text-embeddings-inference router/tests/test_http_rerank.rs::test_rerank (snapshot
    # test_http_rerank__ranks.snap: index, score, text; ties in TEI's order, the later text first)
    texts = ["test", "other", "test"]
    ranks = ok(f"{server}/rerank", {"model": RERANKER, "query": "test", "texts": texts, "return_text": True})
    expected = cross_encoder.predict([("test", text) for text in texts])
    assert [set(rank) for rank in ranks] == [{"index", "score", "text"}] * 3
    for rank in ranks:
        assert abs(rank["score"] - expected[rank["index"]]) < 1e-4 and rank["text"] == texts[rank["index"]]
    other_first = expected[1] > expected[0]  # a random model: "other" may score above "test"
    assert [rank["index"] for rank in ranks] == ([1, 2, 0] if other_first else [2, 0, 1])
    tied = ranks[1:] if other_first else ranks[:2]
    assert abs(tied[0]["score"] - tied[1]["score"]) < 4e-3  # TEI's Score tolerance


def test_tei_predict(server, cross_encoder):
    # huggingface/text-embeddings-inference router/tests/test_http_predict.rs::test_predict (a sequence classifier:
    # the tiny reranker's one label here)
    single = ok(f"{server}/predict", {"inputs": "test", "model": RERANKER})
    assert len(single) == 1 and set(single[0]) == {"score", "label"}
    batch = ok(f"{server}/predict", {"inputs": [["test"]] * 5, "model": RERANKER})
    assert len(batch) == 5 and all(abs(p[0]["score"] - single[0]["score"]) < 4e-3 for p in batch)


def test_tei_integration_requests(server, sentence_transformer):
    # huggingface/text-embeddings-inference integration_tests/neuron/test_embed.py::test_model_single_request,
    # ::test_model_batch_request, ::test_model_embedding_consistency; integration_tests/gaudi/test_embed.py::
    # test_model_single_request (its expected row is bge-large-en-v1.5's: compared with sentence-transformers here)
    question = "What is Deep Learning?"
    batch_inputs = [question, "How does machine learning work?", "Tell me about neural networks."]
    first, second = ok(f"{server}/embed", {"inputs": question}), ok(f"{server}/embed", {"inputs": question})
    assert isinstance(first, list) and len(first[0]) == 384 and np.allclose(first, second, rtol=1e-4, atol=1e-4)
    assert np.allclose(first, st_rows(sentence_transformer, [question]), rtol=1e-5, atol=1e-5)
    batch = ok(f"{server}/embed", {"inputs": batch_inputs})
    assert len(batch) == 3 and all(isinstance(row, list) and row for row in batch)
    assert_rows(batch, st_rows(sentence_transformer, batch_inputs))


# Not a TEI test: the behaviour of its router (router/src/http/server.rs) that its tests take for granted.
def test_tei_router_behaviour(server, sentence_transformer):
    # huggingface/text-embeddings-inference router/src/http/server.rs: rerank, tokenize, decode, info, health, errors
    status, _, error = call(f"{server}/rerank", {"model": MODEL, "query": "q", "texts": ["a"]})
    assert status == 424 and error["error_type"] == "Backend"  # "model is not a re-ranker model"
    status, _, error = call(f"{server}/embed", {"inputs": []})
    assert status == 400 and error["error_type"] == "Empty"
    tokens = ok(f"{server}/tokenize", {"inputs": "test me"})
    assert tokens[0][0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[0][1] == {"id": 3231, "text": "test", "special": False, "start": 0, "stop": 4}
    assert ok(f"{server}/decode", {"ids": [101, 3231, 2033, 102]}) == ["test me"]
    info = ok(f"{server}/info")
    assert info["model_id"] == MODEL and info["max_input_length"] == MAX_MODEL_LEN
    assert info["model_type"] == {"embedding": {"pooling": "mean"}} and info["max_client_batch_size"] > 0
    assert call(f"{server}/health", key=None)[0] == 200


# -- Infinity --------------------------------------------------------------------------------------------------------


def test_infinity_model_route_and_health(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_api_with_dummymodel.py::test_model_route
    # (and test_sentence_transformers.py::test_model_route, test_torch_reranker.py::test_model_route)
    models = ok(f"{server}/models")["data"]
    assert {model["id"] for model in models} == {MODEL, RERANKER}
    assert all(isinstance(model.get("stats"), dict) for model in models)
    status, _, health = call(f"{server}/health")
    assert status == 200 and isinstance(health["unix"], float)


def test_infinity_embedding(server, sentence_transformer):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_sentence_transformers.py::test_embedding
    # (conftest.py Helpers.embedding_verify; test_api_with_dummymodel.py::test_embedding)
    for inputs in (["This is a test sentence."], ["This is a test sentence.", "This is another test sentence."]):
        body = ok(f"{server}/embeddings", {"input": inputs, "model": MODEL})
        assert isinstance(body["data"], list) and len(body["data"]) == len(inputs)
        np.testing.assert_almost_equal([d["embedding"] for d in body["data"]], st_rows(sentence_transformer, inputs), 6)


def test_infinity_embedding_max_length(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_api_with_dummymodel.py::test_embedding_max_length
    # (the input at Infinity's character limit is answered; its 422 past that limit is not replayed: bouquet truncates)
    body = ok(f"{server}/embeddings", {"input": "%_" * 4096 * 15, "model": MODEL})
    assert body["model"] == MODEL and len(body["data"]) == 1


def test_infinity_encoding_base_64(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_api_with_dummymodel.py::test_encoding_base_64
    floats = ok(f"{server}/embeddings", {"input": "Hello World", "model": MODEL, "encoding_format": "float"})
    encoded = ok(f"{server}/embeddings", {"input": "Hello World", "model": MODEL, "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype=np.float32)
    # the same float32 values: Infinity writes each as the float64 it widens to, bouquet as the shortest decimal
    # that reads back as the same float32 (docs/peer-api-suites.md)
    assert np.array_equal(decoded, np.array(floats["data"][0]["embedding"], dtype=np.float32))


def test_infinity_matryoshka_embedding(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_api_with_dummymodel.py::test_matryoshka_embedding
    for inputs in (["This is a test sentence."], ["This is a test sentence.", "This is another test sentence."]):
        body = ok(f"{server}/embeddings", {"input": inputs, "model": MODEL, "dimensions": 10})
        assert len(body["data"]) == len(inputs) and all(len(d["embedding"]) == 10 for d in body["data"])


def test_infinity_batch_embedding(server, sentence_transformer):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/conftest.py Helpers.util_batch_embedding
    # (test_sentence_transformers.py::test_batch_embedding): concurrent requests of a few sentences each
    sentences = corpus.queries(24)

    def post(chunk):
        return [d["embedding"] for d in ok(f"{server}/embeddings", {"input": chunk, "model": MODEL})["data"]]

    with ThreadPoolExecutor(6) as pool:
        rows = [row for part in pool.map(post, [sentences[i : i + 6] for i in range(0, 24, 6)]) for row in part]
    expected = st_rows(sentence_transformer, sentences)
    assert row_cosines(np.array(rows, np.float32), expected).min() > 0.95
    np.testing.assert_almost_equal(np.array(rows), expected, decimal=3)


def test_infinity_authentication(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_authentication.py::test_authentication
    rerank = {"model": RERANKER, "query": "Where is Munich?", "documents": ["Munich is in Germany."]}
    for route, payload in (
        ("/models", None),
        ("/embeddings", {"model": MODEL, "input": "sentence"}),
        ("/rerank", rerank),
    ):
        assert call(f"{server}{route}", payload, key=None)[0] == 401
        assert call(f"{server}{route}", payload)[0] in (200, 400)


def test_infinity_openai_client_text(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_openapi_client_compat.py::test_openai (text only;
    # a wrong key: Infinity's in-process transport raises a connection error, a real server answers 401)
    import openai

    client = openai.OpenAI(base_url=server, api_key=API_KEY, max_retries=0)
    answer = client.embeddings.create(
        model=MODEL, input=["a cat", "a cat", "a bird"], encoding_format="float", extra_body={"modality": "text"}
    )
    np.testing.assert_allclose(answer.data[0].embedding, answer.data[1].embedding, rtol=1e-5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server, api_key="some_wrong", max_retries=0).embeddings.create(model=MODEL, input=["x"])


EIFFEL = "Where is the Eiffel Tower located?"
EIFFEL_DOCUMENTS = [
    "My favorite dish is a hamburger.",
    "The Eiffel Tower is located in the United States.",
    "The Eiffel Tower is located in Paris, France",
    "The Eiffel Tower is located in the United Kingdom.",
    "I enjoiy flying to the moon.",
]


def test_infinity_reranker(server, cross_encoder):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_torch_reranker.py::test_reranker
    body = ok(f"{server}/rerank", {"model": RERANKER, "query": EIFFEL, "documents": EIFFEL_DOCUMENTS})
    assert "model" in body and "usage" in body
    results = sorted(body["results"], key=lambda r: r["index"])
    expected = cross_encoder.predict([(EIFFEL, d) for d in EIFFEL_DOCUMENTS])
    assert len(results) == len(expected)
    assert all(abs(result["relevance_score"] - score) < 0.01 for result, score in zip(results, expected, strict=True))


def test_infinity_reranker_top_n(server, cross_encoder):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_torch_reranker.py::test_reranker_top_n
    # (Infinity answers `document` as a string, Cohere, Jina and vLLM as {"text"}: bouquet answers the latter)
    documents = EIFFEL_DOCUMENTS[1:4]
    best = documents[int(np.argmax(cross_encoder.predict([(EIFFEL, d) for d in documents])))]
    cases = [(list(order), top_n, return_docs) for order in permutations(documents) for top_n in (1, 2, 8000)
             for return_docs in (True, False)]  # fmt: skip

    def check(case):
        order, top_n, return_docs = case
        body = {"model": RERANKER, "query": EIFFEL, "documents": order, "top_n": top_n, "return_documents": return_docs}
        results = ok(f"{server}/rerank", body)["results"]
        assert len(results) == min(top_n, len(order)) and results[0]["index"] == order.index(best)
        assert (results[0]["document"]["text"] == best) if return_docs else ("document" not in results[0])

    with ThreadPoolExecutor(6) as pool:
        list(pool.map(check, cases))


def test_infinity_reranker_invalid_top_n_and_cant_embed(server):
    # michaelfeil/infinity libs/infinity_emb/tests/end_to_end/test_torch_reranker.py::test_reranker_invalid_top_n
    # (422 there, from its request schema; 400 invalid_value here, as Cohere and vLLM answer) and
    # ::test_reranker_cant_embed_or_classify (the /embeddings half)
    for top_n in (-1, 0):
        body = {"model": RERANKER, "query": EIFFEL, "documents": EIFFEL_DOCUMENTS[1:4], "top_n": top_n}
        status, _, error = call(f"{server}/rerank", body)
        assert status == 400 and error["error"]["param"] == "top_n"
    assert call(f"{server}/embeddings", {"model": RERANKER, "input": EIFFEL_DOCUMENTS})[0] == 400
