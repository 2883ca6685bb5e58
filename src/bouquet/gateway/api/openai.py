"""OpenAI's embeddings API, as its clients (openai, langchain-openai, llama-index, litellm) and vLLM's and
Infinity's call it: `POST /v1/embeddings` (and Infinity's `/embeddings`) with vLLM's extensions, and the model
list `GET /v1/models` (Infinity's `/models`), `GET /v1/models/{model}`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any

import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.encodings import ResponseFormat
from bouquet.gateway.api.fields import (
    Dimensions,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    Input,
    LongInput,
    Model,
    described,
    long_input,
    parse_inputs,
    refuse_unless,
    response_format,
    text_positions,
)
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service


class EmbeddingsRequest(RequestBody):
    """Other fields are refused by name (400 unsupported_parameter) unless the server runs with
    --allow-unknown-fields, so a client never gets other vectors than it asked for without being told."""

    input: Input
    model: Model = None
    encoding_format: EncodingFormat = None
    dimensions: Dimensions = None
    user: str | None = None
    # vLLM's extensions: honoured as vLLM does, or refused when a value asks for what is not done here
    normalize: Annotated[bool, described("vLLM's; default: as the model's Normalize module says")] | None = None
    truncate_prompt_tokens: Annotated[int, Meta(
        ge=-1, description="vLLM's: the first k tokens, specials kept; -1: the model's limit; over the limit: 400",
        extra_json_schema={"not": {"enum": [0]}},
    )] | None = None  # fmt: skip
    # Any: a value other than true, of any type, is refused by name (1 == True, yet not a boolean)
    add_special_tokens: Annotated[
        Any, described("vLLM's; only true is done here", type="boolean", enum=[True, None], nullable=True)
    ] = None
    embed_dtype: EmbedDtype = None
    endianness: Endianness = None
    use_activation: Annotated[
        bool, described("vLLM's newer name for normalize; given both, they must agree (else 400)")
    ] | None = None  # fmt: skip
    priority: Annotated[int, described("vLLM's hint; requests are served first come here")] | None = None
    request_id: str | None = None
    modality: Annotated[Any, described("Infinity's", type="string", enum=["text", None], nullable=True)] = None
    long_input: LongInput = None  # bouquet's: "chunk" embeds an over-long input whole


EMBEDDINGS = BodyDecoder(EmbeddingsRequest)


def routes() -> list[Route]:
    return [
        Route("/v1/embeddings", endpoint("/v1/embeddings", _embeddings, work=True), methods=["POST"]),
        Route("/embeddings", endpoint("/embeddings", _embeddings, work=True), methods=["POST"]),  # Infinity's
        Route("/v1/models", endpoint("/v1/models", _models), methods=["GET"]),
        Route("/models", endpoint("/models", _models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("/v1/models/{model}", _model), methods=["GET"]),
    ]


async def _embeddings(service: Service, request: Request) -> Response:
    job = embed_job(await read_request(service, request, EMBEDDINGS))
    model, rows, tokens = await unless_disconnected(request, service.embed(job))
    return json_response(with_response_id(openai_response(rows, job.model or model.id, tokens, job.response_format)))


def embed_job(body: EmbeddingsRequest) -> EmbedJob:
    """What the types leave to check: the values of names, the inputs of one kind, the two switches agreeing."""
    formats = response_format(body.encoding_format, body.embed_dtype, body.endianness)
    refuse_unless(
        body.add_special_tokens, "add_special_tokens", True, "special tokens are always added, as the model was trained"
    )
    refuse_unless(body.modality, "modality", "text", "only text is embedded here")
    texts, token_ids = parse_inputs(body.input, "input")
    return EmbedJob(
        model=body.model,
        texts=texts,
        token_ids=token_ids,
        dimensions=body.dimensions,
        normalize=_normalize(body.normalize, body.use_activation),
        response_format=formats,
        truncate_tokens=_truncate_prompt_tokens(body.truncate_prompt_tokens),
        text_positions=text_positions(body.input, texts, token_ids),
        long_input=long_input(body.long_input),
    )


def parse_openai(body: bytes, strict: bool = True) -> EmbedJob:
    """A `/v1/embeddings` body's job, from its bytes."""
    return embed_job(EMBEDDINGS.decode(body, strict))


def _normalize(normalize: bool | None, use_activation: bool | None) -> bool | None:
    """vLLM's `normalize`, or `use_activation`, its newer name for the same switch on an embedding model."""
    if normalize is not None and use_activation is not None and normalize != use_activation:
        raise InvalidRequest(
            "'normalize' and 'use_activation' are the same switch here; they disagree",
            "invalid_value",
            "use_activation",
        )
    return normalize if normalize is not None else use_activation


def _truncate_prompt_tokens(value: int | None) -> int | None:
    """vLLM's: each input cut to k tokens as its tokenizer truncates (vLLM 0.32: the first k, special tokens kept,
    for these models' tokenizers, whose truncation side is the right); -1: the model's limit."""
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
