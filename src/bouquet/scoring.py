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
