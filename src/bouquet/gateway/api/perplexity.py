"""Perplexity's contextual embeddings API: `POST /v1/contextualizedembeddings`, each document a list of chunks,
each chunk embedded in the context of its whole document (contextual.py; docs/contextual.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.encodings import ResponseFormat, encode_rows
from bouquet.gateway.api.fields import optional_field, parse_response_format, refuse_unknown, strict
from bouquet.gateway.contextual import contextual_embeddings
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import ContextualJob
from bouquet.gateway.service import Service

CONTEXTUAL_FIELDS = frozenset({"input", "model", "dimensions", "encoding_format", "embed_dtype", "endianness"})
ROUTE = "/v1/contextualizedembeddings"


def routes() -> list[Route]:
    return [Route(ROUTE, endpoint(ROUTE, _contextual_embeddings, work=True), methods=["POST"])]


async def _contextual_embeddings(service: Service, request: Request) -> Response:
    job = parse_contextual(await read_json(service, request), strict(service))
    model, documents, tokens = await unless_disconnected(request, contextual_embeddings(service, job))
    return json_response(contextual_response(documents, job.model or model.id, tokens, job.response_format))


def parse_contextual(body: dict[str, Any], strict: bool = True) -> ContextualJob:
    if strict:
        refuse_unknown(body, CONTEXTUAL_FIELDS)
    if "input" not in body:
        raise InvalidRequest("'input' is required", "missing_required_parameter", "input")
    documents = body["input"]
    if not isinstance(documents, list) or not all(isinstance(document, list) for document in documents):
        message = "'input' must be a list of documents, each a list of chunks (strings)"
        raise Unprocessable(message, "invalid_type", "input")
    if not documents:
        raise InvalidRequest("'input' must not be empty", "empty_input", "input")
    for index, chunks in enumerate(documents):
        if not chunks:
            raise InvalidRequest(f"'input[{index}]' has no chunks", "empty_input", "input")
        for number, chunk in enumerate(chunks):
            if not isinstance(chunk, str):
                raise Unprocessable(f"'input[{index}][{number}]' must be a string", "invalid_type", "input")
            if not chunk:
                raise InvalidRequest(f"'input[{index}][{number}]' is an empty string", "empty_input", "input")
    return ContextualJob(
        optional_field(body, "model", str),
        documents,
        optional_field(body, "dimensions", int),
        parse_response_format(body),  # Perplexity's base64_int8 and base64_binary too; encoded here, on the host
    )


def contextual_response(
    documents: list[np.ndarray], model: str, tokens: int, response_format: ResponseFormat
) -> dict[str, Any]:
    """Perplexity's answer: per document, its chunks' embeddings in order, in the asked encoding."""

    def encoded(rows: np.ndarray) -> Any:
        return response_format.answer(encode_rows(rows, response_format.encoding))

    data = [
        {"object": "list", "index": index,
         "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(encoded(rows))]}
        for index, rows in enumerate(documents)
    ]  # fmt: skip
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
