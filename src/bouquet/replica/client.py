"""The caller's end of the wire format: a packed batch out as bytes, float32 rows back. No torch."""

from __future__ import annotations

import numpy as np

from bouquet.batch import Batch
from bouquet.proto import embedding_pb2


def embed_request(batch: Batch) -> embedding_pb2.EmbedRequest:
    """The batch's arrays as little-endian int32 bytes; its options, which all its sequences share, as scalars."""
    options = batch.options()
    return embedding_pb2.EmbedRequest(
        input_ids=_int32_bytes(batch.input_ids),
        cu_seqlens=_int32_bytes(batch.cu_seqlens),
        token_type_ids=b"" if batch.token_type_ids is None else _int32_bytes(batch.token_type_ids),
        dimensions=options.dimensions,
        normalize=options.normalize,  # proto3 bool: always set, its default (False) is not ours
        prompt_tokens=options.prompt_tokens,
        cu_spans=b"" if batch.cu_spans is None else _int32_bytes(batch.cu_spans),
        span_bounds=b"" if batch.span_bounds is None else _int32_bytes(batch.span_bounds.reshape(-1)),
        raw_spans=options.raw_spans,
    )


def _int32_bytes(values: np.ndarray) -> bytes:
    return values.astype("<i4", copy=False).tobytes()


def response_rows(response: embedding_pb2.EmbedResponse) -> np.ndarray:  # [rows, dimension] float32
    rows = np.frombuffer(response.embeddings, dtype="<f4")
    return rows.reshape(response.num_seqs, response.dimension).astype(np.float32, copy=False)
