"""The caller's end of the wire format: a packed batch out as bytes, its rows back in the encoding it asked for.
No torch."""

from __future__ import annotations

from typing import Any, cast

import numpy as np

from bouquet.all_outputs import AllOutputs, from_response
from bouquet.batch import Batch, RowOptions
from bouquet.encodings import Encoding, encode_rows, rows_from_bytes
from bouquet.proto import embedding_pb2
from bouquet.sparse_rows import SparseRows

Reply = np.ndarray | SparseRows | AllOutputs  # rows in the encoding asked for, sparse rows, or all outputs


def embed_request(batch: Batch, maxsim: bool = False) -> embedding_pb2.EmbedRequest:
    """The batch's arrays as little-endian int32 bytes (or its images as float32), its options as the scalars
    `wire_options` writes; `maxsim`: MaxSim scores of its first sequence (a query) against each later one instead of
    rows."""
    options = wire_options(batch.options(), maxsim)
    if batch.fixed_images and batch.pixel_values is not None:  # laid out at the model's tokens per image
        if not batch.all_images:
            raise ValueError("texts beside fixed-size images make a step, not a request: send each kind alone")
        return embedding_pb2.EmbedRequest(
            pixel_values=batch.pixel_values.astype("<f4", copy=False).tobytes(),
            image_shape=batch.pixel_values.shape[1:], **options,
        )  # fmt: skip
    return embedding_pb2.EmbedRequest(
        input_ids=_int32_bytes(batch.input_ids),
        cu_seqlens=_int32_bytes(batch.cu_seqlens),
        token_type_ids=b"" if batch.token_type_ids is None else _int32_bytes(batch.token_type_ids),
        cu_spans=b"" if batch.cu_spans is None else _int32_bytes(batch.cu_spans),
        span_bounds=b"" if batch.span_bounds is None else _int32_bytes(batch.span_bounds.reshape(-1)),
        key_lens=b"" if batch.key_lens is None else _int32_bytes(batch.key_lens),
        **_patch_images(batch),
        **options,
    )


def _patch_images(batch: Batch) -> dict[str, Any]:
    """Images inside token sequences (Batch.image_grid_thw) as the request's bytes; none for a text batch."""
    if batch.image_grid_thw is None or batch.cu_images is None or batch.pixel_values is None:
        return {}
    return {
        "pixel_values": batch.pixel_values.astype("<f4", copy=False).tobytes(),
        "image_grid_thw": _int32_bytes(batch.image_grid_thw.reshape(-1)),
        "cu_images": _int32_bytes(batch.cu_images),
    }


def wire_options(options: RowOptions, maxsim: bool = False) -> dict[str, Any]:
    """The row options as the EmbedRequest's scalars: the one place they are written (replica/request.py's
    `row_options` the one place they are read)."""
    assert options.normalize is not None, "the model's default normalisation is resolved before the wire"
    return {
        "dimensions": options.dimensions or 0,
        "normalize": options.normalize,  # proto3 bool: always set, its default (False) is not ours
        "prompt_tokens": options.prompt_tokens,
        "encoding": wire_encoding(options.encoding),
        "sparse": options.sparse,
        "raw_spans": options.raw_spans,
        "token_vectors": options.token_vectors,
        "all_outputs": options.all_outputs,
        "maxsim": maxsim,
    }


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


def read_reply(response: embedding_pb2.EmbedResponse, batch: Batch, maxsim: bool = False) -> Reply:
    """What a reply to `batch` holds, by what its options asked: rows in their encoding (MaxSim scores with `maxsim`),
    sparse rows, or all outputs."""
    options = batch.options()
    if options.all_outputs and not maxsim:
        assert batch.cu_spans is not None, "all outputs come over spans"
        return from_response(response, batch.cu_spans, response_sparse_rows(response))
    return response_sparse_rows(response) if options.sparse else response_rows(response, options.encoding)
