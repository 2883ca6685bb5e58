"""Compact encodings: the one module that defines them against sentence-transformers' quantize_embeddings and
torch's bfloat16, the int8 bound on real rows, the request fields, and a real replica behind the real gateway
(both in this process, tests/in_process.py) answering every encoding on both routes (and through the openai
client), decoded and compared with its float rows, with the sizes of the answers and the replica's wire."""

from __future__ import annotations

import base64
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import corpus
import grpc
import numpy as np
import openai
import orjson
import pytest
import torch
from conftest import row_cosines
from in_process import served
from sentence_transformers.util.quantization import quantize_embeddings

from bouquet.batch import Batch, RowOptions
from bouquet.encodings import (
    EMBED_DTYPES,
    FORMATS,
    LAYOUTS,
    Encoding,
    ResponseFormat,
    decode_rows,
    encode_rows,
    int8_rows,
    rows_from_bytes,
)
from bouquet.engine.engine import Engine
from bouquet.gateway.api.openai import parse_openai
from bouquet.gateway.api.tei import parse_tei
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.proto import embedding_pb2, embedding_pb2_grpc
from bouquet.replica.client import embed_request, response_rows

DIMENSION = 384
MODEL = "all-MiniLM-L6-v2"
TEXTS = [*corpus.documents(6), *corpus.queries(4), *corpus.NON_ASCII_TEXTS[:4]]


def random_rows(count: int, dimension: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((count, dimension)).astype(np.float32)


def test_the_encodings_are_the_protos_number_for_number():
    assert dict(embedding_pb2.Encoding.items()) == {encoding.name: encoding.value for encoding in Encoding}
    assert set(LAYOUTS) == set(Encoding)


@pytest.mark.parametrize("dimension", [1, 3, 8, 100, 384, 1023])
@pytest.mark.parametrize(("precision", "encoding"), [("binary", Encoding.BINARY), ("ubinary", Encoding.UBINARY)])
def test_bits_are_quantize_embeddings_bit_for_bit(precision, encoding, dimension):
    rows = random_rows(7, dimension)
    rows[0, :] = 0.0  # zero is not > 0: a 0 bit, as sentence-transformers has it
    expected = quantize_embeddings(rows, precision)
    encoded = encode_rows(rows, encoding)
    assert encoded.dtype == expected.dtype and encoded.shape == (7, -(-dimension // 8))
    np.testing.assert_array_equal(encoded, expected)
    np.testing.assert_array_equal(decode_rows(encoded, encoding, dimension), np.where(rows > 0, 1.0, -1.0))


def test_base64_binary_is_the_same_bits_least_significant_first():
    rows = random_rows(5, 100)
    lsb = encode_rows(rows, Encoding.UBINARY_LSB)
    np.testing.assert_array_equal(np.unpackbits(lsb, axis=1, bitorder="little")[:, :100], rows > 0)
    reversed_bits = np.packbits(np.unpackbits(encode_rows(rows, Encoding.UBINARY), axis=1)[:, :104]
                                .reshape(5, 13, 8)[:, :, ::-1].reshape(5, 104), axis=1)  # fmt: skip
    np.testing.assert_array_equal(lsb[:, :12], reversed_bits[:, :12])  # whole bytes: each byte's bits reversed
    assert (lsb[:, 12] >> 4 == 0).all()  # 100 = 12 * 8 + 4: the last byte's unused high bits are 0


def test_int8_is_the_direction_on_a_fixed_grid_row_by_row():
    rows = random_rows(6, 64) * np.array([[1e-3], [1.0], [50.0], [1.0], [1.0], [1.0]], np.float32)
    rows[3] = 0.0
    rows[4] = np.eye(64, dtype=np.float32)[5] * -7.0
    int8 = encode_rows(rows, Encoding.INT8)
    assert int8.dtype == np.int8 and np.abs(int8.astype(int)).max() <= 127  # never clipped, -128 never used
    assert (int8[3] == 0).all() and int8[4, 5] == -127 and np.count_nonzero(int8[4]) == 1
    unit = rows / np.maximum(np.linalg.norm(rows, axis=1, keepdims=True), 1e-30)
    np.testing.assert_array_equal(int8, np.rint(unit * 127).astype(np.int8))  # length does not matter
    for i in range(len(rows)):  # no calibration: a row encodes the same alone or among others
        np.testing.assert_array_equal(encode_rows(rows[i : i + 1], Encoding.INT8), int8[i : i + 1])
    uint8 = encode_rows(rows, Encoding.UINT8)
    np.testing.assert_array_equal(uint8.astype(int), int8.astype(int) + 128)
    np.testing.assert_allclose(decode_rows(uint8, Encoding.UINT8, 64), decode_rows(int8, Encoding.INT8, 64))


@pytest.mark.parametrize(("normalize", "dimensions"), [(True, 0), (False, 0), (True, 64), (False, 100)])
def test_int8_keeps_every_real_row_within_cosine_099(minilm_fp32, minilm_tokenizer, normalize, dimensions):
    ids = minilm_tokenizer.encode(corpus.parity_texts())
    rows = minilm_fp32.embed(Batch.pack(ids, RowOptions(dimensions, normalize)))
    for encoding in (Encoding.INT8, Encoding.UINT8):
        cosines = row_cosines(decode_rows(encode_rows(rows, encoding), encoding, rows.shape[1]), rows)
        assert cosines.min() >= 0.99, (encoding.name, cosines.min())


def test_floats_match_numpy_and_torch():
    rows = np.concatenate([random_rows(4, 50) * 100, np.array([[np.nan, np.inf, -np.inf, 0.0, -0.0] * 10])])
    rows = rows.astype(np.float32)
    np.testing.assert_array_equal(encode_rows(rows, Encoding.FLOAT32).view(np.uint32), rows.view(np.uint32))
    np.testing.assert_array_equal(encode_rows(rows, Encoding.FLOAT16), rows.astype(np.float16))
    bf16 = torch.from_numpy(rows).to(torch.bfloat16)
    number = ~np.isnan(rows)  # NaN's payload bits are free: torch and numpy differ there
    np.testing.assert_array_equal(encode_rows(rows, Encoding.BFLOAT16)[number], bf16.view(torch.uint16).numpy()[number])
    np.testing.assert_array_equal(decode_rows(encode_rows(rows, Encoding.BFLOAT16), Encoding.BFLOAT16, 50),
                                  bf16.float().numpy())  # fmt: skip


@pytest.mark.parametrize(
    ("encoding", "torch_dtype"), [(Encoding.FP8_E4M3, torch.float8_e4m3fn), (Encoding.FP8_E5M2, torch.float8_e5m2)]
)
def test_fp8_is_torchs_conversion_bit_for_bit(encoding: Encoding, torch_dtype: torch.dtype):
    """vLLM's embed_dtype fp8_e4m3 / fp8_e5m2 send torch's conversion's bytes: round to nearest even, subnormals,
    e4m3fn saturating at 448, e5m2 overflowing to infinity, NaN kept; and back, each code's value."""
    generator = np.random.default_rng(0)
    scales = (1e-5, 1e-3, 2e-2, 0.3, 5, 200, 3e4, 1e6)
    spread = np.concatenate([generator.standard_normal(20_000) * scale for scale in scales])
    edges = [0.0, np.inf, np.nan, 448, 449, 463.9, 464, 480, 57344, 61439, 61440, 65536, 2**-9, 3 * 2**-10, 2**-17]
    values = np.concatenate([spread, edges, np.negative(edges)]).astype(np.float32)[None]
    expected = torch.from_numpy(values).to(torch_dtype).view(torch.uint8).numpy()
    np.testing.assert_array_equal(encode_rows(values, encoding), expected)
    codes = np.arange(256, dtype=np.uint8)[None]
    np.testing.assert_array_equal(decode_rows(codes, encoding, 256), torch.from_numpy(codes).view(torch_dtype).float())


def test_rows_from_bytes_checks_the_length():
    bits = encode_rows(random_rows(3, 20), Encoding.UBINARY)
    assert rows_from_bytes(bits.tobytes(), Encoding.UBINARY, 3, 20).shape == (3, 3)
    with pytest.raises(ValueError, match="not 3 rows of 25 values"):
        rows_from_bytes(bits.tobytes(), Encoding.UBINARY, 3, 25)


def test_request_fields_name_what_they_refuse():
    for name, response_format in FORMATS.items():
        assert parse_openai(orjson.dumps({"input": "a", "encoding_format": name})).response_format == response_format
        assert parse_tei(orjson.dumps({"inputs": "a", "encoding_format": name})).response_format == response_format
    half = parse_openai(
        orjson.dumps({"input": "a", "encoding_format": "base64", "embed_dtype": "float16", "endianness": "big"})
    )
    assert half.response_format == ResponseFormat(Encoding.FLOAT16, base64=True, big_endian=True)
    for name, encoding in [("fp8_e4m3", Encoding.FP8_E4M3), ("fp8_e5m2", Encoding.FP8_E5M2)]:
        fp8 = parse_openai(orjson.dumps({"input": "a", "encoding_format": "base64", "embed_dtype": name}))
        assert fp8.response_format == ResponseFormat(encoding, base64=True)
    defaults = {"input": "a", "encoding_format": "int8", "embed_dtype": "float32", "endianness": "native"}
    assert parse_openai(orjson.dumps(defaults)).response_format == FORMATS["int8"]
    refused = [
        ({"encoding_format": "int4"}, "invalid_value", "encoding_format"),
        ({"encoding_format": "base64", "embed_dtype": "fp8"}, "invalid_value", "embed_dtype"),
        ({"encoding_format": "base64", "endianness": "middle"}, "invalid_value", "endianness"),
        ({"encoding_format": "int8", "embed_dtype": "float16"}, "unsupported_parameter", "embed_dtype"),
        ({"embed_dtype": "bfloat16"}, "unsupported_parameter", "embed_dtype"),
        ({"encoding_format": "base64_int8", "endianness": "big"}, "unsupported_parameter", "endianness"),
    ]
    for fields, code, param in refused:
        with pytest.raises(InvalidRequest) as raised:
            parse_openai(orjson.dumps({"input": "a", **fields}))
        assert (raised.value.code, raised.value.param) == (code, param)
    with pytest.raises(Unprocessable):
        parse_tei(orjson.dumps({"inputs": "a", "encoding_format": 8}))


# A real replica behind the real gateway, in this process (tests/in_process.py), the gateway on a loopback port:
# small batches and chunks, so a request's rows come back in several replies and several steps and are put
# together in their encoding.


@pytest.fixture(scope="module")
def servers(minilm_path: Path, minilm_fp32: Engine) -> Iterator[tuple[str, str]]:
    """The gateway's URL and the replica's gRPC address."""
    options = {"model_dirs": (minilm_path,), "chunk_tokens": 600}
    with served([minilm_fp32], scheduler={"max_batch_tokens": 512}, listen=True, **options) as running:
        yield running.url, running.replicas[0]


def post(url: str, body: dict) -> tuple[int, bytes]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def embeddings(url: str, route: str, fields: dict) -> tuple[list, int]:
    """Each row as answered (a list of numbers or a base64 string) and the body's size in bytes."""
    body = {"input": TEXTS, **fields} if route == "/v1/embeddings" else {"inputs": TEXTS, **fields}
    status, data = post(url + route, body)
    assert status == 200, data[:300]
    answer = json.loads(data)
    rows = [item["embedding"] for item in answer["data"]] if route == "/v1/embeddings" else answer
    return rows, len(data)


def decoded(rows: list, name: str, dimension: int, byteorder: str = "<", embed_dtype: str = "float32") -> np.ndarray:
    """The answer's rows as float32 that compare as they do, read as a client would."""
    response_format = FORMATS[name]
    encoding = EMBED_DTYPES[embed_dtype] if name == "base64" else response_format.encoding
    dtype = LAYOUTS[encoding].dtype.newbyteorder(byteorder)
    if response_format.base64:
        data = np.stack([np.frombuffer(base64.b64decode(row), dtype) for row in rows]).astype(dtype.newbyteorder("<"))
    else:
        data = np.array(rows, dtype)
    return decode_rows(data, encoding, dimension)


ROUTES = ["/v1/embeddings", "/embed"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dimensions", [None, 100])
def test_every_encoding_decodes_back_to_the_float_rows(servers, route, dimensions):
    url, _ = servers
    fields = {} if dimensions is None else {"dimensions": dimensions}
    width = dimensions or DIMENSION
    floats, _ = embeddings(url, route, {**fields, "encoding_format": "float"})
    floats = np.array(floats, np.float32)
    assert floats.shape == (len(TEXTS), width)
    sure = np.abs(floats) > 1e-5  # a value this close to 0 may take either sign in another batch's arithmetic
    for name, response_format in FORMATS.items():
        rows, _ = embeddings(url, route, {**fields, "encoding_format": name})
        values = decoded(rows, name, width)
        if response_format.encoding in (Encoding.INT8, Encoding.UINT8):
            assert row_cosines(values, floats).min() >= 0.99, name
            expected = decode_rows(int8_rows(floats), Encoding.INT8, width)
            assert np.abs(values - expected).max() <= 1.5 / 127, name  # the same grid, a rounding apart at most
        elif response_format.encoding is Encoding.FLOAT32:
            np.testing.assert_allclose(values, floats, atol=1e-6, err_msg=name)
        else:
            bits = np.unpackbits(quantize_embeddings(floats, "ubinary"), axis=1, count=width).astype(bool)
            assert ((values > 0) == bits)[sure].all(), name
            if name in ("binary", "ubinary"):  # the very integers sentence-transformers gives
                differ = np.array(rows) != quantize_embeddings(floats, name)
                assert not (differ & ~np.packbits(~sure, axis=1).astype(bool)).any(), name
            packed = base64.b64decode(rows[0]) if response_format.base64 else rows[0]
            assert len(packed) == -(-width // 8), name  # 100 values: 13 bytes, the last one's 4 spare bits 0


@pytest.mark.parametrize("route", ROUTES)
def test_base64_takes_vllms_embed_dtype_and_endianness(servers, route):
    url, _ = servers
    floats = np.array(embeddings(url, route, {"encoding_format": "float"})[0], np.float32)
    # fp8: half a step at MiniLM's largest values (|x| < 0.25: steps of 1/64 in e4m3, 1/32 in e5m2)
    dtypes = [("float32", 1e-6), ("float16", 1e-3), ("bfloat16", 8e-3), ("fp8_e4m3", 8e-3), ("fp8_e5m2", 1.6e-2)]
    for embed_dtype, tolerance in dtypes:
        for endianness, byteorder in [("native", "<"), ("little", "<"), ("big", ">")]:
            fields = {"encoding_format": "base64", "embed_dtype": embed_dtype, "endianness": endianness}
            rows, _ = embeddings(url, route, fields)
            values = decoded(rows, "base64", DIMENSION, byteorder, embed_dtype)
            np.testing.assert_allclose(values, floats, atol=tolerance, err_msg=str(fields))


def test_the_openai_client_passes_the_encodings_through(servers):
    url, _ = servers
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    floats = np.array([item.embedding for item in client.embeddings.create(model=MODEL, input=TEXTS).data], np.float32)
    for name in ("int8", "binary", "base64_int8", "base64_binary"):
        response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format=name)  # type: ignore[arg-type]
        values = decoded([item.embedding for item in response.data], name, DIMENSION)
        assert row_cosines(values, floats).min() >= (0.99 if "int8" in name else 0.7), name
    half = client.embeddings.create(
        model=MODEL, input=TEXTS, encoding_format="base64", extra_body={"embed_dtype": "float16"}
    )
    values = decoded([item.embedding for item in half.data], "base64", DIMENSION, embed_dtype="float16")
    np.testing.assert_allclose(values, floats, atol=1e-3)


def test_compact_answers_are_small(servers):
    url, _ = servers
    sizes = {name: embeddings(url, "/v1/embeddings", {"encoding_format": name})[1] for name in FORMATS}
    assert sizes["base64_binary"] * 30 <= sizes["float"], sizes
    assert sizes["base64_int8"] * 3.5 <= sizes["base64"], sizes  # 4x fewer bytes, the same JSON around them
    assert sizes["int8"] * 2 <= sizes["float"], sizes


def test_the_replica_sends_the_encoded_bytes(servers, minilm_tokenizer):
    _, replica = servers
    ids = minilm_tokenizer.encode(TEXTS[:5])
    with grpc.insecure_channel(replica) as channel:
        stub = embedding_pb2_grpc.EmbeddingStub(channel)
        floats = response_rows(stub.Embed(embed_request(Batch.pack(ids)), timeout=60))
        for encoding in Encoding:
            reply = stub.Embed(embed_request(Batch.pack(ids, RowOptions(encoding=encoding))), timeout=60)
            layout = LAYOUTS[encoding]
            assert (reply.encoding, reply.num_seqs, reply.dimension) == (encoding, 5, DIMENSION)
            assert len(reply.embeddings) == 5 * layout.elements(DIMENSION) * layout.dtype.itemsize
            rows = response_rows(reply, encoding)
            assert row_cosines(decode_rows(rows, encoding, DIMENSION), floats).min() >= 0.7
            if encoding is Encoding.FLOAT32:  # what a replica older than encodings answers: encoded by the caller
                np.testing.assert_array_equal(response_rows(reply, Encoding.INT8), int8_rows(floats))
            else:
                with pytest.raises(ValueError, match="asked for"):
                    response_rows(reply, Encoding.FLOAT32)
        unknown = embed_request(Batch.pack(ids))
        unknown.encoding = 99  # type: ignore[assignment]
        with pytest.raises(grpc.RpcError) as raised:
            stub.Embed(unknown, timeout=60)
        assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "encoding 99" in raised.value.details()


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize(
    ("fields", "code", "param"),
    [
        ({"encoding_format": "int4"}, "invalid_value", "encoding_format"),
        ({"encoding_format": "base64", "embed_dtype": "fp8_e5m3"}, "invalid_value", "embed_dtype"),
        ({"encoding_format": "binary", "endianness": "big"}, "unsupported_parameter", "endianness"),
    ],
)
def test_a_bad_value_is_a_400_naming_its_field(servers, route, fields, code, param):
    url, _ = servers
    body = {"input": "a", **fields} if route == "/v1/embeddings" else {"inputs": "a", **fields}
    status, data = post(url + route, body)
    if route == "/v1/embeddings":
        error = json.loads(data)["error"]
        assert (status, error["type"], error["code"], error["param"]) == (400, "invalid_request_error", code, param)
        assert param in error["message"]
    else:  # TEI's body and statuses on TEI's routes: a bad value 413 Validation, a field out of place 422
        error = json.loads(data)
        assert (status, error["error_type"]) == (413 if code == "invalid_value" else 422, "Validation")
        assert param in error["error"]


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_rows_finished_on_the_gateway_are_encoded_there_too(servers):
    """Rows the gateway computes from float32 rows (long_input=chunk's averaged windows, contextual chunks) and a
    batch mixing texts and token ids answer the encoding asked for, as the replica's rows do."""
    url, _ = servers
    long_text = " ".join(corpus.documents(40))  # over the model's 256 tokens: several windows
    inputs: list = [long_text, TEXTS[0]]
    for name in ("int8", "ubinary", "base64_binary"):
        fields = {"input": inputs, "long_input": "chunk"}
        floats = np.array(json.loads(post(url + "/v1/embeddings", fields)[1])["data"][0]["embedding"], np.float32)
        status, data = post(url + "/v1/embeddings", {**fields, "encoding_format": name})
        assert status == 200, data[:300]
        rows = [item["embedding"] for item in json.loads(data)["data"]]
        values = decoded(rows[:1], name, DIMENSION)
        expected = decode_rows(encode_rows(floats[None], FORMATS[name].encoding), FORMATS[name].encoding, DIMENSION)
        np.testing.assert_allclose(values, expected, atol=1.5 / 127)
    documents = {"input": [[TEXTS[0], TEXTS[1]], [TEXTS[2]]]}
    status, data = post(url + "/v1/contextualizedembeddings", documents)
    assert status == 200, data[:300]
    floats = np.array([c["embedding"] for d in json.loads(data)["data"] for c in d["data"]], np.float32)
    status, data = post(url + "/v1/contextualizedembeddings", {**documents, "encoding_format": "base64_int8"})
    assert status == 200, data[:300]
    values = decoded([c["embedding"] for d in json.loads(data)["data"] for c in d["data"]], "base64_int8", DIMENSION)
    assert row_cosines(values, floats).min() >= 0.99
    ids = json.loads(post(url + "/tokenize", {"inputs": TEXTS[1]})[1])[0]
    status, data = post(
        url + "/embed", {"inputs": [TEXTS[0], [token["id"] for token in ids]], "encoding_format": "int8"}
    )
    assert status == 200, data[:300]
    mixed = np.array(json.loads(data), np.float32) / 127
    floats = np.array(embeddings(url, "/embed", {"encoding_format": "float"})[0], np.float32)[:2]
    assert row_cosines(mixed, floats).min() >= 0.99
