"""vLLM's own routes beside the OpenAI ones: `POST /score` and `/v1/score` (a cross-encoder's score per pair,
`text_1` against `text_2` or vLLM's newer names for them), `/tokenize`'s vLLM body (`prompt`; TEI's /tokenize
route hands it here), `POST /detokenize`, and SageMaker's probe `/ping`. Errors have OpenAI's body, as vLLM's."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.gateway import scoring, text_tools
from bouquet.gateway.api.fields import (
    is_int,
    optional_field,
    refuse_unknown,
    required_text,
    required_texts,
    strict,
)
from bouquet.gateway.errors import InvalidRequest, Unprocessable
from bouquet.gateway.http.body import read_json
from bouquet.gateway.http.endpoint import Handler, endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import RerankJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service

ACTIVATION_FIELDS = {"activation", "use_activation"}  # false for the raw logits (TEI's raw_scores)
SCORE_FIELDS = frozenset({"text_1", "text_2", "model", "truncate", "instruction", *ACTIVATION_FIELDS})
# vLLM's newer names for /score's two sides, each taken for text_1 or text_2
SCORE_ALIASES = {"queries": "text_1", "data_1": "text_1", "documents": "text_2", "items": "text_2", "data_2": "text_2"}
TOKENIZE_FIELDS = frozenset({"model", "prompt", "add_special_tokens", "return_token_strs"})
DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def routes(health: Handler) -> list[Route]:
    """`health`: the answer /ping shares with /health."""
    return [
        Route("/score", endpoint("/score", _score, work=True), methods=["POST"]),
        Route("/v1/score", endpoint("/v1/score", _score, work=True), methods=["POST"]),
        Route("/detokenize", endpoint("/detokenize", _detokenize, work=True, replicas=False), methods=["POST"]),
        Route("/ping", endpoint("/ping", health, public=True), methods=["GET", "POST"]),
    ]


async def _score(service: Service, request: Request) -> Response:
    job = parse_score(await read_json(service, request), strict(service))
    model, scores, tokens = await unless_disconnected(request, scoring.score(service, job))
    return json_response(score_response(scores, model, tokens))


async def tokenize(service: Service, body: dict[str, Any]) -> Response:
    """`{"prompt"}` -> `{"count", "max_model_len", "tokens", "token_strs"}`."""
    if strict(service):
        refuse_unknown(body, TOKENIZE_FIELDS)
    prompt = optional_field(body, "prompt", str)
    if not prompt:
        raise InvalidRequest("'prompt' is required and must not be empty", "empty_input", "prompt")
    model = service.catalog.get(optional_field(body, "model", str))
    add_special = optional_field(body, "add_special_tokens", bool)
    tokens = await text_tools.tokenize(service, model, [prompt], "", add_special is not False)
    ids = [token["id"] for token in tokens[0]]
    # the vocabulary's token strings (HF's convert_ids_to_tokens), not TEI's spans of the text
    strings = model.require_tokenizer().token_strings(ids) if optional_field(body, "return_token_strs", bool) else None
    return json_response(
        {"count": len(ids), "max_model_len": model.max_seq_length, "tokens": ids, "token_strs": strings}
    )


async def _detokenize(service: Service, request: Request) -> Response:
    """`{"model", "tokens"}` -> `{"prompt"}`, special tokens kept as HF's decode keeps them."""
    body = await read_json(service, request)
    if strict(service):
        refuse_unknown(body, DETOKENIZE_FIELDS)
    tokens = body.get("tokens")
    if tokens is None:
        raise InvalidRequest("'tokens' is required", "missing_required_parameter", "tokens")
    if not isinstance(tokens, list) or not all(map(is_int, tokens)):
        raise Unprocessable("'tokens' must be a list of token ids", "invalid_type", "tokens")
    model_name = optional_field(body, "model", str)
    (prompt,) = await text_tools.decode(service, model_name, [tokens], False, "tokens", indexed=False)
    return json_response({"prompt": prompt})


def parse_score(body: dict[str, Any], strict: bool = True) -> RerankJob:
    """vLLM's /score: `text_1` one query against every `text_2`, or two lists of the same length, pair by pair."""
    body = _score_aliases(body)
    if strict:
        refuse_unknown(body, SCORE_FIELDS)
    first, second = body.get("text_1"), body.get("text_2")
    queries = [required_text(body, "text_1")] if isinstance(first, str) else required_texts(first, "text_1")
    documents = [required_text(body, "text_2")] if isinstance(second, str) else required_texts(second, "text_2")
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        message = f"'text_1' has {len(queries)} texts and 'text_2' {len(documents)}: give one text_1, or as many"
        raise InvalidRequest(message, "invalid_value", "text_1")
    truncate = optional_field(body, "truncate", bool)
    return RerankJob(
        optional_field(body, "model", str),
        list(zip(queries, documents, strict=True)),
        truncate is not False,
        raw_scores=raw_scores(body),
        instruction=optional_field(body, "instruction", str),
    )


def _score_aliases(body: dict[str, Any]) -> dict[str, Any]:
    """The body with vLLM's newer side names (queries, documents, items, data_1, data_2) as text_1 and text_2."""
    renamed = dict(body)
    for alias, name in SCORE_ALIASES.items():
        if alias in body:
            if name in renamed:
                raise InvalidRequest(f"'{alias}' and another field both give {name}; send one", "invalid_value", alias)
            renamed[name] = renamed.pop(alias)
    return renamed


def raw_scores(body: dict[str, Any]) -> bool:
    """vLLM's `activation` (older) or `use_activation`: false asks for the logits, the model's activation undone."""
    values = {optional_field(body, name, bool) for name in sorted(ACTIVATION_FIELDS)} - {None}
    if len(values) > 1:
        raise InvalidRequest("'activation' and 'use_activation' disagree", "invalid_value", "use_activation")
    return values == {False}


def score_response(scores: np.ndarray, model: ServedModel, tokens: int) -> dict[str, Any]:
    """vLLM's /score answer: one score per pair, in order."""
    data = [{"index": index, "object": "score", "score": float(value)} for index, value in enumerate(scores)]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model.id,
            "data": data, "usage": usage}  # fmt: skip
