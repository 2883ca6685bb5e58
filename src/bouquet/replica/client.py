"""The caller's end of the wire format: a packed batch out as bytes, its rows back in the encoding it asked for.
No torch."""

from __future__ import annotations

from typing import cast

import numpy as np

from bouquet.all_outputs import AllOutputs, from_response
from bouquet.batch import Batch
from bouquet.encodings import Encoding, encode_rows, rows_from_bytes
from bouquet.proto import embedding_pb2
from bouquet.sparse_rows import SparseRows


def embed_request(batch: Batch, maxsim: bool = False) -> embedding_pb2.EmbedRequest:
    """The batch's arrays as little-endian int32 bytes; its options, which all its sequences share, as scalars;
    `maxsim`: MaxSim scores of its first sequence (a query) against each later one instead of rows."""
    options = batch.options()
    if batch.pixel_values is not None:  # the replica lays images out at its model's tokens per image
        return embedding_pb2.EmbedRequest(
            pixel_values=batch.pixel_values.astype("<f4", copy=False).tobytes(),
            image_shape=batch.pixel_values.shape[1:], dimensions=options.dimensions, normalize=options.normalize,
            encoding=wire_encoding(options.encoding),
        )  # fmt: skip
    return embedding_pb2.EmbedRequest(
        input_ids=_int32_bytes(batch.input_ids),
        cu_seqlens=_int32_bytes(batch.cu_seqlens),
        token_type_ids=b"" if batch.token_type_ids is None else _int32_bytes(batch.token_type_ids),
        dimensions=options.dimensions,
        normalize=options.normalize,  # proto3 bool: always set, its default (False) is not ours
        prompt_tokens=options.prompt_tokens,
        encoding=wire_encoding(options.encoding),
        sparse=options.sparse,
        cu_spans=b"" if batch.cu_spans is None else _int32_bytes(batch.cu_spans),
        span_bounds=b"" if batch.span_bounds is None else _int32_bytes(batch.span_bounds.reshape(-1)),
        raw_spans=options.raw_spans,
        token_vectors=options.token_vectors,
        key_lens=b"" if batch.key_lens is None else _int32_bytes(batch.key_lens),
        maxsim=maxsim,
        all_outputs=options.all_outputs,
    )


def wire_encoding(encoding: Encoding) -> embedding_pb2.Encoding:
    """Ours as the proto's type: the same numbers (tests/test_encodings.py checks them name for name)."""
    return cast(embedding_pb2.Encoding, encoding)


def _int32_bytes(values: np.ndarray) -> bytes:
    return values.astype("<i4", copy=False).tobytes()


def response_rows(
    response: embedding_pb2.EmbedResponse, encoding: Encoding = Encoding.FLOAT32
) -> np.ndarray:  # [rows, elements] in `encoding`, read in place from the bytes
    """The rows of a reply to a request for `encoding`; ValueError when the replica answered in another (one that
    predates the field answers float32) or its bytes do not fit."""
    if response.encoding == wire_encoding(encoding):
        return rows_from_bytes(response.embeddings, encoding, response.num_seqs, response.dimension)
    if response.encoding == embedding_pb2.FLOAT32:  # a replica older than encodings: encoded here instead
        floats = rows_from_bytes(response.embeddings, Encoding.FLOAT32, response.num_seqs, response.dimension)
        return encode_rows(floats, encoding)
    raise ValueError(f"asked for {encoding.name} rows, the replica answered {Encoding(response.encoding).name}")


def response_sparse_rows(response: embedding_pb2.EmbedResponse) -> SparseRows:
    """A sparse request's rows, read in place from the bytes; ValueError when they do not fit together."""
    offsets = np.frombuffer(response.sparse_offsets, "<i4").astype(np.int32, copy=False)
    indices = np.frombuffer(response.sparse_indices, "<i4").astype(np.int32, copy=False)
    values = np.frombuffer(response.sparse_values, "<f4").astype(np.float32, copy=False)
    fits = len(offsets) == response.num_seqs + 1 and len(indices) == len(values)
    if not fits or offsets[0] != 0 or offsets[-1] != len(indices) or (np.diff(offsets) < 0).any():
        raise ValueError(
            f"sparse rows that do not fit together: {len(offsets)} offsets for {response.num_seqs} rows, "
            f"{len(indices)} indices, {len(values)} values"
        )
    return SparseRows(offsets, indices, values)


def response_outputs(response: embedding_pb2.EmbedResponse, request: embedding_pb2.EmbedRequest) -> AllOutputs:
    """An all_outputs request's dense rows, sparse rows and token vectors (without maxsim)."""
    cu_spans = np.frombuffer(request.cu_spans, "<i4").astype(np.int32, copy=False)
    return from_response(response, cu_spans, response_sparse_rows(response))


def read_reply(
    response: embedding_pb2.EmbedResponse, request: embedding_pb2.EmbedRequest
) -> np.ndarray | SparseRows | AllOutputs:
    """What a reply holds, by what its request asked: rows in its encoding, sparse rows, or all outputs."""
    if request.all_outputs and not request.maxsim:
        return response_outputs(response, request)
    return response_sparse_rows(response) if request.sparse else response_rows(response, Encoding(request.encoding))
