"""Jina's multi-vector API for ColBERT models: `POST /v1/multi-vector`, each input's per-token vectors, laid out as
a query or as a document (`input_type`) the way the model's own library lays them out (late_interaction.py).

Chosen over vLLM's `/pooling` (`task: token_embed`), whose query/document asymmetry is still an open pull request,
and TEI's `/embed_all` (raw hidden states, no projection): Jina's route is the one where a client says whether a
text is a query, which a ColBERT model needs. Body: `input` (a string, strings, or `{"text"}` objects), `model`,
`input_type` ("query" or "document", the default), `embedding_type` (float, base64: each token row the base64 of
its little-endian float32; binary, ubinary, int8, uint8 as bouquet encodes rows), vLLM's `embed_dtype` with
base64 (float16, bfloat16, fp8_e4m3, fp8_e5m2: each token row the base64 of its bytes in that type, a half or a
quarter of float32's), `dimensions` (each token vector cut, then normalised), `truncate` (true: cut to the model's
query or document length; false: 400 over it)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.encodings import EMBED_DTYPES, FORMATS, ResponseFormat
from bouquet.gateway.api.fields import Count, EmbedDtype, Model, Text, choice, described
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody, ResponseBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import MultiVectorJob
from bouquet.gateway.late_interaction import token_vectors
from bouquet.gateway.service import Service

ROUTE = "/v1/multi-vector"
INPUT_TYPES = ("query", "document")
EMBEDDING_TYPES = ("float", "base64", "binary", "ubinary", "int8", "uint8")


class TextItem(msgspec.Struct, forbid_unknown_fields=True):
    """A document as Jina's object; any other field (Jina's image inputs) is refused: no image model is served."""

    text: Text


class MultiVectorRequest(RequestBody):
    """Per-token (ColBERT) vectors; a field the route does not take is refused (400)."""

    input: Text | Annotated[list[Text | TextItem], Meta(min_length=1)]
    model: Model = None
    input_type: Annotated[str, described("default document", enum=list(INPUT_TYPES))] | None = None
    embedding_type: Annotated[str, Meta(extra_json_schema={"enum": list(EMBEDDING_TYPES)})] | None = None
    embed_dtype: EmbedDtype = None
    dimensions: Annotated[int, described("each token vector cut to this width, then normalised")] | None = None
    truncate: Annotated[bool, described("false: an input over the model's length is a 400")] | None = None


MULTI_VECTOR = BodyDecoder(MultiVectorRequest)


def routes() -> list[Route]:
    return [Route(ROUTE, endpoint(ROUTE, _multi_vector, work=True), methods=["POST"])]


async def _multi_vector(service: Service, request: Request) -> Response:
    job = multi_vector_job(await read_request(service, request, MULTI_VECTOR))
    model, vectors, tokens = await unless_disconnected(request, token_vectors(service, job))
    return json_response(multi_vector_response(vectors, job.model or model.id, tokens, job.response_format))


def multi_vector_job(body: MultiVectorRequest) -> MultiVectorJob:
    items = [body.input] if isinstance(body.input, str) else body.input
    formats = _response_format(
        choice(body.embedding_type, "embedding_type", EMBEDDING_TYPES, "float"), body.embed_dtype
    )
    return MultiVectorJob(
        model=body.model,
        texts=[item if isinstance(item, str) else item.text for item in items],
        input_type=choice(body.input_type, "input_type", INPUT_TYPES, "document"),
        options=RowOptions(body.dimensions, encoding=formats.encoding, token_vectors=True),
        truncate=body.truncate is not False,
        response_format=formats,
    )


def _response_format(embedding_type: str, embed_dtype: str | None) -> ResponseFormat:
    """The embedding type's rows; base64's in vLLM's `embed_dtype` (float16 rows: half the bytes of float32's)."""
    dtype = choice(embed_dtype, "embed_dtype", EMBED_DTYPES, "float32")
    if dtype == "float32":
        return FORMATS[embedding_type]
    if embedding_type != "base64":
        message = f"embed_dtype applies to embedding_type 'base64' only, not {embedding_type!r}"
        raise InvalidRequest(message, "unsupported_parameter", "embed_dtype")
    return ResponseFormat(EMBED_DTYPES[dtype], base64=True)


TokenRows = Annotated[Any, Meta(extra_json_schema={
    "type": "array", "description": "a token's vector a row: numbers, or base64 of its bytes",
    "items": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
})]  # fmt: skip


class TokenVectors(ResponseBody):
    index: Count
    embeddings: TokenRows
    object: Literal["embeddings"] = "embeddings"


class MultiVectorUsage(ResponseBody):
    total_tokens: Count
    prompt_tokens: Count


class MultiVectorList(ResponseBody):
    model: str
    data: list[TokenVectors]
    usage: MultiVectorUsage
    object: Literal["list"] = "list"


def multi_vector_response(
    vectors: list[np.ndarray], model: str, tokens: int, response_format: ResponseFormat
) -> MultiVectorList:
    """Jina's answer: per input, its token vectors in order (one row a token), encoded as asked (by the replica)."""
    data = [TokenVectors(index, response_format.answer(rows)) for index, rows in enumerate(vectors)]
    return MultiVectorList(model, data, MultiVectorUsage(tokens, tokens))
