"""A large request split into chunks of about `chunk_tokens` tokens, sent concurrently (each to the least
loaded replica) and put back in order."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Coroutine
from typing import Any, TypeVar

import numpy as np

from bouquet import all_outputs, sparse_rows
from bouquet.batch import Batch, token_budget_runs
from bouquet.gateway.replicas.pool import ReplicaPool
from bouquet.replica.client import Reply

_T = TypeVar("_T")


def chunk_spans(batch: Batch, chunk_tokens: int, max_seqs: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) runs of sequences in order, evened out so that none is a small leftover: the fewest chunks
    of `chunk_tokens` there can be, each given an equal share of the tokens as its budget (and at most
    `max_seqs` sequences: a sparse request's rows are vocabulary wide on the replica). Tokens as the replica's
    budget counts them (`Batch.cu_budget`: patch images' patches too)."""
    total = batch.budget_tokens
    target = total / max(1, math.ceil(total / chunk_tokens))
    return token_budget_runs(batch.cu_budget, target, max_seqs)


async def embed_chunked(
    pool: ReplicaPool, model: str, batch: Batch, chunk_tokens: int, priority: int = 0, max_seqs: int | None = None
) -> Reply:  # [B, elements] in the batch's encoding, or its sparse rows, or its AllOutputs
    spans = chunk_spans(batch, chunk_tokens, max_seqs)
    if len(spans) == 1:
        return await pool.embed(model, batch, priority)
    parts = await all_or_none([pool.embed(model, batch.slice(start, stop), priority) for start, stop in spans])
    if batch.any_all_outputs:
        return all_outputs.concat(parts)  # type: ignore[arg-type]
    return sparse_rows.concat(parts) if batch.any_sparse else np.concatenate(parts)  # type: ignore[arg-type]


async def maxsim_chunked(
    pool: ReplicaPool, model: str, batch: Batch, chunk_tokens: int, priority: int = 0
) -> np.ndarray:  # [B - 1, 1] float32; [B - 1, 3] with all outputs (all_outputs.MODES)
    """MaxSim scores of the batch's first sequence (a query) against each later one (documents), or its three
    scores with all outputs (bge-m3's): the documents
    chunked as an embedding batch is, each chunk sent with its own copy of the query (a few dozen tokens), so that
    token vectors never leave the replica."""
    query, documents = batch.slice(0, 1), batch.slice(1, batch.num_seqs)
    spans = chunk_spans(documents, max(1, chunk_tokens - query.budget_tokens))
    chunks = [Batch.concat([query, documents.slice(start, stop)]) for start, stop in spans]
    parts = await all_or_none([pool.embed(model, chunk, priority, maxsim=True) for chunk in chunks])
    return np.concatenate(parts)  # type: ignore[arg-type]


async def all_or_none(calls: list[Coroutine[Any, Any, _T]]) -> list[_T]:
    """Every call's result in order (a request's chunks, or its text and image jobs). A task group: when one fails
    (a full queue, a bad input) its siblings are cancelled, so the replicas drop their queued work at once instead of
    computing rows for a request that has already been answered."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(call) for call in calls]
    except* Exception as failures:
        raise failures.exceptions[0] from None
    return [task.result() for task in tasks]
