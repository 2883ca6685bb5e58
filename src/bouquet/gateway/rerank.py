"""Reranking, shaped as the servers people switch from answer it: TEI's `/rerank` (`query`, `texts`), Cohere's,
Jina's and vLLM's `/v1/rerank` (`query`, `documents`, `top_n`, `return_documents`; also `/rerank` with
`documents`), and vLLM's `/score` (`text_1`, `text_2`). A cross-encoder scores each (query, document) pair on
the replicas, chunked and balanced like an embedding batch; the model's activation (CrossEncoder's) is applied
here unless the client asks for raw scores. A decoder reranker (Qwen3-Reranker) reads each pair through its prompt
template, with the model's default instruction or the request's `instruction` (every route takes it)."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.schemas import optional_field, refuse_unknown, truncation_direction
from bouquet.scoring import activate

if TYPE_CHECKING:
    from bouquet.gateway.app import Gateway
    from bouquet.gateway.replicas.catalog import ServedModel


# What each route honours; anything else a client sends is refused by name rather than silently ignored.
_TEI_FIELDS = {
    "query", "texts", "model", "raw_scores", "return_text", "truncate", "truncation_direction", "instruction"
}  # fmt: skip
_ACTIVATION_FIELDS = {"activation", "use_activation"}  # vLLM's: false for the raw logits (TEI's raw_scores)
_RERANK_FIELDS = {"query", "documents", "model", "top_n", "return_documents", "instruction", *_ACTIVATION_FIELDS}
_SCORE_FIELDS = {"text_1", "text_2", "model", "truncate", "instruction", *_ACTIVATION_FIELDS}
# vLLM's newer names for /score's two sides, each taken for text_1 or text_2
_SCORE_ALIASES = {"queries": "text_1", "data_1": "text_1", "documents": "text_2", "items": "text_2", "data_2": "text_2"}


@dataclass(frozen=True)
class RerankJob:
    model: str | None
    pairs: list[tuple[str, str]]  # (query, document), in the client's document order
    truncate: bool = True
    raw_scores: bool = False
    instruction: str | None = None  # a decoder reranker's, in its pair template; None: the model's default


def parse_tei_rerank(body: dict[str, Any], strict: bool = True) -> tuple[RerankJob, bool]:
    """TEI's body, and whether to return each text."""
    if strict:
        refuse_unknown(body, _TEI_FIELDS)
    if truncation_direction(body) != "right":
        message = "truncation_direction 'left' is not supported for pairs: the longer part is cut from its end"
        raise InvalidRequest(message, "unsupported_parameter", "truncation_direction")
    query = _text(body, "query")
    texts = _texts(body.get("texts"), "texts")
    truncate = optional_field(body, "truncate", bool)
    job = RerankJob(
        model=optional_field(body, "model", str),
        pairs=[(query, text) for text in texts],
        truncate=True if truncate is None else truncate,
        raw_scores=bool(optional_field(body, "raw_scores", bool)),
        instruction=optional_field(body, "instruction", str),
    )
    return job, bool(optional_field(body, "return_text", bool))


def parse_cohere_rerank(body: dict[str, Any], strict: bool = True) -> tuple[RerankJob, int | None, bool]:
    """Cohere's, Jina's and vLLM's body (documents as strings or {"text": ...}), its top_n and return_documents."""
    if strict:
        refuse_unknown(body, _RERANK_FIELDS)
    query = _text(body, "query")
    documents = [_document_text(document, index) for index, document in enumerate(_list(body, "documents"))]
    top_n = optional_field(body, "top_n", int)
    if top_n is not None and top_n < 1:
        raise InvalidRequest(f"'top_n' must be at least 1, got {top_n}", "invalid_value", "top_n")
    return_documents = optional_field(body, "return_documents", bool)
    job = RerankJob(
        model=optional_field(body, "model", str),
        pairs=[(query, text) for text in documents],
        raw_scores=_raw_scores(body),
        instruction=optional_field(body, "instruction", str),
    )
    return job, top_n, True if return_documents is None else return_documents


def parse_score(body: dict[str, Any], strict: bool = True) -> RerankJob:
    """vLLM's /score: `text_1` one query against every `text_2`, or two lists of the same length, pair by pair."""
    body = _score_aliases(body)
    if strict:
        refuse_unknown(body, _SCORE_FIELDS)
    first, second = body.get("text_1"), body.get("text_2")
    queries = [_text(body, "text_1")] if isinstance(first, str) else _texts(first, "text_1")
    documents = [_text(body, "text_2")] if isinstance(second, str) else _texts(second, "text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        message = f"'text_1' has {len(queries)} texts and 'text_2' {len(documents)}: give one text_1, or as many"
        raise InvalidRequest(message, "invalid_value", "text_1")
    truncate = optional_field(body, "truncate", bool)
    return RerankJob(
        optional_field(body, "model", str),
        list(zip(queries, documents, strict=True)),
        truncate is not False,
        raw_scores=_raw_scores(body),
        instruction=optional_field(body, "instruction", str),
    )


def _score_aliases(body: dict[str, Any]) -> dict[str, Any]:
    """The body with vLLM's newer side names (queries, documents, items, data_1, data_2) as text_1 and text_2."""
    renamed = dict(body)
    for alias, name in _SCORE_ALIASES.items():
        if alias in body:
            if name in renamed:
                raise InvalidRequest(f"'{alias}' and another field both give {name}; send one", "invalid_value", alias)
            renamed[name] = renamed.pop(alias)
    return renamed


def _raw_scores(body: dict[str, Any]) -> bool:
    """vLLM's `activation` (older) or `use_activation`: false asks for the logits, the model's activation undone."""
    values = {optional_field(body, name, bool) for name in sorted(_ACTIVATION_FIELDS)} - {None}
    if len(values) > 1:
        raise InvalidRequest("'activation' and 'use_activation' disagree", "invalid_value", "use_activation")
    return values == {False}


async def score(gateway: Gateway, job: RerankJob) -> tuple[ServedModel, np.ndarray, int]:
    """One score per pair ([N] float32), and the tokens computed."""
    model = score_model(gateway, job.model)
    gateway.check_inputs(len(job.pairs))
    instruction = pair_instruction(model, job.instruction)

    async def batch() -> Batch:
        ids, types = await model.require_tokenizer().encode_pairs(job.pairs, job.truncate, instruction)
        return Batch.pack(ids, RowOptions(normalize=False), types)

    logits, tokens = await gateway.compute(model, estimate_pairs(job.pairs, job.truncate, model, instruction), batch)
    scores = logits if job.raw_scores else activate(logits, model.score_activation)
    return model, scores[:, 0].astype(np.float32), tokens


def score_model(gateway: Gateway, name: str | None) -> ServedModel:
    """The model a scoring request names; an embedding model is refused (TEI's 424 on its routes)."""
    model = gateway.catalog.get(name)
    if model.task != "score":
        raise model.wrong_task("scores; rerank with a cross-encoder")
    return model


def pair_instruction(model: ServedModel, instruction: str | None) -> str | None:
    """A decoder reranker's instruction: the request's, else the model's default prompt (sentence-transformers'
    CrossEncoder prompts are its instructions), else None (the template's own default)."""
    if model.pair_template is None:
        if instruction is not None:
            message = f"the model {model.id!r} has no instruction template: it pairs texts with its tokenizer"
            raise InvalidRequest(message, "unsupported_parameter", "instruction")
        return None
    return instruction if instruction is not None else model.prompt(None) or None


def estimate_pairs(pairs: list[tuple[str, str]], truncate: bool, model: ServedModel, instruction: str | None) -> int:
    """At least the tokens the pairs will take (a token is at least a byte), known before tokenizing."""
    template = model.pair_template
    if template is None:
        sizes = (len(query.encode()) + len(document.encode()) + 4 for query, document in pairs)
    else:
        fixed = len(template.prefix.encode()) + len(template.suffix.encode()) + 4
        sizes = (len(template.format(query, document, instruction).encode()) + fixed for query, document in pairs)
    return sum(min(size, model.max_seq_length) for size in sizes) if truncate else sum(sizes)


def tei_response(scores: np.ndarray, job: RerankJob, return_text: bool) -> list[dict[str, Any]]:
    """TEI's answer: every text's index and score, best first; among equal scores the later text first, as TEI
    orders them (a stable ascending sort, reversed)."""
    return [
        {"index": index, "score": float(scores[index]), **({"text": job.pairs[index][1]} if return_text else {})}
        for index in np.argsort(scores, kind="stable")[::-1].tolist()
    ]


def cohere_response(
    scores: np.ndarray, job: RerankJob, model: ServedModel, tokens: int, top_n: int | None, return_documents: bool
) -> dict[str, Any]:
    """Cohere's, Jina's and vLLM's answer: the best `top_n` documents with their relevance, best first."""
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = [
        {
            "index": int(index),
            "relevance_score": float(scores[index]),
            **({"document": {"text": job.pairs[index][1]}} if return_documents else {}),
        }
        for index in order
    ]
    return {
        "id": f"rerank-{uuid.uuid4().hex}",
        "model": model.id,
        "results": results,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},  # vLLM's both, Jina's total
    }


def score_response(scores: np.ndarray, model: ServedModel, tokens: int) -> dict[str, Any]:
    """vLLM's /score answer: one score per pair, in order."""
    data = [{"index": index, "object": "score", "score": float(value)} for index, value in enumerate(scores)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model.id,
            "data": data, "usage": usage}  # fmt: skip


def _text(body: dict[str, Any], name: str) -> str:
    value = body.get(name)
    if value is None:
        raise InvalidRequest(f"'{name}' is required", "missing_required_parameter", name)
    if not isinstance(value, str):
        raise Unprocessable(f"'{name}' must be a string", "invalid_type", name)
    if not value:
        raise InvalidRequest(f"'{name}' is an empty string", "empty_input", name)
    return value


def _list(body: dict[str, Any], name: str) -> list[Any]:
    value = body.get(name)
    if value is None:
        raise InvalidRequest(f"'{name}' is required", "missing_required_parameter", name)
    if not isinstance(value, list):
        raise Unprocessable(f"'{name}' must be a list", "invalid_type", name)
    if not value:
        raise InvalidRequest(f"'{name}' is an empty list", "empty_input", name)
    return value


def _texts(value: Any, name: str) -> list[str]:
    texts = _list({name: value}, name)
    for index, text in enumerate(texts):
        _text({f"{name}[{index}]": text}, f"{name}[{index}]")
    return texts


def _document_text(document: Any, index: int) -> str:
    if isinstance(document, dict):
        return _text(document, "text") if "text" in document else _text({}, f"documents[{index}].text")
    return _text({f"documents[{index}]": document}, f"documents[{index}]")
