"""bge-m3's three outputs on the host, numpy only: the replica cuts them out of one forward's rows and scores them,
the gateway reads them off the wire (docs/late-interaction.md, "bge-m3's three outputs").

A sequence asking for all outputs (Batch.all_outputs) comes back from the engine as its pooled row, the dense
embedding, then one row per span (spans of one token: every token but the first), each `[weight, *vector]`: the
token's weight from the token-weight sparse head and, when token vectors were asked, its ColBERT vector. Here the
weights become each sequence's lexical weights (the largest per token id, the special tokens' ids left out, as
FlagEmbedding's `_process_token_weights`), and a query's three scores against each document are FlagEmbedding's
`compute_score`: the dense rows' dot product, the sparse rows' (the sum over shared ids of the weights' products),
and MaxSim divided by the query's token vectors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from bouquet import sparse_rows
from bouquet.batch import Batch
from bouquet.proto import embedding_pb2
from bouquet.scoring import maxsim
from bouquet.sparse_rows import SparseRows

MODES = ("dense", "sparse", "colbert")  # a scores row's columns, the order of FlagEmbedding's weights
DEFAULT_WEIGHTS = (1.0, 1.0, 1.0)  # compute_score's when `weights_for_different_modes` is not given


@dataclass(frozen=True)
class AllOutputs:
    """Each sequence's dense row, sparse row and (when asked) token vectors: sequence i's are
    tokens[cu_tokens[i]:cu_tokens[i + 1]]."""

    dense: np.ndarray  # [B, D] float32
    sparse: SparseRows  # B rows
    tokens: np.ndarray | None  # [S, token dimension] float32; None: not asked
    cu_tokens: np.ndarray  # [B + 1] int64

    @property
    def num_rows(self) -> int:
        return len(self.dense)

    def token_vectors(self, index: int) -> np.ndarray:  # [tokens, token dimension] float32
        assert self.tokens is not None, "token vectors were not asked for"
        return self.tokens[self.cu_tokens[index] : self.cu_tokens[index + 1]]


def split_rows(
    rows: np.ndarray,  # [R, width] float32: the engine's for `batch`
    batch: Batch,
    dimension: int,  # the pooled row's width
    token_dimension: int,  # a token vector's width; 0: not asked
    unweighted_ids: tuple[int, ...],
) -> AllOutputs:
    assert batch.cu_spans is not None and batch.span_bounds is not None, "all outputs come with spans"
    pooled_at = batch.cu_rows[:-1]
    spans = np.ones(len(rows), bool)
    spans[pooled_at] = False
    counts = np.diff(batch.cu_spans)
    span_seq = np.repeat(np.arange(batch.num_seqs), counts)  # [S]
    token_ids = batch.input_ids[batch.cu_seqlens[span_seq] + batch.span_bounds[:, 0]]
    span_rows = rows[spans]
    sparse = sparse_rows.max_by_id(span_seq, token_ids, span_rows[:, 0], batch.num_seqs, unweighted_ids)
    tokens = np.ascontiguousarray(span_rows[:, 1 : 1 + token_dimension]) if token_dimension else None
    cu_tokens = np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])
    return AllOutputs(np.ascontiguousarray(rows[pooled_at, :dimension]), sparse, tokens, cu_tokens)


def scores(outputs: AllOutputs) -> np.ndarray:  # [B - 1, 3] float32: MODES' columns
    """Sequence 0's (a query's) dense, sparse and ColBERT scores against each later sequence (FlagEmbedding's
    compute_score; the dense rows and token vectors normalised)."""
    assert outputs.tokens is not None, "scores need the token vectors"
    dense = outputs.dense[1:] @ outputs.dense[0]
    sparse = sparse_rows.dot(outputs.sparse)[1:]
    query_vectors = int(outputs.cu_tokens[1])
    colbert = maxsim(outputs.tokens, outputs.cu_tokens) / query_vectors
    return np.stack([dense, sparse, colbert], axis=1).astype(np.float32)


def weighted(scores: np.ndarray, weights: tuple[float, float, float] | None) -> dict[str, np.ndarray]:
    """compute_score's answer from [N, 3] scores: each mode's, 'sparse+dense' and 'colbert+sparse+dense', the
    weighted means by `weights` (dense, sparse, colbert; DEFAULT_WEIGHTS when None)."""
    dense_weight, sparse_weight, colbert_weight = weights or DEFAULT_WEIGHTS
    dense, sparse, colbert = (scores[:, column] for column in range(3))
    with np.errstate(invalid="ignore", divide="ignore"):  # 'sparse+dense' of weights (0, 0, w): not a number
        pair = (sparse * sparse_weight + dense * dense_weight) / (sparse_weight + dense_weight)
    total = colbert * colbert_weight + sparse * sparse_weight + dense * dense_weight
    return {"colbert": colbert, "sparse": sparse, "dense": dense, "sparse+dense": pair,
            "colbert+sparse+dense": total / (dense_weight + sparse_weight + colbert_weight)}  # fmt: skip


def concat(parts: list[AllOutputs]) -> AllOutputs:
    """The parts' sequences one after another (a request's chunks put back in order)."""
    if len(parts) == 1:
        return parts[0]
    tokens = None if parts[0].tokens is None else np.concatenate([part.tokens for part in parts])
    counts = np.concatenate([np.diff(part.cu_tokens) for part in parts])
    return AllOutputs(
        np.concatenate([part.dense for part in parts]),
        sparse_rows.concat([part.sparse for part in parts]),
        tokens,
        np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)]),
    )


def to_response(outputs: AllOutputs) -> embedding_pb2.EmbedResponse:
    sparse, tokens = outputs.sparse, outputs.tokens
    return embedding_pb2.EmbedResponse(
        embeddings=outputs.dense.astype("<f4").tobytes(), num_seqs=outputs.num_rows,
        dimension=outputs.dense.shape[1], encoding=embedding_pb2.FLOAT32,
        sparse_offsets=sparse.cu_offsets.astype("<i4").tobytes(), sparse_indices=sparse.indices.astype("<i4").tobytes(),
        sparse_values=sparse.values.astype("<f4").tobytes(),
        token_rows=b"" if tokens is None else tokens.astype("<f4").tobytes(),
        token_dimension=0 if tokens is None else tokens.shape[1],
    )  # fmt: skip


def from_response(response: embedding_pb2.EmbedResponse, cu_spans: np.ndarray, sparse: SparseRows) -> AllOutputs:
    """A reply's outputs (its sparse rows already read), sequence i's token vectors its spans'
    (`cu_spans[i]:cu_spans[i + 1]` of the request); ValueError when the bytes do not fit."""
    dense = np.frombuffer(response.embeddings, "<f4").astype(np.float32, copy=False)
    width, token_width = max(1, response.dimension), max(1, response.token_dimension)
    tokens = np.frombuffer(response.token_rows, "<f4").astype(np.float32, copy=False)
    fits = len(dense) == response.num_seqs * response.dimension and sparse.num_rows == response.num_seqs
    fits = fits and len(cu_spans) == response.num_seqs + 1
    fits = fits and (not len(tokens) or len(tokens) == int(cu_spans[-1]) * response.token_dimension)
    if not fits:
        raise ValueError(
            f"all outputs that do not fit together: {len(dense)} dense values for {response.num_seqs} rows of "
            f"{response.dimension}, {sparse.num_rows} sparse rows, {len(tokens)} token values"
        )
    token_rows = tokens.reshape(-1, token_width) if len(tokens) else None
    return AllOutputs(dense.reshape(-1, width), sparse, token_rows, cu_spans.astype(np.int64))
