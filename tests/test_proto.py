"""The committed gRPC code is what embedding.proto generates, and the wire format round-trips rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bouquet.proto import embedding_pb2
from bouquet.proto.generate import GENERATED, PROTO_DIR, generate
from bouquet.replica.client import embed_request, response_rows


def test_committed_code_matches_the_proto(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    assert [path.name for path in fresh] == list(GENERATED)
    for path in fresh:
        committed = PROTO_DIR / path.name
        assert committed.read_text() == path.read_text(), (
            f"{committed} is stale: run `python -m bouquet.proto.generate` and commit the result"
        )


def test_request_packs_sequences_end_to_end() -> None:
    request = embed_request(
        [[101, 7, 102], [101, 102]], dimensions=64, normalize=False, token_type_ids=[[0] * 3, [1] * 2]
    )
    assert list(request.input_ids) == [101, 7, 102, 101, 102]
    assert list(request.cu_seqlens) == [0, 3, 5]
    assert list(request.token_type_ids) == [0, 0, 0, 1, 1]
    assert (request.dimensions, request.normalize) == (64, False)
    assert embed_request([[1]]).token_type_ids == []


def test_rows_travel_as_little_endian_float32() -> None:
    rows = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    wire = embedding_pb2.EmbedResponse(embeddings=rows.astype("<f4").tobytes(), num_seqs=3, dimension=5)
    decoded = response_rows(embedding_pb2.EmbedResponse.FromString(wire.SerializeToString()))
    assert decoded.dtype == np.float32
    np.testing.assert_array_equal(decoded, rows)
