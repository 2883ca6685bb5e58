"""Inputs longer than the model's limit, embedded whole instead of truncated (`"long_input": "chunk"`, as vLLM's
chunked processing): each input's tokens are cut into windows that fit the limit, each window framed by the
model's own special tokens (and the prompt, so every window is read as the model was trained to read one), every
window pooled on the replicas, and the input's vector is the average of its windows' vectors weighted by the
tokens of text each holds; then truncated to `dimensions` and normalised, as one row would be. Usage counts every
token computed, the frames included."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Windows:
    sequences: list[list[int]]  # every window of every input, in order
    owners: np.ndarray  # [W] int: the input each window belongs to
    weights: np.ndarray  # [W] float32: the text tokens each window holds


def cut(contents: list[list[int]], prefix: list[int], suffix: list[int], limit: int) -> Windows:
    """Each input's text tokens `contents[i]` in windows of `prefix + piece + suffix` of at most `limit` tokens."""
    budget = limit - len(prefix) - len(suffix)
    if budget < 1:
        raise ValueError(f"the model's limit of {limit} leaves no room for text between its special tokens")
    sequences: list[list[int]] = []
    owners: list[int] = []
    weights: list[int] = []
    for index, content in enumerate(contents):
        pieces = [content[start : start + budget] for start in range(0, len(content), budget)] or [[]]
        for piece in pieces:
            sequences.append([*prefix, *piece, *suffix])
            owners.append(index)
            weights.append(max(1, len(piece)))
    return Windows(sequences, np.asarray(owners), np.asarray(weights, np.float32))


def combine(rows: np.ndarray, windows: Windows, inputs: int, dimensions: int | None, normalize: bool) -> np.ndarray:
    """[W, width] window rows (not normalised, full width) -> [inputs, dimensions or width] input rows."""
    sums = np.zeros((inputs, rows.shape[1]), np.float64)
    np.add.at(sums, windows.owners, rows.astype(np.float64) * windows.weights[:, None])
    totals = np.bincount(windows.owners, weights=windows.weights, minlength=inputs)
    averaged = sums / totals[:, None]
    if dimensions:
        averaged = averaged[:, :dimensions]
    if normalize:
        averaged /= np.maximum(np.linalg.norm(averaged, axis=1, keepdims=True), 1e-12)
    return averaged.astype(np.float32)
