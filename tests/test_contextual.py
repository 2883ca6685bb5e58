"""Contextual (late-chunked) embeddings on /v1/contextualizedembeddings and TEI's /embed_all, through the gateway
and a replica in this process (tests/in_process.py) with the real all-MiniLM-L6-v2, against transformers: a chunk's
vector is the mean of its tokens' states in the whole document's forward (not the chunk embedded alone), documents
over the limit follow the documented windows (docs/contextual.md), /embed_all is the last hidden state of every
token, bad bodies are 4xx."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from in_process import served
from test_gateway_api import API_KEY, post

from bouquet.encodings import FORMATS, encode_rows
from bouquet.engine.engine import Engine
from bouquet.gateway.contextual import assign_windows, windows

LIMIT = 256  # all-MiniLM-L6-v2's, in tokens; [CLS] and [SEP] leave 254 for a window's content
SENTENCES = [
    "The lighthouse keeper climbed the spiral stairs every evening before the sun went down.",
    "He trimmed the wick, polished the great lens and wrote the weather in a leather book.",
    "Ships passing the headland counted on its beam to steer clear of the rocks below.",
    "In winter the storms came in from the west and salt crusted the windows of the tower.",
    "His daughter learned to read the barometer before she could read a children's story.",
    "When the automatic lamp arrived, the keeper was told he would no longer be needed.",
    "He stayed on anyway, living in the cottage and walking to the tower out of habit.",
    "Visitors now climb the same stairs and read his weather book behind a glass case.",
    "The museum guide says the last entry simply records a calm sea and a clear sky.",
    "Nobody knows why he stopped writing on that particular day in early spring.",
    "Some say he had finally grown tired; others that he went to live with his daughter.",
    "Either way the beam still turns each night, though no hand tends it any more.",
]
SHORT_DOCUMENTS = [SENTENCES[:3], ["Paris is the capital of France.", "It is known for the Eiffel Tower."]]
LONG_CHUNK = " ".join(SENTENCES[3:9] * 2)  # about 220 tokens: with its neighbours, no window holds all of it
LONG_DOCUMENT = [*SENTENCES, LONG_CHUNK, *SENTENCES[::-1], LONG_CHUNK + " " + LONG_CHUNK, SENTENCES[0]]


@pytest.fixture(scope="module")
def server(minilm_path: Path, minilm_fp32: Engine) -> Iterator[str]:
    """In process (tests/in_process.py), on a loopback port. Chunks of about 300 tokens: a request of several windows
    travels to the replica in several gRPC calls."""
    options = {"api_key": API_KEY, "chunk_tokens": 300}
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, **options) as running:
        yield running.url


@pytest.fixture(scope="module")
def reference(minilm_path: Path):
    from tokenizers import Tokenizer
    from transformers import AutoModel

    tokenizer = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer, AutoModel.from_pretrained(str(minilm_path)).eval()


def last_hidden_state(model, ids: list[int]) -> np.ndarray:  # [len(ids), 384]
    with torch.inference_mode():
        return model(torch.tensor([ids])).last_hidden_state[0].numpy()


def expected_chunk_vectors(reference, chunks: list[str]) -> tuple[np.ndarray, int]:
    """The documented rule, computed here from scratch: the chunks tokenized alone and joined; windows of 254
    tokens every 191 (a quarter overlap), the last ending at the document's end; each chunk pooled (mean) over its
    tokens in the window holding most of them, ties to the one where it sits farthest from an edge, then the
    first. Returns the vectors and the tokens computed (windows that pool no chunk are not computed)."""
    tokenizer, model = reference
    pieces = [tokenizer.encode(chunk, add_special_tokens=False).ids for chunk in chunks]
    tokens = [token for piece in pieces for token in piece]
    capacity = LIMIT - 2
    if len(tokens) <= capacity:
        ranges = [(0, len(tokens))]
    else:
        ranges, start = [], 0
        while start + capacity < len(tokens):
            ranges.append((start, start + capacity))
            start += capacity - capacity // 4
        ranges.append((len(tokens) - capacity, len(tokens)))
    vectors, used, offset = [], set(), 0
    for piece in pieces:
        first, last = offset, offset + len(piece)
        offset = last
        rank = [(max(0, min(last, b) - max(first, a)), min(first - a, b - last), -i) for i, (a, b) in enumerate(ranges)]
        index = max(range(len(ranges)), key=rank.__getitem__)
        a, b = ranges[index]
        used.add(index)
        states = last_hidden_state(model, [101, *tokens[a:b], 102])
        vectors.append(states[1 + max(first, a) - a : 1 + min(last, b) - a].mean(0))
    return np.array(vectors), sum(ranges[i][1] - ranges[i][0] + 2 for i in used)


def contextual(server: str, documents: list[list[str]], **options) -> tuple[int, dict]:
    return post(f"{server}/v1/contextualizedembeddings", {"input": documents, **options})


def vectors(answer: dict) -> list[np.ndarray]:
    return [np.array([chunk["embedding"] for chunk in document["data"]]) for document in answer["data"]]


def test_windows_and_their_assignment() -> None:
    assert windows(100, 254) == [(0, 100)] and windows(254, 254) == [(0, 254)]
    assert windows(600, 254) == [(0, 254), (191, 445), (346, 600)]
    assert windows(300, 254) == [(0, 254), (46, 300)]
    chunks = np.array([[0, 40], [40, 250], [250, 300], [100, 200]])
    # held 40 / 0: first; 210 / 204: first; 4 / 50: second; 100 both, margins 54 / 54: the first
    assert assign_windows(chunks, windows(300, 254)).tolist() == [0, 0, 1, 0]
    assert assign_windows(np.array([[150, 250]]), windows(300, 254)).tolist() == [1]  # margins 4 / 50


def test_chunk_vectors_are_span_means_of_the_whole_document(server: str, reference) -> None:
    status, answer = contextual(server, SHORT_DOCUMENTS)
    assert status == 200, answer
    assert answer["object"] == "list" and answer["model"] == "all-MiniLM-L6-v2"
    assert [(d["object"], d["index"]) for d in answer["data"]] == [("list", 0), ("list", 1)]
    assert [[c["index"] for c in d["data"]] for d in answer["data"]] == [[0, 1, 2], [0, 1]]
    assert {c["object"] for d in answer["data"] for c in d["data"]} == {"embedding"}
    computed = 0
    for document, got in zip(SHORT_DOCUMENTS, vectors(answer), strict=True):
        expected, tokens = expected_chunk_vectors(reference, document)
        computed += tokens
        assert got.shape == (len(document), 384)
        assert row_cosines(got, expected).min() >= 0.99999
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)  # the model's Normalize
    assert answer["usage"] == {"prompt_tokens": computed, "total_tokens": computed}


def test_chunk_vectors_differ_from_the_chunks_embedded_alone(server: str) -> None:
    _, answer = contextual(server, SHORT_DOCUMENTS[:1])
    status, alone = post(f"{server}/v1/embeddings", {"input": SHORT_DOCUMENTS[0]})
    assert status == 200
    isolated = np.array([item["embedding"] for item in alone["data"]])
    assert row_cosines(vectors(answer)[0], isolated).max() < 0.98


def test_documents_over_the_limit_follow_the_documented_windows(server: str, reference) -> None:
    documents = [LONG_DOCUMENT, SHORT_DOCUMENTS[1]]
    status, answer = contextual(server, documents)
    assert status == 200, answer
    (long_expected, long_tokens), (short_expected, short_tokens) = (
        expected_chunk_vectors(reference, document) for document in documents
    )
    got = vectors(answer)
    assert got[0].shape == (len(LONG_DOCUMENT), 384)
    assert row_cosines(got[0], long_expected).min() >= 0.99999
    assert row_cosines(got[1], short_expected).min() >= 0.99999
    assert answer["usage"]["total_tokens"] == long_tokens + short_tokens > 3 * LIMIT  # several windows computed


def test_dimensions_and_base64(server: str) -> None:
    _, full = contextual(server, SHORT_DOCUMENTS)
    status, short = contextual(server, SHORT_DOCUMENTS, dimensions=32, encoding_format="base64")
    assert status == 200
    for document, reference_rows in zip(short["data"], vectors(full), strict=True):
        rows = np.array([np.frombuffer(base64.b64decode(c["embedding"]), "<f4") for c in document["data"]])
        assert rows.shape == (len(reference_rows), 32)
        truncated = reference_rows[:, :32] / np.linalg.norm(reference_rows[:, :32], axis=1, keepdims=True)
        np.testing.assert_allclose(rows, truncated, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["int8", "binary", "base64_int8", "base64_binary"])
def test_encodings_are_the_float_rows_encoded(server: str, name: str) -> None:
    """Perplexity's int8 and binary chunks: the float rows (of the same documents, as another request gives them)
    encoded as bouquet/encodings.py encodes any row, by the replica, then put back in each document's order."""
    _, full = contextual(server, SHORT_DOCUMENTS)
    status, encoded = contextual(server, SHORT_DOCUMENTS, encoding_format=name)
    assert status == 200, encoded
    form = FORMATS[name]
    for document, reference_rows in zip(encoded["data"], vectors(full), strict=True):
        expected = form.answer(encode_rows(reference_rows.astype(np.float32), form.encoding))
        got = [chunk["embedding"] for chunk in document["data"]]
        if name.startswith("base64"):
            assert got == list(expected)
        else:  # a sign bit or an int8 step may flip where two runs' floats differ in their last bits
            assert np.abs(np.array(got, np.int64) - np.array(expected, np.int64)).max() <= 1


def test_embed_all_is_the_last_hidden_state_of_every_token(server: str, reference) -> None:
    tokenizer, model = reference
    texts = ["Packed attention, no padding.", SENTENCES[4]]
    status, answer = post(f"{server}/embed_all", {"inputs": texts})
    assert status == 200, answer
    assert len(answer) == len(texts)
    for text, states in zip(texts, answer, strict=True):
        expected = last_hidden_state(model, tokenizer.encode(text).ids)  # [CLS] and [SEP] included
        np.testing.assert_allclose(np.array(states), expected, rtol=1e-4, atol=1e-4)
    status, single = post(f"{server}/embed_all", {"inputs": texts[0]})
    # alone or in a batch, the text's max_seqlen bucket (so `auto`'s attention backend) may differ: 1e-5, as below
    assert status == 200 and np.allclose(np.array(single[0]), np.array(answer[0]), atol=1e-5)
    ids = tokenizer.encode(LONG_CHUNK * 2).ids
    status, by_ids = post(f"{server}/embed_all", {"inputs": [ids[:20]]})
    assert status == 200 and np.allclose(np.array(by_ids[0]), last_hidden_state(model, ids[:20]), atol=1e-4)
    status, mixed = post(f"{server}/embed_all", {"inputs": [ids[:20], texts[0], ids[:5]]})  # TEI takes a mix
    assert status == 200 and [np.array(states).shape[0] for states in mixed] == [20, len(answer[0]), 5]
    assert np.allclose(np.array(mixed[1]), np.array(answer[0]), atol=1e-5)
    status, truncated = post(f"{server}/embed_all", {"inputs": LONG_CHUNK * 2, "truncation_direction": "Right"})
    assert status == 200 and np.array(truncated[0]).shape == (LIMIT, 384)


_CHUNKS = ["one chunk"]
_CONTEXTUAL = "/v1/contextualizedembeddings"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({}, 400, "missing_required_parameter"),
        ({"input": "text"}, 422, "invalid_type"),
        ({"input": ["text"]}, 422, "invalid_type"),
        ({"input": [[1, 2]]}, 422, "invalid_type"),
        ({"input": []}, 400, "empty_input"),
        ({"input": [_CHUNKS, []]}, 400, "empty_input"),
        ({"input": [["a", ""]]}, 400, "empty_input"),
        ({"input": [["a", "   "]]}, 400, "empty_input"),
        ({"input": [_CHUNKS], "dimensions": 0}, 400, "invalid_value"),
        ({"input": [_CHUNKS], "dimensions": "8"}, 422, "invalid_type"),
        ({"input": [_CHUNKS], "encoding_format": "int4"}, 400, "invalid_value"),
        ({"input": [_CHUNKS], "normalize": True}, 400, "unsupported_parameter"),
        ({"input": [_CHUNKS], "model": "nope"}, 404, "model_not_found"),
    ],
)
def test_bad_contextual_bodies_get_openai_error_bodies(server: str, body: dict, status: int, code: str) -> None:
    got, error = post(f"{server}{_CONTEXTUAL}", body)
    assert got == status, error
    assert set(error["error"]) == {"message", "type", "param", "code"}
    assert error["error"]["code"] == code and error["error"]["message"]


@pytest.mark.parametrize(
    ("body", "status", "error_type"),
    [
        ({}, 422, "Validation"),  # a required field missing: a body of the wrong shape
        ({"inputs": 5}, 422, "Validation"),
        ({"inputs": []}, 400, "Empty"),
        ({"inputs": "a " * 400, "truncate": False}, 413, "Validation"),
        ({"inputs": "a", "prompt_name": "query"}, 413, "Validation"),
        ({"inputs": "a", "truncation_direction": "up"}, 413, "Validation"),
        ({"inputs": "a", "normalize": True}, 422, "Validation"),  # not a field of TEI's EmbedAllRequest
    ],
)
def test_bad_embed_all_bodies_get_tei_error_bodies(server: str, body: dict, status: int, error_type: str) -> None:
    got, error = post(f"{server}/embed_all", body)
    assert got == status, error
    assert set(error) == {"error", "error_type"} and error["error"] and error["error_type"] == error_type
