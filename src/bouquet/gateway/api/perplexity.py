"""Perplexity's contextual embeddings API: `POST /v1/contextualizedembeddings`, each document a list of chunks,
each chunk embedded in the context of its whole document (contextual.py; docs/contextual.md)."""

from __future__ import annotations

from typing import Annotated, Literal

import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.encodings import ResponseFormat
from bouquet.gateway.api.fields import (
    Count,
    Dimensions,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    Model,
    Text,
    described,
    response_format,
)
from bouquet.gateway.api.openai import Embedding, Usage
from bouquet.gateway.contextual import contextual_embeddings
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody, ResponseBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import ContextualJob
from bouquet.gateway.service import Service

ROUTE = "/v1/contextualizedembeddings"


class ContextualizedEmbeddingsRequest(RequestBody):
    """Other fields are refused by name (400 unsupported_parameter) unless the server runs with
    --allow-unknown-fields."""

    input: Annotated[
        list[Annotated[list[Text], Meta(min_length=1)]],
        Meta(min_length=1, description="documents, each a list of its chunks in order (docs/contextual.md)"),
    ]
    model: Model = None
    dimensions: Dimensions = None
    encoding_format: EncodingFormat = None
    embed_dtype: EmbedDtype = None
    endianness: Endianness = None


CONTEXTUAL = BodyDecoder(ContextualizedEmbeddingsRequest)


def routes() -> list[Route]:
    return [Route(ROUTE, endpoint(ROUTE, _contextual_embeddings, work=True), methods=["POST"])]


async def _contextual_embeddings(service: Service, request: Request) -> Response:
    job = contextual_job(await read_request(service, request, CONTEXTUAL))
    model, documents, tokens = await unless_disconnected(request, contextual_embeddings(service, job))
    return json_response(contextual_response(documents, job.model or model.id, tokens, job.response_format))


def contextual_job(body: ContextualizedEmbeddingsRequest) -> ContextualJob:
    # Perplexity's base64_int8 and base64_binary too, encoded by the replica as every route's rows are
    formats = response_format(body.encoding_format, body.embed_dtype, body.endianness)
    return ContextualJob(body.model, body.input, RowOptions(body.dimensions, None, encoding=formats.encoding), formats)


class ContextualDocument(ResponseBody):
    index: Count
    data: Annotated[list[Embedding], described("the document's chunks, in order")]
    object: Literal["list"] = "list"


class ContextualizedEmbeddingList(ResponseBody):
    data: Annotated[list[ContextualDocument], described("one per document, its chunks in order")]
    model: str
    usage: Usage
    object: Literal["list"] = "list"


def contextual_response(
    documents: list[np.ndarray], model: str, tokens: int, response_format: ResponseFormat
) -> ContextualizedEmbeddingList:
    """Perplexity's answer: per document, its chunks' embeddings in order ([chunks, elements] in the asked
    encoding)."""

    def embeddings(rows: np.ndarray) -> list[Embedding]:
        return [Embedding(i, row) for i, row in enumerate(response_format.answer(rows))]

    data = [ContextualDocument(index, embeddings(rows)) for index, rows in enumerate(documents)]
    return ContextualizedEmbeddingList(data, model, Usage(tokens, tokens))
