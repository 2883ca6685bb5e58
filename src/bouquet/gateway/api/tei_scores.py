"""text-embeddings-inference's scoring routes, with its error bodies: `POST /rerank` (TEI's `query` and `texts`;
Cohere's and Jina's `documents` are answered in their shape, as their clients also send here) and `POST /predict`
(a classifier's labels for a text, a pair, or a batch of either)."""

from __future__ import annotations

from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.gateway import scoring
from bouquet.gateway.api import cohere
from bouquet.gateway.api.fields import (
    optional_field,
    refuse_unknown,
    required_text,
    required_texts,
    strict,
    truncation_direction,
)
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import endpoint, json_response, openai_errors, unless_disconnected
from bouquet.gateway.jobs import PredictInput, PredictJob, RerankJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service
from bouquet.tokenizer import TRUNCATION_DIRECTIONS

RERANK_FIELDS = frozenset(
    {"query", "texts", "model", "raw_scores", "return_text", "truncate", "truncation_direction", "instruction"}
)
PREDICT_FIELDS = frozenset({"inputs", "truncate", "truncation_direction", "raw_scores", "model", "instruction"})


def routes() -> list[Route]:
    return [
        Route("/rerank", endpoint("/rerank", _rerank, work=True, tei=True), methods=["POST"]),
        Route("/predict", endpoint("/predict", _predict, work=True, tei=True), methods=["POST"]),
    ]


async def _rerank(service: Service, request: Request) -> Response:
    """TEI's shape (`texts`), or Cohere's and Jina's (`documents`), which clients also send here."""
    body = await read_json(service, request)
    if "documents" in body:
        return await openai_errors(cohere.rerank_body(service, request, body))
    job, return_text = parse_tei_rerank(body, strict(service))
    _, scores, _ = await unless_disconnected(request, scoring.score(service, job))
    return json_response(tei_response(scores, job, return_text))


async def _predict(service: Service, request: Request) -> Response:
    job = parse_predict(await read_json(service, request), strict(service))
    model, scores, _ = await unless_disconnected(request, scoring.predict(service, job))
    return json_response(predict_response(scores, job, model))


def parse_tei_rerank(body: dict[str, Any], strict: bool = True) -> tuple[RerankJob, bool]:
    """TEI's body, and whether to return each text."""
    if strict:
        refuse_unknown(body, RERANK_FIELDS)
    if truncation_direction(body) != "right":
        message = "truncation_direction 'left' is not supported for pairs: the longer part is cut from its end"
        raise InvalidRequest(message, "unsupported_parameter", "truncation_direction")
    query = required_text(body, "query")
    texts = required_texts(body.get("texts"), "texts")
    truncate = optional_field(body, "truncate", bool)
    job = RerankJob(
        model=optional_field(body, "model", str),
        pairs=[(query, text) for text in texts],
        truncate=True if truncate is None else truncate,
        raw_scores=bool(optional_field(body, "raw_scores", bool)),
        instruction=optional_field(body, "instruction", str),
    )
    return job, bool(optional_field(body, "return_text", bool))


def tei_response(scores: np.ndarray, job: RerankJob, return_text: bool) -> list[dict[str, Any]]:
    """TEI's answer: every text's index and score, best first; among equal scores the later text first, as TEI
    orders them (a stable ascending sort, reversed)."""
    return [
        {"index": index, "score": float(scores[index]), **({"text": job.pairs[index][1]} if return_text else {})}
        for index in np.argsort(scores, kind="stable")[::-1].tolist()
    ]


def parse_predict(body: dict[str, Any], strict: bool = True) -> PredictJob:
    """TEI's `inputs`: "text", ["text"], ["first", "second"] (a pair), or a batch [["text"], ["first", "second"]]."""
    if strict:
        refuse_unknown(body, PREDICT_FIELDS)
    inputs, single = _inputs(body.get("inputs"))
    direction = str(optional_field(body, "truncation_direction", str) or "right").lower()
    if direction not in TRUNCATION_DIRECTIONS:
        message = f"truncation_direction must be one of {TRUNCATION_DIRECTIONS}, got {direction!r}"
        raise InvalidRequest(message, "invalid_value", "truncation_direction")
    if direction == "left" and any(isinstance(sequence, tuple) for sequence in inputs):
        message = "truncation_direction 'left' is not supported for pairs: the longer part is cut from its end"
        raise InvalidRequest(message, "unsupported_parameter", "truncation_direction")
    truncate = optional_field(body, "truncate", bool)
    return PredictJob(
        model=optional_field(body, "model", str),
        inputs=inputs,
        single=single,
        truncate=truncate is not False,
        truncation_direction=direction,
        raw_scores=bool(optional_field(body, "raw_scores", bool)),
        instruction=optional_field(body, "instruction", str),
    )


def _inputs(value: Any) -> tuple[list[PredictInput], bool]:
    if value is None:
        raise InvalidRequest("'inputs' is required", "missing_required_parameter", "inputs")
    if isinstance(value, str):
        return [_sequence([value], "inputs")], True
    if not isinstance(value, list):
        raise Unprocessable("'inputs' must be a string, a pair of strings or a list of them", "invalid_type", "inputs")
    if not value:
        raise InvalidRequest("'inputs' is an empty list", "empty_input", "inputs")
    if isinstance(value[0], str):
        return [_sequence(value, "inputs")], True
    return [_sequence(item, f"inputs[{index}]") for index, item in enumerate(value)], False


def _sequence(value: Any, name: str) -> PredictInput:
    """A list of one string (a text) or two (a pair)."""
    if not isinstance(value, list) or not 1 <= len(value) <= 2 or not all(isinstance(text, str) for text in value):
        raise Unprocessable(f"'{name}' must be a text or a pair: a list of one or two strings", "invalid_type", name)
    if not all(value):
        raise InvalidRequest(f"'{name}' holds an empty string", "empty_input", name)
    return value[0] if len(value) == 1 else (value[0], value[1])


def predict_response(scores: np.ndarray, job: PredictJob, model: ServedModel) -> list[Any]:
    """TEI's answer: per input, every label with its score, best first; one list for a single input."""
    answers = [
        [{"score": float(row[label]), "label": model.labels[label]} for label in np.argsort(-row, kind="stable")]
        for row in scores
    ]
    return answers[0] if job.single else answers
