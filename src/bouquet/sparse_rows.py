"""Sparse rows on the host: a block of vocabulary-wide rows (what the engine returns for sparse sequences) as
their nonzero entries, row after row, the compressed form the wire carries. numpy only, so the gateway can use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A sparse request's rows are vocabulary wide until the replica keeps only their nonzero entries: bge-m3's
# 250,002 ids take 1 MB a row in float32. A request holds at most this many bytes of them (the gateway cuts its
# batches to fit; a replica refuses more), and a step at most a quarter of it.
SPARSE_REQUEST_BYTES = 256 << 20
SPARSE_STEP_BYTES = SPARSE_REQUEST_BYTES // 4


def max_sparse_rows(width: int, budget: int = SPARSE_REQUEST_BYTES) -> int:
    """How many float32 rows of `width` fit in `budget` bytes (at least one)."""
    return max(1, budget // (4 * max(1, width)))


@dataclass(frozen=True)
class SparseRows:
    """Row r's entries are indices[cu_offsets[r]:cu_offsets[r + 1]] (vocabulary ids, ascending) with their
    values at the same positions."""

    cu_offsets: np.ndarray  # [R + 1] int32
    indices: np.ndarray  # [N] int32
    values: np.ndarray  # [N] float32

    @property
    def num_rows(self) -> int:
        return len(self.cu_offsets) - 1

    def row(self, index: int) -> tuple[np.ndarray, np.ndarray]:  # (indices, values) of one row: views
        start, stop = int(self.cu_offsets[index]), int(self.cu_offsets[index + 1])
        return self.indices[start:stop], self.values[start:stop]


def concat(parts: list[SparseRows]) -> SparseRows:
    """The parts' rows one after another (a request's chunks put back in order)."""
    if len(parts) == 1:
        return parts[0]
    starts = np.cumsum([0] + [len(part.indices) for part in parts[:-1]])
    offsets = [part.cu_offsets[1:] + start for part, start in zip(parts, starts, strict=True)]
    return SparseRows(
        np.concatenate([np.zeros(1, np.int32), *offsets]).astype(np.int32),
        np.concatenate([part.indices for part in parts]),
        np.concatenate([part.values for part in parts]),
    )


def sparsify(rows: np.ndarray) -> SparseRows:  # rows: [R, vocab] float32
    """The nonzero entries of each row, in row order and, within a row, by ascending index."""
    row_ids, indices = np.nonzero(rows)  # row-major: already ordered by row, then index
    cu_offsets = np.zeros(rows.shape[0] + 1, np.int32)
    np.cumsum(np.bincount(row_ids, minlength=rows.shape[0]), out=cu_offsets[1:])
    values = rows[row_ids, indices].astype(np.float32, copy=False)
    return SparseRows(cu_offsets, indices.astype(np.int32), values)


def max_by_id(
    row_index: np.ndarray,  # [L] int: the row each token belongs to
    token_ids: np.ndarray,  # [L] int
    weights: np.ndarray,  # [L] float32
    num_rows: int,
    skip_ids: tuple[int, ...] = (),
) -> SparseRows:
    """Each row's largest weight per token id, ids in `skip_ids` and weights <= 0 left out: bge-m3's lexical weights
    from its tokens' weights (FlagEmbedding's `_process_token_weights`)."""
    keep = (weights > 0) & ~np.isin(token_ids, skip_ids)
    rows, ids, values = row_index[keep], token_ids[keep], weights[keep].astype(np.float32)
    order = np.lexsort((ids, rows))  # by row, then by id
    rows, ids, values = rows[order], ids[order], values[order]
    starts = np.flatnonzero(np.diff(rows, prepend=-1) | np.diff(ids, prepend=-1))  # each (row, id) group's first
    maxima = np.maximum.reduceat(values, starts) if len(starts) else values
    cu_offsets = np.zeros(num_rows + 1, np.int32)
    np.cumsum(np.bincount(rows[starts], minlength=num_rows), out=cu_offsets[1:])
    return SparseRows(cu_offsets, ids[starts].astype(np.int32), maxima.astype(np.float32))


def dot(rows: SparseRows, index: int = 0) -> np.ndarray:  # [R] float32
    """Row `index`'s dot product with each row: the sum over the ids both hold of their values' products."""
    ids, values = rows.row(index)
    if not len(ids):
        return np.zeros(rows.num_rows, np.float32)
    at = np.minimum(np.searchsorted(ids, rows.indices), len(ids) - 1)  # ids ascend within a row
    products = np.where(ids[at] == rows.indices, values[at] * rows.values, 0.0)
    row_of_entry = np.repeat(np.arange(rows.num_rows), np.diff(rows.cu_offsets))
    return np.bincount(row_of_entry, weights=products, minlength=rows.num_rows).astype(np.float32)


def densify(sparse: SparseRows, width: int) -> np.ndarray:  # [R, width] float32
    """The rows back at full width: the inverse of `sparsify` (for clients and tests)."""
    rows = np.zeros((sparse.num_rows, width), np.float32)
    row_ids = np.repeat(np.arange(sparse.num_rows), np.diff(sparse.cu_offsets))
    rows[row_ids, sparse.indices] = sparse.values
    return rows
