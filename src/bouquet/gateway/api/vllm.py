"""vLLM's own routes beside the OpenAI ones: `POST /score` and `/v1/score` (a cross-encoder's score per pair,
`text_1` against `text_2` or vLLM's newer names for them; a CLIP's or SigLIP's texts against images, a side given
as vLLM's `{"content": [parts]}`, zero_shot.py), `/tokenize`'s vLLM body (`prompt`; TEI's /tokenize
route hands it here), `POST /detokenize`, and SageMaker's probe `/ping`. Errors have OpenAI's body, as vLLM's."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import msgspec
import numpy as np
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.gateway import scoring, text_tools, zero_shot
from bouquet.gateway.api.fields import (
    Count,
    Instruction,
    Model,
    ModeWeights,
    Text,
    Texts,
    Truncate,
    described,
    mode_weights,
)
from bouquet.gateway.api.multimodal import ImagePart, TextPart
from bouquet.gateway.api.openai import Usage
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody, ResponseBody
from bouquet.gateway.http.endpoint import Handler, endpoint, json_response, unless_disconnected
from bouquet.gateway.jobs import RerankJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service

# vLLM's `activation` (older) or `use_activation`: false for the logits (TEI's raw_scores); given both, they agree
Activation = Annotated[bool, described("vLLM's: false for the logits, no activation", default=True)] | None
ScoreActivation = Annotated[bool, described(
    "vLLM's: false for the logits, no activation; texts against images (zero-shot): unset gives their cosine, true "
    "the model's probability, false its logit", default=True,
)] | None  # fmt: skip


class Content(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's multimodal side of /score: each part one item, an image or a text (zero_shot.py)."""

    content: Annotated[list[TextPart | ImagePart], Meta(min_length=1)]


Side = Text | Texts | Content
# vLLM's newer names for /score's two sides: each side is given by exactly one of its names (else 400)
SCORE_SIDES: dict[str, tuple[str, ...]] = {
    "text_1": ("text_1", "queries", "data_1"),
    "text_2": ("text_2", "documents", "items", "data_2"),
}


class ScoreRequest(RequestBody):
    """Each side by exactly one of its names: text_1, queries or data_1; text_2, documents, items or data_2."""

    text_1: (
        Annotated[Side, described("one text scored against each text_2, or as many as text_2, pair by pair")] | None
    ) = None
    text_2: Side | None = None
    model: Model = None
    truncate: Truncate = None
    instruction: Instruction = None
    activation: ScoreActivation = None
    use_activation: ScoreActivation = None
    queries: Annotated[Side, described("vLLM's: text_1")] | None = None
    data_1: Annotated[Side, described("vLLM's: text_1")] | None = None
    documents: Annotated[Side, described("vLLM's: text_2")] | None = None
    items: Annotated[Side, described("vLLM's: text_2")] | None = None
    data_2: Annotated[Side, described("vLLM's: text_2")] | None = None
    weights_for_different_modes: ModeWeights = None

    __openapi__: ClassVar[dict[str, Any]] = {
        "allOf": [{"oneOf": [{"required": [name]} for name in names]} for names in SCORE_SIDES.values()]
    }


class VLLMTokenizeRequest(RequestBody):
    prompt: Text
    model: Model = None
    add_special_tokens: Annotated[bool, Meta(extra_json_schema={"default": True})] | None = None
    return_token_strs: Annotated[bool, Meta(extra_json_schema={"default": False})] | None = None


class DetokenizeRequest(RequestBody):
    tokens: Annotated[list[int], described("token ids; one outside the vocabulary is a 400")]
    model: Model = None


T = TypeVar("T")  # a side's items: texts, or text and image parts
U = TypeVar("U")
SCORE = BodyDecoder(ScoreRequest)
TOKENIZE = BodyDecoder(VLLMTokenizeRequest)
DETOKENIZE = BodyDecoder(DetokenizeRequest)


def routes(health: Handler) -> list[Route]:
    """`health`: the answer /ping shares with /health."""
    return [
        Route("/score", endpoint("/score", _score, work=True), methods=["POST"]),
        Route("/v1/score", endpoint("/v1/score", _score, work=True), methods=["POST"]),
        Route("/detokenize", endpoint("/detokenize", _detokenize, work=True, replicas=False), methods=["POST"]),
        Route("/ping", endpoint("/ping", health, public=True), methods=["GET", "POST"]),
    ]


async def _score(service: Service, request: Request) -> Response:
    body = await read_request(service, request, SCORE)
    if any(isinstance(getattr(body, name), Content) for names in SCORE_SIDES.values() for name in names):
        work = zero_shot.zero_shot_scores(service, zero_shot_job(body))
    else:
        work = scoring.score(service, score_job(body))
    model, scores, tokens = await unless_disconnected(request, work)
    return json_response(score_response(scores, model, tokens))


async def tokenize(service: Service, parsed: VLLMTokenizeRequest) -> Response:
    """`{"prompt"}` -> `{"count", "max_model_len", "tokens", "token_strs"}`."""
    model = service.catalog.get(parsed.model)
    tokens = await text_tools.tokenize(service, model, [parsed.prompt], "", parsed.add_special_tokens is not False)
    ids = [token["id"] for token in tokens[0]]
    # the vocabulary's token strings (HF's convert_ids_to_tokens), not TEI's spans of the text
    strings = model.require_tokenizer().token_strings(ids) if parsed.return_token_strs else None
    return json_response(VLLMTokens(len(ids), model.max_seq_length, ids, strings))


async def _detokenize(service: Service, request: Request) -> Response:
    """`{"model", "tokens"}` -> `{"prompt"}`, special tokens kept as HF's decode keeps them."""
    parsed = await read_request(service, request, DETOKENIZE)
    (prompt,) = await text_tools.decode(service, parsed.model, [parsed.tokens], False, "tokens", indexed=False)
    return json_response(Detokenized(prompt))


def score_job(body: ScoreRequest) -> RerankJob:
    """vLLM's /score: `text_1` one query against every `text_2`, or two lists of the same length, pair by pair."""
    queries, documents = (_side(body, names) for names in SCORE_SIDES.values())
    return RerankJob(
        body.model,
        _paired(queries, documents, "texts"),
        body.truncate is not False,
        raw_scores=raw_scores(body.activation, body.use_activation),
        instruction=body.instruction,
        mode_weights=mode_weights(body.weights_for_different_modes),
    )


def zero_shot_job(body: ScoreRequest) -> zero_shot.ZeroShotJob:
    """/score with a side in vLLM's multimodal form: one item against every item of the other side, or as many;
    the cosine unless `use_activation` asks for the model's probability (true) or logit (false)."""
    queries, documents = (_items(body, names) for names in SCORE_SIDES.values())
    activation = given_activation(body.activation, body.use_activation)
    return zero_shot.ZeroShotJob(body.model, _paired(queries, documents, "items"), activation)


def _paired(queries: list[T], documents: list[U], what: str) -> list[tuple[T, U]]:
    """vLLM's pairing of /score's sides: one `text_1` against every `text_2`, or two lists of the same length."""
    if len(queries) == 1:
        queries = queries * len(documents)
    if len(queries) != len(documents):
        message = f"'text_1' has {len(queries)} {what} and 'text_2' {len(documents)}: give one text_1, or as many"
        raise InvalidRequest(message, "invalid_value", "text_1")
    return list(zip(queries, documents, strict=True))


def _items(body: ScoreRequest, names: tuple[str, ...]) -> list[zero_shot.Item]:
    name, value = _given(body, names)
    if not isinstance(value, Content):
        return [zero_shot.Item(text=text) for text in ([value] if isinstance(value, str) else value)]
    return [
        zero_shot.Item(text=part.text)
        if isinstance(part, TextPart)
        else zero_shot.Item(image=part.image_url.url, name=f"{name}.content[{index}].image_url.url")
        for index, part in enumerate(value.content)
    ]


def _side(body: ScoreRequest, names: tuple[str, ...]) -> list[str]:
    """One side's texts, given by exactly one of its names."""
    name, value = _given(body, names)
    assert not isinstance(value, Content), f"{name}: content parts are zero_shot_job's to read"
    return [value] if isinstance(value, str) else value


def _given(body: ScoreRequest, names: tuple[str, ...]) -> tuple[str, Side]:
    """The name one side is given by (exactly one of `names`) and its value."""
    given = [name for name in names if getattr(body, name) is not None]
    if not given:
        raise InvalidRequest(f"'{names[0]}' is required", "missing_required_parameter", names[0])
    if len(given) > 1:
        raise InvalidRequest(f"'{given[1]}' and '{given[0]}' both give {names[0]}; send one", "invalid_value", given[1])
    return given[0], getattr(body, given[0])


def raw_scores(activation: bool | None, use_activation: bool | None) -> bool:
    """vLLM's `activation` (older) or `use_activation`: false asks for the logits, the model's activation undone."""
    return given_activation(activation, use_activation) is False


def given_activation(activation: bool | None, use_activation: bool | None) -> bool | None:
    """What vLLM's `activation` (older) or `use_activation` says, None when neither is given."""
    values = {activation, use_activation} - {None}
    if len(values) > 1:
        raise InvalidRequest("'activation' and 'use_activation' disagree", "invalid_value", "use_activation")
    return values.pop() if values else None


class Score(ResponseBody):
    index: Count
    score: float
    object: Literal["score"] = "score"


class Scores(ResponseBody):
    """vLLM's /score answer: one score per pair, in order."""

    id: str
    created: Count
    model: str
    data: list[Score]
    usage: Usage
    object: Literal["list"] = "list"


class VLLMTokens(ResponseBody):
    count: Count
    max_model_len: Count
    tokens: list[Count]
    token_strs: Annotated[
        list[str | None] | None, described("the vocabulary's token strings; null unless return_token_strs")
    ]


class Detokenized(ResponseBody):
    prompt: str


def score_response(scores: np.ndarray, model: ServedModel, tokens: int) -> Scores:
    data = [Score(index, float(value)) for index, value in enumerate(scores)]
    return Scores(f"score-{uuid.uuid4().hex}", int(time.time()), model.id, data, Usage(tokens, tokens))
