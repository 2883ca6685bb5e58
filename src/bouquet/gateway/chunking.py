"""A large request split into chunks of about `chunk_tokens` tokens, sent concurrently (each to the least
loaded replica) and put back in order."""

from __future__ import annotations

import asyncio
import math

import numpy as np

from bouquet.gateway.pool import ReplicaPool
from bouquet.replica.client import RowOptions


def chunk_spans(lengths: list[int], chunk_tokens: int) -> list[tuple[int, int]]:
    """[start, end) ranges of sequences in order; chunks are evened out so none is a small leftover."""
    total = sum(lengths)
    target = total / max(1, math.ceil(total / chunk_tokens))
    spans: list[tuple[int, int]] = []
    start, tokens = 0, 0
    for index, length in enumerate(lengths):
        if index > start and tokens + length > target:
            spans.append((start, index))
            start, tokens = index, 0
        tokens += length
    spans.append((start, len(lengths)))
    return spans


async def embed_chunked(
    pool: ReplicaPool, model: str, sequences: list[list[int]], options: RowOptions, chunk_tokens: int
) -> np.ndarray:  # [N, dim] float32
    lengths = [len(sequence) for sequence in sequences]
    spans = chunk_spans(lengths, chunk_tokens)
    if len(spans) == 1:
        return await pool.embed(model, sequences, sum(lengths), options)
    parts = await asyncio.gather(*(pool.embed(model, sequences[a:b], sum(lengths[a:b]), options) for a, b in spans))
    return np.concatenate(parts)
