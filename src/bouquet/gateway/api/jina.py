"""Jina's multi-vector API for ColBERT models: `POST /v1/multi-vector`, each input's per-token vectors, laid out as
a query or as a document (`input_type`) the way the model's own library lays them out (late_interaction.py).

Chosen over vLLM's `/pooling` (`task: token_embed`), whose query/document asymmetry is still an open pull request,
and TEI's `/embed_all` (raw hidden states, no projection): Jina's route is the one where a client says whether a
text is a query, which a ColBERT model needs. Body: `input` (a string, strings, or `{"text"}` objects), `model`,
`input_type` ("query" or "document", the default), `embedding_type` (float, base64: each token row the base64 of
its little-endian float32; binary, ubinary, int8, uint8 as bouquet encodes rows), `dimensions` (each token vector
cut, then normalised), `truncate` (true: cut to the model's query or document length; false: 400 over it)."""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.encodings import FORMATS, ResponseFormat
from bouquet.gateway.api.fields import optional_field, refuse_unknown, required_text, strict
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import MultiVectorJob
from bouquet.gateway.late_interaction import token_vectors
from bouquet.gateway.service import Service

ROUTE = "/v1/multi-vector"
FIELDS = frozenset({"input", "model", "input_type", "embedding_type", "dimensions", "truncate"})
INPUT_TYPES = ("query", "document")
EMBEDDING_TYPES = ("float", "base64", "binary", "ubinary", "int8", "uint8")


def routes() -> list[Route]:
    return [Route(ROUTE, endpoint(ROUTE, _multi_vector, work=True), methods=["POST"])]


async def _multi_vector(service: Service, request: Request) -> Response:
    job = parse_multi_vector(await read_json(service, request), strict(service))
    model, vectors, tokens = await unless_disconnected(request, token_vectors(service, job))
    return json_response(multi_vector_response(vectors, job.model or model.id, tokens, job.response_format))


def parse_multi_vector(body: dict[str, Any], strict: bool = True) -> MultiVectorJob:
    if strict:
        refuse_unknown(body, FIELDS)
    input_type = optional_field(body, "input_type", str) or "document"
    if input_type not in INPUT_TYPES:
        raise InvalidRequest(f"'input_type' must be one of {INPUT_TYPES}, got {input_type!r}", "invalid_value",
                             "input_type")  # fmt: skip
    embedding_type = optional_field(body, "embedding_type", str) or "float"
    if embedding_type not in EMBEDDING_TYPES:
        message = f"'embedding_type' must be one of {EMBEDDING_TYPES}, got {embedding_type!r}"
        raise InvalidRequest(message, "invalid_value", "embedding_type")
    dimensions = optional_field(body, "dimensions", int)
    truncate = optional_field(body, "truncate", bool)
    return MultiVectorJob(
        model=optional_field(body, "model", str),
        texts=_texts(body.get("input")),
        input_type=input_type,
        dimensions=dimensions,
        truncate=truncate is not False,
        response_format=FORMATS[embedding_type],
    )


def _texts(value: Any) -> list[str]:
    """A string, a list of strings, or a list of `{"text": ...}` objects (Jina's documents)."""
    if value is None:
        raise InvalidRequest("'input' is required", "missing_required_parameter", "input")
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list):
        raise Unprocessable("'input' must be a string or a list of strings", "invalid_type", "input")
    if not items:
        raise InvalidRequest("'input' must not be empty", "empty_input", "input")
    texts = []
    for index, item in enumerate(items):
        if isinstance(item, dict):
            refuse_unknown(item, {"text"})  # Jina's image inputs: no image model is served
            texts.append(required_text(item, "text") if "text" in item else required_text({}, f"input[{index}].text"))
        else:
            texts.append(required_text({f"input[{index}]": item}, f"input[{index}]"))
    return texts


def multi_vector_response(
    vectors: list[np.ndarray], model: str, tokens: int, response_format: ResponseFormat
) -> dict[str, Any]:
    """Jina's answer: per input, its token vectors in order (one row a token), encoded as asked (by the replica)."""
    data = [
        {"object": "embeddings", "index": index, "embeddings": response_format.answer(rows)}
        for index, rows in enumerate(vectors)
    ]
    return {"object": "list", "model": model, "data": data, "usage": {"total_tokens": tokens, "prompt_tokens": tokens}}
