"""Rows pooled over spans of a sequence: contextual (late-chunked) embeddings in Perplexity's shape
(`/v1/contextualizedembeddings`), and TEI's `/embed_all`, every token a span of one (docs/contextual.md).

Late chunking: a document's chunks are tokenized alone, joined, and wrapped once in the model's special tokens,
so the model reads the whole document; each chunk's vector is the mean of its own tokens' states. A document
longer than the model's limit is read in overlapping windows, and each chunk is pooled from one of them
(`assign_windows`).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.jobs import ContextualJob, EmbedJob
from bouquet.gateway.service import complete_options, embedding_model

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service

WINDOW_OVERLAP = 4  # windows overlap by 1/WINDOW_OVERLAP of their content


def windows(length: int, capacity: int) -> list[tuple[int, int]]:
    """[start, stop) token ranges of a document's windows: the whole document when it fits in `capacity`; else
    windows of `capacity` tokens each starting (capacity - capacity // WINDOW_OVERLAP) after the previous, the
    last moved back to end at the document's end."""
    if length <= capacity:
        return [(0, length)]
    stride = capacity - capacity // WINDOW_OVERLAP
    starts = [*range(0, length - capacity, stride), length - capacity]
    return [(start, start + capacity) for start in starts]


def assign_windows(chunks: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:  # [K] int
    """The window each chunk ([K, 2] token ranges) is pooled from: the one holding most of its tokens; among
    those holding as many, the one where it sits farthest from an edge (the most context on its scarcer side);
    then the earliest."""
    bounds = np.array(spans)  # [W, 2]
    starts, stops = chunks[:, :1], chunks[:, 1:]  # [K, 1]
    held = np.clip(np.minimum(stops, bounds[:, 1]) - np.maximum(starts, bounds[:, 0]), 0, None)  # [K, W]
    margin = np.minimum(starts - bounds[:, 0], bounds[:, 1] - stops)  # [K, W], negative when cut
    capacity = int((bounds[:, 1] - bounds[:, 0]).max())
    best: np.ndarray = np.argmax(held * (4 * capacity + 1) + np.clip(margin, -capacity, capacity), axis=1)
    return best


@dataclass
class Plan:
    """A request's documents as sequences with spans, and the row each chunk's vector will be (in input order)."""

    sequences: list[list[int]] = field(default_factory=list)
    spans: list[list[tuple[int, int]]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)  # per chunk, across documents

    def add_document(self, chunk_ids: list[list[int]], before: list[int], after: list[int], limit: int) -> None:
        lengths = np.array([len(ids) for ids in chunk_ids])
        ends = np.cumsum(lengths)
        chunks = np.stack([ends - lengths, ends], axis=1)  # [K, 2] within the document's tokens
        tokens = [token for ids in chunk_ids for token in ids]
        ranges = windows(len(tokens), limit - len(before) - len(after))
        chosen = assign_windows(chunks, ranges)
        first_row = sum(map(len, self.spans))
        rows = np.empty(len(chunk_ids), np.int64)
        for window, (start, stop) in enumerate(ranges):
            members = np.flatnonzero(chosen == window)
            if not len(members):
                continue  # a window no chunk is pooled from is not computed
            rows[members] = first_row + np.arange(len(members))
            first_row += len(members)
            cut = np.clip(chunks[members], start, stop) - start + len(before)
            self.sequences.append(before + tokens[start:stop] + after)
            self.spans.append([(int(a), int(b)) for a, b in cut])
        self.rows.extend(rows.tolist())


def _empty_chunk(chunk_ids: list[list[list[int]]]) -> tuple[int, int] | None:
    return next(((d, c) for d, doc in enumerate(chunk_ids) for c, ids in enumerate(doc) if not ids), None)


async def contextual_embeddings(service: Service, job: ContextualJob) -> tuple[ServedModel, list[np.ndarray], int]:
    """Each document's chunk vectors ([chunks, elements] in the job's encoding), and the tokens computed."""
    model = embedding_model(service, job.model)
    service.check_inputs(job.num_chunks)
    options = complete_options(job.options, model)
    plan = Plan()

    async def batch() -> Batch:
        tokenizer = model.require_tokenizer()
        flat = await tokenizer.encode_text_only([chunk for chunks in job.documents for chunk in chunks])
        before, after = tokenizer.frame(model.prompt(None))  # the model's default prompt, if it has one
        starts = np.cumsum([0, *map(len, job.documents)])
        chunk_ids = [flat[a:b] for a, b in itertools.pairwise(starts)]
        if (empty := _empty_chunk(chunk_ids)) is not None:
            message = f"'input[{empty[0]}][{empty[1]}]' has no tokens (only characters the tokenizer drops)"
            raise InvalidRequest(message, "empty_input", "input")
        if len(before) + len(after) >= model.max_seq_length:
            message = f"the prompt and special tokens fill {model.id!r}'s limit of {model.max_seq_length} tokens"
            raise InvalidRequest(message, "input_too_long", "input")
        for ids in chunk_ids:
            plan.add_document(ids, before, after, model.max_seq_length)
        return Batch.pack(plan.sequences, options, spans=plan.spans)

    rows, tokens = await service.compute(model, _estimate(job, model), batch)
    ordered = rows[plan.rows]
    ends = np.cumsum([len(chunks) for chunks in job.documents])[:-1]
    return model, np.split(ordered, ends), tokens


def _estimate(job: ContextualJob, model: ServedModel) -> int:
    """At least the tokens the documents will take (a token is at least a byte, plus specials and a token a
    chunk for a tokenizer's word-start mark), windows and their overlap included."""
    limit = model.max_seq_length
    total = 0
    for chunks in job.documents:
        length = sum(len(chunk.encode()) + 1 for chunk in chunks)
        total += length + 4 if length + 4 <= limit else len(windows(length, limit - 4)) * limit
    return total


async def embed_all(service: Service, job: EmbedJob) -> tuple[ServedModel, list[np.ndarray], int]:
    """Every token's state as the model outputs it, per input ([tokens, hidden] float32): a span of one per
    token, raw (no Dense modules, no normalisation), special and prompt tokens included, as TEI answers."""
    model = embedding_model(service, job.model)
    service.check_inputs(job.num_inputs)
    cu_seqlens = np.zeros(1, np.int32)

    parts = _split_mixed(job)

    async def batch() -> Batch:
        nonlocal cu_seqlens
        encoded = await asyncio.gather(*(service.sequences(part, model) for part in parts))
        if len(parts) == 1:
            sequences = encoded[0]
        else:
            texts, ids = encoded
            sequences = _interleave(texts, ids, job.text_positions or ())
        packed = Batch.pack(sequences, RowOptions(normalize=False, raw_spans=True))
        cu_seqlens = packed.cu_seqlens
        positions = np.arange(packed.num_tokens, dtype=np.int32) - np.repeat(packed.cu_seqlens[:-1], packed.seq_lens)
        return packed.with_spans(packed.cu_seqlens, np.stack([positions, positions + 1], axis=1), raw=True)

    prompt_tokens = model.require_tokenizer().prompt_tokens(model.prompt(job.prompt_name)) if job.texts else 0
    estimate = sum(service.estimate(part, model, prompt_tokens) for part in parts)
    rows, tokens = await service.compute(model, estimate, batch)
    return model, np.split(rows, cu_seqlens[1:-1]), tokens


def _split_mixed(job: EmbedJob) -> list[EmbedJob]:
    """The job, or for texts and token ids mixed, a job of its texts and one of its ids."""
    if job.text_positions is None:
        return [job]
    return [replace(job, token_ids=None, text_positions=None), replace(job, texts=None, text_positions=None)]


def _interleave(texts: list[list[int]], ids: list[list[int]], text_positions: tuple[int, ...]) -> list[list[int]]:
    """The texts' sequences back at their positions in the input, the ids' in the places between."""
    is_text = set(text_positions)
    text_iter, id_iter = iter(texts), iter(ids)
    return [next(text_iter) if index in is_text else next(id_iter) for index in range(len(texts) + len(ids))]
