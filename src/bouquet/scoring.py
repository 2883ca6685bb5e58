"""A score model's activation (sentence-transformers' CrossEncoder `activation_fn`) on its raw logits: the
replica returns logits, and what a route shows (TEI's `raw_scores`, a reranker's relevance) is decided here, on
the host, without torch."""

from __future__ import annotations

import numpy as np

SCORE_ACTIVATIONS = ("Identity", "Sigmoid", "Tanh", "Softmax")


def activate(logits: np.ndarray, name: str) -> np.ndarray:  # [B, labels] float32 -> the same shape
    if name == "Sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    if name == "Tanh":
        return np.tanh(logits)
    if name == "Softmax":
        shifted = np.exp(logits - logits.max(axis=1, keepdims=True))
        return shifted / shifted.sum(axis=1, keepdims=True)
    assert name == "Identity", f"unknown score activation {name!r}; known: {', '.join(SCORE_ACTIVATIONS)}"
    return logits


def maxsim(rows: np.ndarray, cu_rows: np.ndarray) -> np.ndarray:  # -> [B - 1] float32
    """ColBERT's late-interaction score of sequence 0 (a query) against each later sequence (a document): each of
    the query's token vectors takes its largest dot product with the document's vectors, and these are summed.
    rows: [R, D] float32 token vectors, sequence i's rows cu_rows[i]:cu_rows[i + 1], each sequence at least one."""
    query = rows[cu_rows[0] : cu_rows[1]]
    similarities = rows[cu_rows[1] :] @ query.T  # [document rows, query rows]
    best = np.maximum.reduceat(similarities, cu_rows[1:-1] - cu_rows[1], axis=0)  # [B - 1, query rows]
    return best.sum(axis=1, dtype=np.float32)
