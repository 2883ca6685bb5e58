"""Both ends of the wire format for callers of a replica: token ids in, float32 rows out. No torch."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bouquet.proto import embedding_pb2
from bouquet.tokenizer import pack


@dataclass(frozen=True)
class RowOptions:
    """How a request's rows are finished, the same for all its sequences."""

    dimensions: int = 0  # 0 keeps the full width
    normalize: bool = True
    prompt_tokens: int = 0  # leading tokens of each sequence that are the prompt's


def embed_request(
    sequences: list[list[int]],
    dimensions: int = 0,
    normalize: bool = True,
    token_type_ids: list[list[int]] | None = None,
    prompt_tokens: int = 0,
) -> embedding_pb2.EmbedRequest:
    packed = pack(sequences)
    return embedding_pb2.EmbedRequest(
        input_ids=packed.input_ids.tolist(),
        cu_seqlens=packed.cu_seqlens.tolist(),
        token_type_ids=pack(token_type_ids).input_ids.tolist() if token_type_ids else [],
        dimensions=dimensions,
        normalize=normalize,
        prompt_tokens=prompt_tokens,
    )


def response_rows(response: embedding_pb2.EmbedResponse) -> np.ndarray:  # [num_seqs, dimension] float32
    rows = np.frombuffer(response.embeddings, dtype="<f4")
    return rows.reshape(response.num_seqs, response.dimension).astype(np.float32, copy=False)
