"""bge-m3's three outputs in FlagEmbedding's shape: `POST /encode`, what `BGEM3FlagModel.encode(sentences,
return_dense=..., return_sparse=..., return_colbert_vecs=...)` returns, from one forward on a replica
(gateway/encode.py); and `weights_for_different_modes`, the field /score and /rerank take for bge-m3's weighted score
(FlagEmbedding's `compute_score`).

Body: `sentences` (FlagEmbedding's name; `input` is taken too) as a string or strings, `model`, `return_dense`
(default true), `return_sparse` and `return_colbert_vecs` (default false), as FlagEmbedding's defaults are;
`max_length` (tokens a text keeps; default the model's limit, not FlagEmbedding's 512); `encoding_format` (`float`,
or `base64`: each dense row and each token vector the base64 of its little-endian float32). The answer has
FlagEmbedding's keys: `dense_vecs` (normalised), `lexical_weights` (per text, `{token id as a string: weight}`) and
`colbert_vecs` (per text, one normalised row a token but the first), null when not asked; and `usage`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.all_outputs import AllOutputs
from bouquet.encodings import FORMATS, ResponseFormat
from bouquet.gateway.api.fields import Model, Text, Texts, choice, described
from bouquet.gateway.api.openai import Usage
from bouquet.gateway.encode import encode
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody, ResponseBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import EncodeJob
from bouquet.gateway.service import Service

ROUTE = "/encode"
ENCODING_FORMATS = ("float", "base64")
Flag = Annotated[bool, described("FlagEmbedding's; default false")] | None


class EncodeRequest(RequestBody):
    """Exactly one of `sentences` and `input`."""

    __openapi__: ClassVar[dict[str, Any]] = {"oneOf": [{"required": ["sentences"]}, {"required": ["input"]}]}

    sentences: Text | Texts | None = None
    input: Annotated[Text | Texts, described("`sentences` by its OpenAI name")] | None = None
    model: Model = None
    return_dense: Annotated[bool, described("the dense embeddings; default true")] | None = None
    return_sparse: Flag = None
    return_colbert_vecs: Flag = None
    max_length: Annotated[int, described("tokens a text keeps; default the model's limit", minimum=2)] | None = None
    encoding_format: Annotated[str, described("default float", enum=list(ENCODING_FORMATS))] | None = None


ENCODE = BodyDecoder(EncodeRequest)


def routes() -> list[Route]:
    return [Route(ROUTE, endpoint(ROUTE, _encode, work=True), methods=["POST"])]


async def _encode(service: Service, request: Request) -> Response:
    job = encode_job(await read_request(service, request, ENCODE))
    model, outputs, tokens = await unless_disconnected(request, encode(service, job))
    return json_response(encode_response(outputs, job, job.model or model.id, tokens))


def encode_job(body: EncodeRequest) -> EncodeJob:
    if (body.sentences is None) == (body.input is None):
        raise InvalidRequest("give the texts as 'sentences' or as 'input', once", "invalid_value", "sentences")
    texts = body.sentences if body.sentences is not None else body.input
    assert texts is not None
    return EncodeJob(
        model=body.model,
        texts=[texts] if isinstance(texts, str) else texts,
        dense=body.return_dense is not False,
        sparse=bool(body.return_sparse),
        colbert=bool(body.return_colbert_vecs),
        max_length=body.max_length,
        response_format=FORMATS[choice(body.encoding_format, "encoding_format", ENCODING_FORMATS, "float")],
    )


Rows = Annotated[Any, Meta(extra_json_schema={
    "type": "array", "description": "a vector a row: numbers, or base64 of its little-endian float32",
    "items": {"anyOf": [{"type": "array", "items": {"type": "number"}}, {"type": "string"}]},
})]  # fmt: skip


class Encoded(ResponseBody):
    """FlagEmbedding's `encode` answer; an output not asked for is null."""

    model: str
    dense_vecs: Rows | None
    lexical_weights: Annotated[list[dict[str, float]], described("per text, {token id: weight}")] | None
    colbert_vecs: Annotated[list[Rows], described("per text, a vector a token but the first")] | None
    usage: Usage


def encode_response(outputs: AllOutputs, job: EncodeJob, model: str, tokens: int) -> Encoded:
    answer: ResponseFormat = job.response_format
    lexical = None
    if job.sparse:
        rows = (outputs.sparse.row(index) for index in range(outputs.num_rows))
        lexical = [dict(zip(map(str, ids.tolist()), values.tolist(), strict=True)) for ids, values in rows]
    colbert = [answer.answer(outputs.token_vectors(i)) for i in range(outputs.num_rows)] if job.colbert else None
    dense = answer.answer(outputs.dense) if job.dense else None
    return Encoded(model, dense, lexical, colbert, Usage(tokens, tokens))
