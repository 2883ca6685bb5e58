"""Cohere's API, as its SDK calls it: v1's `POST /v1/rerank` (also Jina's and vLLM's shape, and TEI's /rerank with
`documents`), and v2's `POST /v2/embed` and `POST /v2/rerank` (`ClientV2`).

`/v2/embed` takes `texts` (or `inputs` of text content), `input_type` (search_query, search_document,
classification, clustering: the model's sentence-transformers prompt of that role where it has one, else none),
`embedding_types` (any of float, int8, uint8, binary, ubinary, base64: each computed from the same float rows,
in bouquet's encodings), `output_dimension`, `max_tokens` (keep the first N tokens) and `truncate` (END, the
default; START; NONE: an input over the limit is an error). Images are refused: no image model is served yet.
`/v2/rerank` takes `query`, `documents` (strings) and `top_n`, and answers the results without documents, as v2 does.
Errors have Cohere's body, `{"message": ...}` (http/error_responses.py), with the status of the error."""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.encodings import Encoding, encode_rows
from bouquet.gateway import scoring
from bouquet.gateway.api.fields import (
    document_text,
    optional_field,
    refuse_unknown,
    required_list,
    required_text,
    strict,
)
from bouquet.gateway.api.vllm import ACTIVATION_FIELDS, raw_scores
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.http.error_responses import cohere_error_response
from bouquet.gateway.jobs import EmbedJob, RerankJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service

V1_RERANK_FIELDS = frozenset(
    {"query", "documents", "model", "top_n", "return_documents", "instruction", *ACTIVATION_FIELDS}
)
EMBED_FIELDS = frozenset({
    "model", "texts", "inputs", "images", "input_type", "embedding_types", "output_dimension", "max_tokens",
    "truncate", "priority",
})  # fmt: skip
RERANK_FIELDS = frozenset({"model", "query", "documents", "top_n", "max_tokens_per_doc", "priority"})
# Each embedding type: the encoding its rows take, and whether each row is a base64 string of its bytes.
EMBEDDING_TYPES: dict[str, tuple[Encoding, bool]] = {
    "float": (Encoding.FLOAT32, False),
    "int8": (Encoding.INT8, False),
    "uint8": (Encoding.UINT8, False),
    "binary": (Encoding.BINARY, False),
    "ubinary": (Encoding.UBINARY, False),
    "base64": (Encoding.FLOAT32, True),
}
# input_type -> the sentence-transformers prompt names that play its role, the first a model has is used.
INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("query", "search_query"),
    "search_document": ("document", "passage", "search_document", "doc"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}
TRUNCATE = ("NONE", "START", "END")


def routes() -> list[Route]:
    def v2(path: str, handler: Any) -> Route:
        return Route(path, endpoint(path, handler, work=True, errors=cohere_error_response), methods=["POST"])

    return [
        Route("/v1/rerank", endpoint("/v1/rerank", _v1_rerank, work=True), methods=["POST"]),
        v2("/v2/embed", _v2_embed),
        v2("/v2/rerank", _v2_rerank),
    ]


async def _v1_rerank(service: Service, request: Request) -> Response:
    return await rerank_body(service, request, await read_json(service, request))


async def rerank_body(service: Service, request: Request, body: dict[str, Any]) -> Response:
    """v1's rerank (and Jina's and vLLM's) of a body already read."""
    job, top_n, return_documents = parse_cohere_rerank(body, strict(service))
    model, scores, tokens = await unless_disconnected(request, scoring.score(service, job))
    return json_response(v1_rerank_response(scores, job, model, tokens, top_n, return_documents))


async def _v2_embed(service: Service, request: Request) -> Response:
    parsed = parse_embed(await read_json(service, request), strict(service))
    model = service.catalog.get(parsed.job.model)
    job = replace(parsed.job, prompt_name=prompt_name(model.prompts, parsed.input_type))
    _, rows, tokens = await unless_disconnected(request, service.embed(job))
    return json_response(embed_response(rows, parsed, tokens))


async def _v2_rerank(service: Service, request: Request) -> Response:
    job, top_n = parse_rerank(await read_json(service, request), strict(service))
    _, scores, tokens = await unless_disconnected(request, scoring.score(service, job))
    return json_response(rerank_response(scores, top_n, tokens))


def parse_cohere_rerank(body: dict[str, Any], strict: bool = True) -> tuple[RerankJob, int | None, bool]:
    """Cohere's, Jina's and vLLM's body (documents as strings or {"text": ...}), its top_n and return_documents."""
    if strict:
        refuse_unknown(body, V1_RERANK_FIELDS)
    query = required_text(body, "query")
    documents = [document_text(document, index) for index, document in enumerate(required_list(body, "documents"))]
    top_n = optional_field(body, "top_n", int)
    if top_n is not None and top_n < 1:
        raise InvalidRequest(f"'top_n' must be at least 1, got {top_n}", "invalid_value", "top_n")
    return_documents = optional_field(body, "return_documents", bool)
    job = RerankJob(
        model=optional_field(body, "model", str),
        pairs=[(query, text) for text in documents],
        raw_scores=raw_scores(body),
        instruction=optional_field(body, "instruction", str),
    )
    return job, top_n, True if return_documents is None else return_documents


def v1_rerank_response(
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


@dataclass(frozen=True)
class CohereEmbed:
    job: EmbedJob  # float32 rows; each embedding type is encoded from them
    input_type: str | None
    embedding_types: tuple[str, ...]


def parse_embed(body: dict[str, Any], strict: bool = True) -> CohereEmbed:
    if strict:
        refuse_unknown(body, EMBED_FIELDS)
    _refuse_priority(body)
    if body.get("images"):
        raise InvalidRequest("images are not supported: no image model is served", "unsupported_parameter", "images")
    texts = _texts(body)
    input_type = optional_field(body, "input_type", str)
    if input_type is not None and input_type not in INPUT_TYPE_PROMPTS:
        known = ", ".join(INPUT_TYPE_PROMPTS)
        raise InvalidRequest(f"'input_type' must be one of {known}, got {input_type!r}", "invalid_value", "input_type")
    truncate = (optional_field(body, "truncate", str) or "END").upper()
    if truncate not in TRUNCATE:
        raise InvalidRequest(f"'truncate' must be one of {TRUNCATE}, got {truncate!r}", "invalid_value", "truncate")
    max_tokens = _positive(body, "max_tokens")
    job = EmbedJob(
        model=optional_field(body, "model", str),
        texts=texts,
        token_ids=None,
        dimensions=_positive(body, "output_dimension"),
        truncate=truncate != "NONE",
        truncation_direction="left" if truncate == "START" else "right",
        truncate_tokens=max_tokens,
        long_input="truncate" if truncate == "NONE" else None,  # over the limit stays an error, never chunked
    )
    return CohereEmbed(job, input_type, _embedding_types(body))


def prompt_name(prompts: dict[str, str], input_type: str | None) -> str | None:
    """The model's prompt for `input_type`'s role, or None (then the model's default prompt applies)."""
    names = INPUT_TYPE_PROMPTS.get(input_type or "", ())
    return next((name for name in names if name in prompts), None)


def embed_response(rows: np.ndarray, request: CohereEmbed, tokens: int) -> dict[str, Any]:
    """Cohere's EmbedByTypeResponse: every type asked for, each computed from the float rows."""
    embeddings: dict[str, Any] = {}
    for name in request.embedding_types:
        encoding, as_base64 = EMBEDDING_TYPES[name]
        encoded = encode_rows(rows, encoding)
        embeddings[name] = (
            [base64.b64encode(row.tobytes()).decode("ascii") for row in encoded] if as_base64 else encoded
        )
    return {
        "id": str(uuid.uuid4()),
        "embeddings": embeddings,
        "texts": request.job.texts,
        "meta": _meta(tokens),
        "response_type": "embeddings_by_type",
    }


def parse_rerank(body: dict[str, Any], strict: bool = True) -> tuple[RerankJob, int | None]:
    if strict:
        refuse_unknown(body, RERANK_FIELDS)
    _refuse_priority(body)
    if body.get("max_tokens_per_doc") is not None:
        message = "'max_tokens_per_doc' is not supported: each pair is cut to the model's limit"
        raise InvalidRequest(message, "unsupported_parameter", "max_tokens_per_doc")
    fields = {name: value for name, value in body.items() if name in {"model", "query", "documents", "top_n"}}
    job, top_n, _ = parse_cohere_rerank(fields)
    return job, top_n


def rerank_response(scores: np.ndarray, top_n: int | None, tokens: int) -> dict[str, Any]:
    """Cohere's V2RerankResponse: the best `top_n` documents' indices and relevance, best first."""
    order = np.argsort(-scores, kind="stable")[:top_n]
    results = [{"index": int(index), "relevance_score": float(scores[index])} for index in order]
    return {"id": str(uuid.uuid4()), "results": results, "meta": _meta(tokens, "search_units")}


def _refuse_priority(body: dict[str, Any]) -> None:
    """Cohere's scheduling hint: the scheduler here is first come, first served, so a priority is refused by name
    rather than silently ignored."""
    if body.get("priority") is not None:
        message = "'priority' is not supported: requests are served first come, first served"
        raise InvalidRequest(message, "unsupported_parameter", "priority")


def _meta(tokens: int, unit: str = "input_tokens") -> dict[str, Any]:
    billed = {"input_tokens": tokens} if unit == "input_tokens" else {"search_units": 1}
    return {"api_version": {"version": "2"}, "billed_units": billed}


def _texts(body: dict[str, Any]) -> list[str]:
    """`texts`, or `inputs`' text content (each input a `content` list of `{"type": "text", "text": ...}`): exactly
    one of them, as the SDK sends (it leaves out what is not given, so a null is a client's mistake here)."""
    if "texts" in body and "inputs" in body:
        raise InvalidRequest("give 'texts' or 'inputs', not both", "invalid_value", "inputs")
    if "inputs" not in body:
        if "texts" not in body:
            raise InvalidRequest("'texts' (or 'inputs') is required", "missing_required_parameter", "texts")
        return _strings(body["texts"], "texts")
    inputs = body["inputs"]
    if not isinstance(inputs, list) or not inputs:
        raise Unprocessable("'inputs' must be a non-empty list of {content: [...]}", "invalid_type", "inputs")
    return [_input_text(item, index) for index, item in enumerate(inputs)]


def _strings(value: Any, name: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(text, str) for text in value):
        raise Unprocessable(f"'{name}' must be a list of strings", "invalid_type", name)
    if not value or not all(value):
        raise InvalidRequest(f"'{name}' must not be empty, nor hold an empty string", "empty_input", name)
    return value


def _input_text(item: Any, index: int) -> str:
    content = item.get("content") if isinstance(item, dict) else None
    if not isinstance(content, list) or not content:
        raise Unprocessable(f"'inputs[{index}].content' must be a non-empty list", "invalid_type", "inputs")
    parts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            message = f"'inputs[{index}]': only text content ({{'type': 'text', 'text': ...}}) is supported"
            raise InvalidRequest(message, "unsupported_parameter", "inputs")
        parts.append(part["text"])
    text = " ".join(parts)
    if not text:
        raise InvalidRequest(f"'inputs[{index}]' holds no text", "empty_input", "inputs")
    return text


def _embedding_types(body: dict[str, Any]) -> tuple[str, ...]:
    value = body.get("embedding_types")
    if value is None:
        return ("float",)
    if not isinstance(value, list) or not value or not all(isinstance(name, str) for name in value):
        raise Unprocessable("'embedding_types' must be a non-empty list of strings", "invalid_type", "embedding_types")
    unknown = [name for name in value if name not in EMBEDDING_TYPES]
    if unknown:
        known = ", ".join(EMBEDDING_TYPES)
        raise InvalidRequest(f"unknown embedding_types {unknown}; known: {known}", "invalid_value", "embedding_types")
    return tuple(dict.fromkeys(value))


def _positive(body: dict[str, Any], name: str) -> int | None:
    value = optional_field(body, name, int)
    if value is not None and value < 1:
        raise InvalidRequest(f"'{name}' must be at least 1, got {value}", "invalid_value", name)
    return value
