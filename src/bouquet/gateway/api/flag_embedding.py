"""bge-m3's three outputs in FlagEmbedding's shape: `POST /encode`, what `BGEM3FlagModel.encode(sentences,
return_dense=..., return_sparse=..., return_colbert_vecs=...)` returns, from one forward on a replica
(gateway/encode.py); `POST /compute_score`, what `BGEM3FlagModel.compute_score(sentence_pairs, ...)` returns (its
five scores); and `weights_for_different_modes`, the field /compute_score, /score and /rerank take for bge-m3's
weighted score (/score and /rerank answer 'colbert+sparse+dense' alone, in their own shapes).

Body: `sentences` (FlagEmbedding's name; `input` is taken too) as a string or strings, `model`, `return_dense`
(default true), `return_sparse` and `return_colbert_vecs` (default false), as FlagEmbedding's defaults are;
`max_length` (tokens a text keeps; default the model's limit, not FlagEmbedding's 512); `encoding_format` (`float`,
or `base64`: each dense row and each token vector the base64 of its little-endian float32). The answer has
FlagEmbedding's keys: `dense_vecs` (normalised), `lexical_weights` (per text, `{token id as a string: weight}`) and
`colbert_vecs` (per text, one normalised row a token but the first), null when not asked; and `usage`.

/compute_score's body: `sentence_pairs`, one [query, passage] pair or a list of them, `model`,
`weights_for_different_modes` (dense, sparse, colbert; default [1, 1, 1]), `max_query_length` and
`max_passage_length` (default the model's limit, not FlagEmbedding's 512). The answer has compute_score's keys,
'colbert', 'sparse', 'dense', 'sparse+dense' and 'colbert+sparse+dense': a score each for one pair, a list in the
pairs' order for a list (as FlagEmbedding answers), null where FlagEmbedding's is not a number ('sparse+dense'
when both its weights are 0); and `model` and `usage`. The scores are computed on the replicas (one request per
distinct query), as /score's are: no vector crosses the wire.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.all_outputs import AllOutputs
from bouquet.encodings import FORMATS, ResponseFormat
from bouquet.gateway.api.fields import Model, ModeWeights, Text, Texts, choice, described, mode_weights
from bouquet.gateway.api.openai import Usage
from bouquet.gateway.encode import encode
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody, ResponseBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import EncodeJob, RerankJob
from bouquet.gateway.scoring import mode_scores
from bouquet.gateway.service import Service

ROUTE = "/encode"
COMPUTE_SCORE_ROUTE = "/compute_score"
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


MaxLength = Annotated[int, described("tokens a text keeps; default the model's limit", minimum=2)] | None


class ComputeScoreRequest(RequestBody):
    """FlagEmbedding's `compute_score` arguments."""

    sentence_pairs: Annotated[
        list[Text | Annotated[list[Text], Meta(min_length=2, max_length=2)]],
        Meta(min_length=1),
        described("one [query, passage] pair, or a list of such pairs"),
    ]
    model: Model = None
    weights_for_different_modes: ModeWeights = None
    max_query_length: MaxLength = None
    max_passage_length: MaxLength = None


COMPUTE_SCORE = BodyDecoder(ComputeScoreRequest)


def routes() -> list[Route]:
    return [
        Route(ROUTE, endpoint(ROUTE, _encode, work=True), methods=["POST"]),
        Route(COMPUTE_SCORE_ROUTE, endpoint(COMPUTE_SCORE_ROUTE, _compute_score, work=True), methods=["POST"]),
    ]


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


Score = Annotated[Any, Meta(extra_json_schema={
    "description": "one pair's score, or a list in the pairs' order; null where not a number",
    "anyOf": [{"type": "number"}, {"type": "null"}, {"type": "array", "items": {"type": "number", "nullable": True}}],
})]  # fmt: skip


class ModeScores(ResponseBody):
    """FlagEmbedding's `compute_score` answer."""

    model: str
    colbert: Score
    sparse: Score
    dense: Score
    sparse_dense: Score = msgspec.field(name="sparse+dense")
    colbert_sparse_dense: Score = msgspec.field(name="colbert+sparse+dense")
    usage: Usage


async def _compute_score(service: Service, request: Request) -> Response:
    body = await read_request(service, request, COMPUTE_SCORE)
    pairs, one_pair = sentence_pairs(body.sentence_pairs)
    job = RerankJob(body.model, pairs, mode_weights=mode_weights(body.weights_for_different_modes))
    lengths = (_max_length(body.max_query_length, "max_query_length"),
               _max_length(body.max_passage_length, "max_passage_length"))  # fmt: skip
    model, scores, tokens = await unless_disconnected(request, mode_scores(service, job, lengths))

    def answer(values: np.ndarray) -> Any:
        numbers = [None if math.isnan(value) else value for value in values.tolist()]
        return numbers[0] if one_pair else numbers

    return json_response(ModeScores(
        job.model or model.id, answer(scores["colbert"]), answer(scores["sparse"]), answer(scores["dense"]),
        answer(scores["sparse+dense"]), answer(scores["colbert+sparse+dense"]), Usage(tokens, tokens),
    ))  # fmt: skip


def _max_length(value: int | None, field: str) -> int | None:
    if value is not None and value < 2:  # the [CLS] and one token with a vector
        raise InvalidRequest(f"{field} must be 2 or more, got {value}", "invalid_value", field)
    return value


def sentence_pairs(value: list[str | list[str]]) -> tuple[list[tuple[str, str]], bool]:
    """The pairs, and whether the body held one pair (["query", "passage"]) rather than a list of pairs."""
    if all(isinstance(item, str) for item in value):
        if len(value) != 2:
            message = f"one pair is two texts, [query, passage]; got {len(value)}: send a list of pairs for several"
            raise InvalidRequest(message, "invalid_value", "sentence_pairs")
        return [(str(value[0]), str(value[1]))], True
    if not all(isinstance(item, list) for item in value):
        message = "sentence_pairs: one [query, passage] pair, or a list of pairs, not both mixed"
        raise InvalidRequest(message, "invalid_value", "sentence_pairs")
    return [(item[0], item[1]) for item in value if isinstance(item, list)], False
