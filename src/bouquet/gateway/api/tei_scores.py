"""text-embeddings-inference's scoring routes, with its error bodies: `POST /rerank` (TEI's `query` and `texts`;
Cohere's and Jina's `documents` are answered in their shape, as their clients also send here) and `POST /predict`
(a classifier's labels for a text, a pair, or a batch of either)."""

from __future__ import annotations

from typing import Annotated, Any

import numpy as np
from msgspec import UNSET, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.gateway import scoring
from bouquet.gateway.api import cohere
from bouquet.gateway.api.fields import Count, described, mode_weights, strict, truncation_direction
from bouquet.gateway.api.tei_bodies import PREDICT, RERANK, PredictRequest, TEIRerankRequest
from bouquet.gateway.errors import ApiError, InvalidRequest, Unprocessable
from bouquet.gateway.http.body import read_body, read_request
from bouquet.gateway.http.decode import EitherDecoder, ResponseBody, present
from bouquet.gateway.http.endpoint import endpoint, json_response, openai_errors, unless_disconnected
from bouquet.gateway.http.error_responses import error_response
from bouquet.gateway.jobs import PredictInput, PredictJob, RerankJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service


def routes() -> list[Route]:
    return [
        Route("/rerank", endpoint("/rerank", _rerank, work=True, tei=True), methods=["POST"]),
        Route("/predict", endpoint("/predict", _predict, work=True, tei=True), methods=["POST"]),
    ]


# TEI's `/rerank` body (`texts`), or Cohere's and Jina's (`documents`)
RERANK_BODIES = EitherDecoder(RERANK, cohere.V1_RERANK, lambda body: body.documents is not UNSET)


async def _rerank(service: Service, request: Request) -> Response:
    """TEI's shape (`texts`; TEI's answer and errors), or Cohere's and Jina's (`documents`; OpenAI's errors), which
    clients also send here."""
    body = await read_body(service, request)
    try:
        parsed = RERANK_BODIES.decode(body, strict(service))
    except ApiError as error:  # the body's shape says whose error it is (looked for on this path only)
        if "documents" in present(body):
            return error_response(error)
        raise
    if isinstance(parsed, cohere.CohereRerankRequest):
        return await openai_errors(cohere.rerank_body(service, request, parsed))
    job, return_text = tei_rerank_job(parsed)
    _, scores, _ = await unless_disconnected(request, scoring.score(service, job))
    return json_response(tei_response(scores, job, return_text))


async def _predict(service: Service, request: Request) -> Response:
    job = predict_job(await read_request(service, request, PREDICT))
    model, scores, _ = await unless_disconnected(request, scoring.predict(service, job))
    return json_response(predict_response(scores, job, model))


def tei_rerank_job(body: TEIRerankRequest) -> tuple[RerankJob, bool]:
    """TEI's body as a job, and whether to return each text."""
    if truncation_direction(body.truncation_direction) != "right":
        message = "truncation_direction 'left' is not supported for pairs: the longer part is cut from its end"
        raise InvalidRequest(message, "unsupported_parameter", "truncation_direction")
    job = RerankJob(
        model=body.model,
        pairs=[(body.query, text) for text in body.texts],
        truncate=body.truncate is not False,
        raw_scores=bool(body.raw_scores),
        instruction=body.instruction,
        mode_weights=mode_weights(body.weights_for_different_modes),
    )
    return job, bool(body.return_text)


class Rank(ResponseBody):
    index: Count
    score: float
    text: str | UnsetType = UNSET  # with return_text


TEIRanking = Annotated[list[Rank], described("every text, best first; `text` with return_text")]


def tei_response(scores: np.ndarray, job: RerankJob, return_text: bool) -> TEIRanking:
    """TEI's answer: every text's index and score, best first; among equal scores the later text first, as TEI
    orders them (a stable ascending sort, reversed)."""
    return [
        Rank(index, float(scores[index]), job.pairs[index][1] if return_text else UNSET)
        for index in np.argsort(scores, kind="stable")[::-1].tolist()
    ]


def predict_job(body: PredictRequest) -> PredictJob:
    """TEI's `inputs`: "text", ["text"], ["first", "second"] (a pair), or a batch [["text"], ["first", "second"]]."""
    inputs, single = _inputs(body.inputs)
    direction = truncation_direction(body.truncation_direction)
    if direction == "left" and any(isinstance(sequence, tuple) for sequence in inputs):
        message = "truncation_direction 'left' is not supported for pairs: the longer part is cut from its end"
        raise InvalidRequest(message, "unsupported_parameter", "truncation_direction")
    return PredictJob(
        model=body.model,
        inputs=inputs,
        single=single,
        truncate=body.truncate is not False,
        truncation_direction=direction,
        raw_scores=bool(body.raw_scores),
        instruction=body.instruction,
    )


def _inputs(value: str | list[Any]) -> tuple[list[PredictInput], bool]:
    """One text, one pair (a list of strings) or a batch of [text] / [first, second]; the types, and that no text
    is empty, already checked."""
    if isinstance(value, str):
        return [value], True
    if not value:
        raise InvalidRequest("'inputs' is an empty list", "empty_input", "inputs")
    if isinstance(value[0], str):
        return [_sequence(value, "inputs")], True
    return [_sequence(item, f"inputs[{index}]") for index, item in enumerate(value)], False


def _sequence(value: Any, name: str) -> PredictInput:
    """A list of one string (a text) or two (a pair)."""
    if not isinstance(value, list) or not 1 <= len(value) <= 2 or not all(isinstance(text, str) for text in value):
        raise Unprocessable(f"'{name}' must be a text or a pair: a list of one or two strings", "invalid_type", name)
    return value[0] if len(value) == 1 else (value[0], value[1])


class Prediction(ResponseBody):
    score: float
    label: str


_LABELS = {"type": "array", "items": {"$ref": "#/components/schemas/Prediction"}, "minItems": 1}
# One input's labels, or a batch's: two kinds of list, which only a schema (not a type) can say.
Predictions = Annotated[
    list[Any], described("every label, best first", anyOf=[_LABELS, {"type": "array", "items": _LABELS}])
]


def predict_response(scores: np.ndarray, job: PredictJob, model: ServedModel) -> Predictions:
    """TEI's answer: per input, every label with its score, best first; one list for a single input."""
    answers = [
        [Prediction(float(row[label]), model.labels[label]) for label in np.argsort(-row, kind="stable").tolist()]
        for row in scores
    ]
    return answers[0] if job.single else answers
