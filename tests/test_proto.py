"""The committed gRPC code is what embedding.proto generates; batches and rows round-trip through the wire as bytes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bouquet.batch import Batch, RowOptions
from bouquet.proto import embedding_pb2
from bouquet.proto.generate import GENERATED, PROTO_DIR, generate
from bouquet.replica.client import embed_request, response_rows, response_sparse_rows
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.replica.server import sparse_response
from bouquet.sparse_rows import concat, densify


def test_committed_code_matches_the_proto(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert [path.name for path in fresh] == list(GENERATED)
    for path in fresh:
        committed = PROTO_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m bouquet.proto.generate` and commit the result"
        )


LIMITS = Limits(vocab_size=30522, type_vocab_size=2, max_seq_length=256, dimension=384)


def int32s(values: list[int]) -> bytes:
    return np.array(values, "<i4").tobytes()


def test_request_sends_the_packed_arrays_as_little_endian_int32_bytes() -> None:
    batch = Batch.pack([[101, 7, 102], [101, 102]], RowOptions(64, False, 1), token_type_ids=[[0] * 3, [1] * 2])
    request = embed_request(batch)
    assert request.input_ids == int32s([101, 7, 102, 101, 102])
    assert request.cu_seqlens == int32s([0, 3, 5])
    assert request.token_type_ids == int32s([0, 0, 0, 1, 1])
    assert (request.dimensions, request.normalize, request.prompt_tokens) == (64, False, 1)
    assert embed_request(Batch.pack([[1]])).token_type_ids == b""


def test_request_round_trips_to_the_same_batch() -> None:
    sent = Batch.pack([[101, 7, 102], [101, 9, 9, 102]], RowOptions(32, True, 2), token_type_ids=[[0] * 3, [1] * 4])
    wire = embedding_pb2.EmbedRequest.FromString(embed_request(sent.slice(1, 2)).SerializeToString())
    received = decode_request(wire, LIMITS)
    expected = sent.slice(1, 2)
    for name in ("input_ids", "cu_seqlens", "token_type_ids", "dimensions", "normalize", "prompt_lens"):
        np.testing.assert_array_equal(getattr(received, name), getattr(expected, name), err_msg=name)
    assert received.input_ids.dtype == received.cu_seqlens.dtype == received.token_type_ids.dtype == np.int32
    assert decode_request(embed_request(Batch.pack([[5]])), LIMITS).token_type_ids is None


@pytest.mark.parametrize("field", ["input_ids", "cu_seqlens", "token_type_ids"])
def test_a_byte_length_that_is_not_whole_int32s_is_invalid_input(field: str) -> None:
    request = embed_request(Batch.pack([[101, 7, 102]], token_type_ids=[[0, 0, 0]]))
    setattr(request, field, getattr(request, field)[:-1])
    with pytest.raises(InvalidInput, match=f"{field} has (11|7) bytes, not a whole number of 4-byte"):
        decode_request(request, LIMITS)


def test_a_batch_mixing_options_is_not_one_request() -> None:
    mixed = Batch.concat([Batch.pack([[1, 2]], RowOptions(dimensions=8)), Batch.pack([[3]])])
    with pytest.raises(ValueError, match="different row options"):
        embed_request(mixed)


def test_rows_travel_as_little_endian_float32() -> None:
    rows = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    wire = embedding_pb2.EmbedResponse(embeddings=rows.astype("<f4").tobytes(), num_seqs=3, dimension=5)
    decoded = response_rows(embedding_pb2.EmbedResponse.FromString(wire.SerializeToString()))
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, rows)


SPARSE_LIMITS = Limits(vocab_size=30522, type_vocab_size=2, max_seq_length=256, dimension=384, sparse_dimension=30522)


def test_a_sparse_request_round_trips_and_its_refusals_name_the_problem() -> None:
    message = embed_request(Batch.pack([[101, 7, 102], [101, 102]], RowOptions(normalize=False, sparse=True)))
    assert message.sparse and decode_request(message, SPARSE_LIMITS).any_sparse
    with pytest.raises(InvalidInput, match="no sparse head"):
        decode_request(message, LIMITS)
    for field, value in (("dimensions", 8), ("encoding", 3), ("normalize", True)):
        spoiled = embedding_pb2.EmbedRequest()
        spoiled.CopyFrom(message)
        setattr(spoiled, field, value)
        with pytest.raises(InvalidInput, match="no dimensions, normalize, encoding or spans"):
            decode_request(spoiled, SPARSE_LIMITS)
    too_many = embed_request(Batch.pack([[101, 102]] * 3, RowOptions(normalize=False, sparse=True)))
    with pytest.raises(InvalidInput, match="3 sparse rows in one request; at most 2"):
        decode_request(too_many, Limits(30522, 2, 256, 384, sparse_dimension=(256 << 20) // 8))
    dense = embed_request(Batch.pack([[101, 102]]))
    with pytest.raises(InvalidInput, match="sparse rows only"):
        decode_request(dense, Limits(30522, 2, 256, 30522, sparse_dimension=30522, sparse_only=True))


def test_sparse_rows_cross_the_wire_as_their_nonzero_entries() -> None:
    rows = np.zeros((3, 50), np.float32)
    rows[0, [3, 40]], rows[2, [0, 7, 49]] = [0.5, 2.0], [1.0, 0.25, 3.0]  # row 1: no entry at all
    reply = sparse_response(rows)
    assert (reply.num_seqs, reply.dimension, reply.embeddings) == (3, 50, b"")
    sparse = response_sparse_rows(reply)
    np.testing.assert_array_equal(densify(sparse, 50), rows)
    halves = concat([response_sparse_rows(sparse_response(rows[:1])), response_sparse_rows(sparse_response(rows[1:]))])
    np.testing.assert_array_equal(densify(halves, 50), rows)
    reply.sparse_offsets = np.array([0, 2, 2], "<i4").tobytes()  # one offset short
    with pytest.raises(ValueError, match="do not fit"):
        response_sparse_rows(reply)
