"""OpenAI's embeddings API, as its clients (openai, langchain-openai, llama-index, litellm) and vLLM's and
Infinity's call it: `POST /v1/embeddings` (and Infinity's `/embeddings`) with vLLM's extensions, and the model
list `GET /v1/models` (Infinity's `/models`), `GET /v1/models/{model}`."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.encodings import ResponseFormat
from bouquet.gateway.api.fields import (
    long_input,
    optional_field,
    parse_dimensions,
    parse_inputs,
    parse_response_format,
    refuse_unknown,
    refuse_unless,
    text_positions,
)
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service

# What the route reads; anything else is refused by name (400 unsupported_parameter) unless the server runs with
# --allow-unknown-fields, so a client never gets other vectors than it asked for without being told.
OPENAI_FIELDS = frozenset(
    {"input", "model", "encoding_format", "dimensions", "user",
     # vLLM's extensions: honoured as vLLM does, or refused below when a value asks for what is not done here
     "normalize", "truncate_prompt_tokens", "add_special_tokens", "embed_dtype", "endianness", "use_activation",
     "priority", "request_id",
     "modality",  # Infinity's (text only)
     "long_input"}  # bouquet's: "chunk" embeds an over-long input whole
)  # fmt: skip


def routes() -> list[Route]:
    return [
        Route("/v1/embeddings", endpoint("/v1/embeddings", _embeddings, work=True), methods=["POST"]),
        Route("/embeddings", endpoint("/embeddings", _embeddings, work=True), methods=["POST"]),  # Infinity's
        Route("/v1/models", endpoint("/v1/models", _models), methods=["GET"]),
        Route("/models", endpoint("/models", _models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("/v1/models/{model}", _model), methods=["GET"]),
    ]


async def _embeddings(service: Service, request: Request) -> Response:
    job = parse_openai(await read_json(service, request), strict=not service.config.allow_unknown_fields)
    model, rows, tokens = await unless_disconnected(request, service.embed(job))
    return json_response(with_response_id(openai_response(rows, job.model or model.id, tokens, job.response_format)))


def parse_openai(body: dict[str, Any], strict: bool = True) -> EmbedJob:
    if strict:
        refuse_unknown(body, OPENAI_FIELDS)
    optional_field(body, "user", str)
    response_format = parse_response_format(body)
    if "input" not in body:
        raise InvalidRequest("'input' is required", "missing_required_parameter", "input")
    refuse_unless(body, "add_special_tokens", True, "special tokens are always added, as the model was trained")
    refuse_unless(body, "modality", "text", "only text is embedded here")
    optional_field(body, "priority", int)  # vLLM's scheduling hint: requests here are served first come
    optional_field(body, "request_id", str)
    texts, token_ids = parse_inputs(body["input"], "input")
    positions = text_positions(body["input"], texts, token_ids)
    return EmbedJob(
        model=optional_field(body, "model", str),
        texts=texts,
        token_ids=token_ids,
        dimensions=parse_dimensions(body),
        normalize=_normalize(body),
        response_format=response_format,
        truncate_tokens=_truncate_prompt_tokens(body),
        text_positions=positions,
        long_input=long_input(body),
    )


def _normalize(body: dict[str, Any]) -> bool | None:
    """vLLM's `normalize`, or `use_activation`, its newer name for the same switch on an embedding model."""
    normalize, use_activation = optional_field(body, "normalize", bool), optional_field(body, "use_activation", bool)
    if normalize is not None and use_activation is not None and normalize != use_activation:
        raise InvalidRequest(
            "'normalize' and 'use_activation' are the same switch here; they disagree",
            "invalid_value",
            "use_activation",
        )
    return normalize if normalize is not None else use_activation


def _truncate_prompt_tokens(body: dict[str, Any]) -> int | None:
    """vLLM's: each input cut to k tokens as its tokenizer truncates (vLLM 0.32: the first k, special tokens kept,
    for these models' tokenizers, whose truncation side is the right); -1: the model's limit."""
    value = optional_field(body, "truncate_prompt_tokens", int)
    if value is None or value == -1:
        return None
    if value < 1:
        raise InvalidRequest(
            f"'truncate_prompt_tokens' must be -1 or at least 1, got {value}", "invalid_value", "truncate_prompt_tokens"
        )
    return value


def openai_response(
    rows: np.ndarray, model: str, prompt_tokens: int, response_format: ResponseFormat
) -> dict[str, Any]:
    """rows: [N, elements] in the format's encoding, each answered as a list of numbers (orjson writes numpy rows
    itself) or as base64 of its bytes: little-endian float32 for plain base64, as OpenAI's clients decode."""
    embeddings = response_format.answer(rows)
    return {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(embeddings)],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def with_response_id(response: dict[str, Any], prefix: str = "embd") -> dict[str, Any]:
    """vLLM's and Infinity's fields beside OpenAI's: the response's `id` and `created`, and `completion_tokens`."""
    response["usage"].setdefault("completion_tokens", 0)
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "created": int(time.time()), **response}


def model_card(service: Service, model: ServedModel, name: str | None = None) -> dict[str, Any]:
    """OpenAI's model object under `name` (default: the model's id), plus what a client needs to use it: family,
    pooling, limit, width; `root` is the model's own name (vLLM's, for a served name)."""
    return {
        "id": name or model.id, "object": "model", "created": 0, "owned_by": "bouquet", "root": model.name,
        "family": model.family,
        "task": model.task, "sparse": bool(model.sparse_dimension),
        "architecture": model.architecture, "pooling": model.pooling, "normalize": model.normalize,
        "dimension": model.dimension, "max_input_length": model.max_seq_length, "dtype": model.dtype,
        "replicas": sum(r.healthy and r.model is model for r in service.pool.replicas),
        "stats": _model_stats(service, model),
    }  # fmt: skip


def _model_stats(service: Service, model: ServedModel) -> dict[str, Any]:
    """Infinity's `stats` object on each model of /models: what the gateway knows of its capacity."""
    replicas = [r for r in service.pool.replicas if r.healthy and r.model is model]
    return {"healthy_replicas": len(replicas), "max_batch_tokens": model.max_batch_tokens}


async def _models(service: Service, request: Request) -> Response:
    cards = [model_card(service, model, name) for model in service.catalog.ordered for name in model.listed_names]
    return json_response({"object": "list", "data": cards})


async def _model(service: Service, request: Request) -> Response:
    name = request.path_params["model"]
    model = service.catalog.get(name)
    return json_response(model_card(service, model, name if name in model.listed_names else None))
