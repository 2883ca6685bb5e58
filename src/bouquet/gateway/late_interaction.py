"""Per-token (ColBERT, "multi-vector") vectors: a model's queries and documents laid out as its own library
tokenizes them, and every kept token's vector computed as a span of one (docs/late-interaction.md).

The layout is PyLate's `ColBERT.tokenize` and `encode` (which Stanford's ColBERT and bge-m3 agree with for what they
share): the text is tokenized to `length - len(prefix)` tokens, the prefix ids ("[Q] ", "[D] ") go after the first
token; a query is padded with the expansion token ([MASK]) to the query length, and every one of its tokens is
kept, the expansion tokens included (hidden from attention unless the model attends to them: `key_lens`); a
document keeps every token but those of its skiplist (punctuation). bge-m3 leaves out its first token ([CLS]).
The replica computes each kept token's state, projects it (the model's multi-vector projection) and normalises it
(replica side: `Batch.token_vectors`), the same span machinery `/embed_all` uses. A ColBERT model reranks on the
replicas too: a query's MaxSim against each document (`maxsim_scores`), where only the scores come back.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.gateway.errors import InvalidRequest, TooLarge
from bouquet.gateway.jobs import MultiVectorJob, RerankJob
from bouquet.gateway.service import complete_options
from bouquet.proto import embedding_pb2

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service


@dataclass(frozen=True)
class Layout:
    """A request's sequences as the replica computes them: ids, the kept tokens as spans of one, and how many
    leading tokens of each are keys (None: all)."""

    sequences: list[list[int]]
    spans: list[list[tuple[int, int]]]
    key_lens: list[int] | None


def token_limit(info: embedding_pb2.MultiVector, is_query: bool) -> int:
    """The tokens a text is tokenized to, before its prefix goes in."""
    length = info.query_length if is_query else info.document_length
    return length - len(info.query_prefix if is_query else info.document_prefix)


def lay_out(token_ids: list[list[int]], info: embedding_pb2.MultiVector, is_query: bool) -> Layout:
    """Token ids (tokenized to `token_limit`, special tokens included) as the model's library feeds them."""
    prefix = list(info.query_prefix if is_query else info.document_prefix)
    expand = is_query and info.expand_queries
    skip = set() if is_query else set(info.skiplist)
    sequences, spans, key_lens = [], [], []
    for ids in token_ids:
        sequence = [*ids[:1], *prefix, *ids[1:]]
        key_lens.append(len(sequence))
        if expand:
            sequence += [info.expansion_id] * (info.query_length - len(sequence))
        kept = [i for i in range(info.skip_leading, len(sequence)) if sequence[i] not in skip]
        sequences.append(sequence)
        spans.append([(i, i + 1) for i in kept])
    hidden = expand and not info.attend_to_expansion
    return Layout(sequences, spans, key_lens if hidden else None)


def pack(layout: Layout, options: RowOptions) -> Batch:
    return Batch.pack(layout.sequences, options, spans=layout.spans, key_lens=layout.key_lens)


async def token_vectors(service: Service, job: MultiVectorJob) -> tuple[ServedModel, list[np.ndarray], int]:
    """Each input's token vectors ([kept tokens, width], in the job's encoding), and the tokens computed."""
    model = service.catalog.get(job.model)
    info = model.multi_vector  # its replica's Info told the catalog, at discovery
    if info is None:
        raise model.wrong_task("per-token (multi-vector) vectors")
    service.check_inputs(len(job.texts))
    is_query = job.input_type == "query"
    limit = token_limit(info, is_query)
    options = complete_options(job.options, model)
    layouts: list[Layout] = []

    async def batch() -> Batch:
        ids = await _token_ids(model, job.texts, job.truncate, limit, "input")
        layouts.append(lay_out(ids, info, is_query))
        check_vectors(sum(map(len, layouts[0].spans)), service.config.max_token_vectors)
        return pack(layouts[0], options)

    rows, tokens = await service.compute(model, _estimate(job.texts, info, is_query), batch)
    counts = np.array([len(spans) for spans in layouts[0].spans])
    return model, np.split(rows, np.cumsum(counts)[:-1]), tokens


async def maxsim_scores(
    service: Service, model: ServedModel, job: RerankJob, all_outputs: bool = False,
    max_lengths: tuple[int | None, int | None] = (None, None),
) -> tuple[np.ndarray, int]:  # fmt: skip
    """Each (query, document) pair's MaxSim score ([N, 1] float32, PyLate's `colbert_scores`), or with
    `all_outputs` its dense, sparse and ColBERT scores ([N, 3], bge-m3's: bouquet/all_outputs.py), computed on the
    replicas over token vectors that never cross the wire, one request to them per distinct query; and the tokens
    computed. `max_lengths`: the tokens a query and a document keep (FlagEmbedding's max_query_length and
    max_passage_length), within the model's layout; None: the layout's."""
    info = model.multi_vector
    assert info is not None, "a multi-vector model's replica describes its layout"
    if job.instruction is not None:
        raise InvalidRequest(f"the model {model.id!r} takes no instruction", "unsupported_parameter", "instruction")
    service.check_inputs(len(job.pairs))
    by_query: dict[str, list[int]] = {}
    for index, (query, _) in enumerate(job.pairs):
        by_query.setdefault(query, []).append(index)
    limits = tuple(
        token_limit(info, is_query) if length is None else min(length, token_limit(info, is_query))
        for length, is_query in zip(max_lengths, (True, False), strict=True)
    )
    results = await asyncio.gather(
        *(_score_query(service, model, info, query, [job.pairs[i][1] for i in indices], job.truncate, all_outputs,
                       limits) for query, indices in by_query.items())
    )  # fmt: skip
    scores = np.empty((len(job.pairs), 3 if all_outputs else 1), np.float32)
    for indices, (query_scores, _) in zip(by_query.values(), results, strict=True):
        scores[indices] = query_scores
    return scores, sum(tokens for _, tokens in results)


async def _score_query(
    service: Service, model: ServedModel, info: embedding_pb2.MultiVector, query: str, documents: list[str],
    truncate: bool, all_outputs: bool, limits: tuple[int, ...],
) -> tuple[np.ndarray, int]:  # fmt: skip
    async def batch() -> Batch:
        query_ids = await _token_ids(model, [query], truncate, limits[0], "query")
        document_ids = await _token_ids(model, documents, truncate, limits[1], "documents")
        options = RowOptions(normalize=True, token_vectors=True, all_outputs=all_outputs)
        return Batch.concat(
            [pack(lay_out(query_ids, info, True), options), pack(lay_out(document_ids, info, False), options)]
        )

    estimate = _estimate([query], info, True) + _estimate(documents, info, False)
    return await service.compute(model, estimate, batch, maxsim=True)


async def _token_ids(model: ServedModel, texts: list[str], truncate: bool, limit: int, field: str) -> list[list[int]]:
    ids = await model.require_tokenizer().encode(texts, "", truncate, "right", limit)
    if any(len(sequence) > limit for sequence in ids):
        # Over a length limit, as over the model's (replicas/tokenization.py): the same 413 and code.
        raise TooLarge(f"an input is over {limit} tokens and truncate is false", "input_too_long", field)
    return ids


def _estimate(texts: list[str], info: embedding_pb2.MultiVector, is_query: bool) -> int:
    """At least the tokens the texts will take, before tokenizing."""
    if is_query and info.expand_queries:  # every query is padded to the query length
        return len(texts) * info.query_length
    limit = token_limit(info, is_query)  # a token is at least a byte, plus the special tokens and the prefix
    prefix = info.query_prefix if is_query else info.document_prefix
    return sum(min(len(text.encode()) + 4, limit) + len(prefix) for text in texts)


def check_vectors(vectors: int, limit: int, field: str = "input") -> None:
    """Token vectors are bounded per request, as sparse rows are: a document's are ~256 KB at 128 float32
    dimensions, so a request of 2,048 long documents would answer half a gigabyte. `field`: the route's name for
    its inputs."""
    if vectors > limit:
        message = (
            f"the inputs give {vectors} token vectors, over the limit of {limit} a request: send fewer inputs a "
            "request (--max-token-vectors)"
        )
        raise TooLarge(message, "too_many_token_vectors", field)
