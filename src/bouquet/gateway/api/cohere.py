"""Cohere's API, as its SDK calls it: v1's `POST /v1/rerank` (also Jina's and vLLM's shape, and TEI's /rerank with
`documents`), and v2's `POST /v2/embed` and `POST /v2/rerank` (`ClientV2`).

`/v2/embed` takes `texts`, `images` (data URIs; a URL only on an origin the server lists) or `inputs` (each a
`content` list of `{"type": "text", "text"}` and `{"type": "image_url", "image_url": {"url"}}` parts), exactly one
of them; texts and images of one model come back in one space (gateway/mixed_inputs.py: a text model refuses
images, 400). `input_type` (search_query, search_document, classification, clustering: the model's
sentence-transformers prompt of that role for texts where it has one, else none; image: none),
`embedding_types` (any of float, int8, uint8, binary, ubinary, base64: each computed from the same float rows,
in bouquet's encodings), `output_dimension`, `max_tokens` (keep the first N tokens of a text) and `truncate` (END,
the default; START; NONE: an input over the limit is an error).
`/v2/rerank` takes `query`, `documents` (strings) and `top_n`, and answers the results without documents, as v2 does.
Errors have Cohere's body, `{"message": ...}` (http/error_responses.py), with the status of the error."""

from __future__ import annotations

import base64
import uuid
from dataclasses import dataclass, replace
from typing import Annotated, Any, ClassVar

import msgspec
import numpy as np
from msgspec import UNSET, Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.encodings import Encoding, encode_rows
from bouquet.gateway import scoring
from bouquet.gateway.api.cohere_answers import (
    BilledUnits,
    CohereImageFacts,
    CohereMeta,
    CohereRanking,
    CohereV2Embeddings,
    CohereV2Ranking,
    EmbeddingsByType,
    RankedDocument,
    RankedResult,
    V2RankedResult,
)
from bouquet.gateway.api.fields import (
    Instruction,
    Model,
    ModeWeights,
    Text,
    Texts,
    described,
    mode_weights,
)
from bouquet.gateway.api.multimodal import Image, ImageUrl
from bouquet.gateway.api.openai import Usage
from bouquet.gateway.api.vllm import Activation, raw_scores
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_request
from bouquet.gateway.http.decode import BodyDecoder, RequestBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.http.error_responses import cohere_error_response
from bouquet.gateway.image_facts import ImageFacts
from bouquet.gateway.jobs import EmbedJob, RerankJob
from bouquet.gateway.mixed_inputs import MixedJob, embed_mixed
from bouquet.gateway.patch_embed import Conversation, ImageInput
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service

TopN = Annotated[int, Meta(ge=1, description="default: every document")] | None
# Cohere's scheduling hint and v2's per-document cut: refused by name rather than silently ignored (null is left out)
Refused = Annotated[Any, described("refused", nullable=True, enum=[None])]


class CohereDocument(msgspec.Struct):
    """A document as an object (Jina's); its other fields are ignored."""

    text: Text


class CohereRerankRequest(RequestBody):
    query: Text
    documents: Annotated[list[Text | CohereDocument], Meta(min_length=1)]
    model: Model = None
    top_n: TopN = None
    return_documents: Annotated[bool, Meta(extra_json_schema={"default": True})] | None = None
    instruction: Instruction = None
    activation: Activation = None
    use_activation: Activation = None
    weights_for_different_modes: ModeWeights = None


class CohereText(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class CohereImage(msgspec.Struct, tag="image_url", tag_field="type"):
    image_url: ImageUrl


class CohereInput(msgspec.Struct):
    content: Annotated[list[CohereText | CohereImage], Meta(min_length=1)]


class CohereV2EmbedRequest(RequestBody):
    """Exactly one of texts, images and inputs."""

    model: Model = None
    texts: Annotated[Texts, described("the texts (or `images`, or `inputs`)")] | None = None
    images: Annotated[list[Image], Meta(min_length=1, description="images to embed, each alone")] | None = None
    inputs: Annotated[list[CohereInput], Meta(min_length=1, description=(
        "each input's parts: its texts joined; a text or an image alone, or (a model whose images enter its "
        "decoder) texts and images together"
    ))] | None = None  # fmt: skip
    input_type: Annotated[str, described(
        "the model's prompt of that role for texts (query, document / passage, ...); image: none",
        enum=["search_query", "search_document", "classification", "clustering", "image"],
    )] | None = None  # fmt: skip
    embedding_types: Annotated[list[Annotated[str, Meta(extra_json_schema={"enum": [
        "float", "int8", "uint8", "binary", "ubinary", "base64"]})]], Meta(min_length=1, description="default: float")
    ] | None = None  # fmt: skip
    output_dimension: Annotated[int, Meta(ge=1)] | None = None
    max_tokens: Annotated[int, Meta(ge=1, description="keep each input's first N tokens")] | None = None
    truncate: Annotated[str, Meta(extra_json_schema={"enum": ["NONE", "START", "END"], "default": "END"})] | None = None
    priority: Refused = None

    __openapi__: ClassVar[dict[str, Any]] = {
        "oneOf": [{"required": ["texts"]}, {"required": ["images"]}, {"required": ["inputs"]}]
    }


class CohereV2RerankRequest(RequestBody):
    query: Text
    documents: Texts
    model: Model = None
    top_n: TopN = None
    max_tokens_per_doc: Refused = None
    priority: Refused = None


V1_RERANK = BodyDecoder(CohereRerankRequest)
V2_EMBED = BodyDecoder(CohereV2EmbedRequest)
V2_RERANK = BodyDecoder(CohereV2RerankRequest)

# Each embedding type: the encoding its rows take, and whether each row is a base64 string of its bytes.
EMBEDDING_TYPES: dict[str, tuple[Encoding, bool]] = {
    "float": (Encoding.FLOAT32, False),
    "int8": (Encoding.INT8, False),
    "uint8": (Encoding.UINT8, False),
    "binary": (Encoding.BINARY, False),
    "ubinary": (Encoding.UBINARY, False),
    "base64": (Encoding.FLOAT32, True),
}
# input_type -> the sentence-transformers prompt names that play its role, the first a model has is used.
INPUT_TYPE_PROMPTS: dict[str, tuple[str, ...]] = {
    "search_query": ("query", "search_query"),
    "search_document": ("document", "passage", "search_document", "doc"),
    "classification": ("classification",),
    "clustering": ("clustering",),
    "image": (),
}
TRUNCATE = ("NONE", "START", "END")


def routes() -> list[Route]:
    def v2(path: str, handler: Any) -> Route:
        return Route(path, endpoint(path, handler, work=True, errors=cohere_error_response), methods=["POST"])

    return [
        Route("/v1/rerank", endpoint("/v1/rerank", _v1_rerank, work=True), methods=["POST"]),
        v2("/v2/embed", _v2_embed),
        v2("/v2/rerank", _v2_rerank),
    ]


async def _v1_rerank(service: Service, request: Request) -> Response:
    return await rerank_body(service, request, await read_request(service, request, V1_RERANK))


async def rerank_body(service: Service, request: Request, body: CohereRerankRequest) -> Response:
    """v1's rerank (and Jina's and vLLM's) of a body already decoded."""
    job, top_n, return_documents = v1_rerank_job(body)
    model, scores, tokens = await unless_disconnected(request, scoring.score(service, job))
    return json_response(v1_rerank_response(scores, job, model, tokens, top_n, return_documents))


async def _v2_embed(service: Service, request: Request) -> Response:
    parsed = embed_request(await read_request(service, request, V2_EMBED))
    model = service.catalog.get(parsed.job.model)
    job = replace(parsed.job, prompt_name=prompt_name(model.prompts, parsed.input_type))
    if parsed.inputs is None:
        _, rows, tokens = await unless_disconnected(request, service.embed(job))
        return json_response(embed_response(rows, parsed, tokens))
    _, rows, tokens, facts = await unless_disconnected(request, embed_mixed(service, MixedJob(parsed.inputs, job)))
    return json_response(embed_response(rows, parsed, tokens, facts))


async def _v2_rerank(service: Service, request: Request) -> Response:
    job, top_n = v2_rerank_job(await read_request(service, request, V2_RERANK))
    _, scores, tokens = await unless_disconnected(request, scoring.score(service, job))
    return json_response(rerank_response(scores, top_n, tokens))


def v1_rerank_job(body: CohereRerankRequest) -> tuple[RerankJob, int | None, bool]:
    """Cohere's, Jina's and vLLM's body (documents as strings or {"text": ...}), its top_n and return_documents."""
    documents = [document if isinstance(document, str) else document.text for document in body.documents]
    job = RerankJob(
        model=body.model,
        pairs=[(body.query, text) for text in documents],
        raw_scores=raw_scores(body.activation, body.use_activation),
        instruction=body.instruction,
        mode_weights=mode_weights(body.weights_for_different_modes),
    )
    return job, body.top_n, body.return_documents is not False


def v1_rerank_response(
    scores: np.ndarray, job: RerankJob, model: ServedModel, tokens: int, top_n: int | None, return_documents: bool
) -> CohereRanking:
    """Cohere's, Jina's and vLLM's answer: the best `top_n` documents with their relevance, best first."""
    order = np.argsort(-scores, kind="stable")[:top_n].tolist()
    results = [
        RankedResult(index, float(scores[index]), RankedDocument(job.pairs[index][1]) if return_documents else UNSET)
        for index in order
    ]
    return CohereRanking(f"rerank-{uuid.uuid4().hex}", model.id, results, Usage(tokens, tokens))


@dataclass(frozen=True)
class CohereEmbed:
    job: EmbedJob  # float32 rows; each embedding type is encoded from them; its texts, or those of `inputs`
    input_type: str | None
    embedding_types: tuple[str, ...]
    inputs: list[Conversation] | None = None  # `images` or `inputs`: each input's parts; None: `texts`


def embed_request(body: CohereV2EmbedRequest) -> CohereEmbed:
    _refuse_priority(body.priority)
    texts, inputs = _texts_or_inputs(body)
    input_type = body.input_type
    if input_type is not None and input_type not in INPUT_TYPE_PROMPTS:
        known = ", ".join(INPUT_TYPE_PROMPTS)
        raise InvalidRequest(f"'input_type' must be one of {known}, got {input_type!r}", "invalid_value", "input_type")
    truncate = (body.truncate or "END").upper()
    if truncate not in TRUNCATE:
        raise InvalidRequest(f"'truncate' must be one of {TRUNCATE}, got {truncate!r}", "invalid_value", "truncate")
    job = EmbedJob(
        model=body.model,
        texts=texts,
        token_ids=None,
        options=RowOptions(body.output_dimension, None),
        truncate=truncate != "NONE",
        truncation_direction="left" if truncate == "START" else "right",
        truncate_tokens=body.max_tokens,
        truncate_field="max_tokens",
        long_input="truncate" if truncate == "NONE" else None,  # over the limit stays an error, never chunked
    )
    return CohereEmbed(job, input_type, _embedding_types(body.embedding_types), inputs)


def prompt_name(prompts: dict[str, str], input_type: str | None) -> str | None:
    """The model's prompt for `input_type`'s role, or None (then the model's default prompt applies)."""
    names = INPUT_TYPE_PROMPTS.get(input_type or "", ())
    return next((name for name in names if name in prompts), None)


def embed_response(
    rows: np.ndarray, request: CohereEmbed, tokens: int, images: list[ImageFacts] | None = None
) -> CohereV2Embeddings:
    """Cohere's EmbedByTypeResponse: every type asked for, each computed from the float rows; the images' facts
    when there were images."""
    embeddings: dict[str, Any] = {}
    for name in request.embedding_types:
        encoding, as_base64 = EMBEDDING_TYPES[name]
        encoded = encode_rows(rows, encoding)
        embeddings[name] = (
            [base64.b64encode(row.tobytes()).decode("ascii") for row in encoded] if as_base64 else encoded
        )
    meta = CohereMeta(BilledUnits(input_tokens=tokens))
    facts = [CohereImageFacts(f.width, f.height, f.format, f.bit_depth) for f in images or ()] or UNSET
    return CohereV2Embeddings(
        str(uuid.uuid4()), EmbeddingsByType(**embeddings), request.job.texts or [], meta, images=facts
    )


def v2_rerank_job(body: CohereV2RerankRequest) -> tuple[RerankJob, int | None]:
    _refuse_priority(body.priority)
    if body.max_tokens_per_doc is not None:
        message = "'max_tokens_per_doc' is not supported: each pair is cut to the model's limit"
        raise InvalidRequest(message, "unsupported_parameter", "max_tokens_per_doc")
    return RerankJob(model=body.model, pairs=[(body.query, text) for text in body.documents]), body.top_n


def rerank_response(scores: np.ndarray, top_n: int | None, tokens: int) -> CohereV2Ranking:
    """Cohere's V2RerankResponse: the best `top_n` documents' indices and relevance, best first."""
    order = np.argsort(-scores, kind="stable")[:top_n].tolist()
    results = [V2RankedResult(index, float(scores[index])) for index in order]
    return CohereV2Ranking(str(uuid.uuid4()), results, CohereMeta(BilledUnits(search_units=1)))


def _refuse_priority(priority: Any) -> None:
    """Cohere's scheduling hint: the scheduler here is first come, first served, so a priority is refused by name
    rather than silently ignored."""
    if priority is not None:
        message = "'priority' is not supported: requests are served first come, first served"
        raise InvalidRequest(message, "unsupported_parameter", "priority")


def _texts_or_inputs(body: CohereV2EmbedRequest) -> tuple[list[str] | None, list[Conversation] | None]:
    """`texts`, or `images` and `inputs` as each input's parts (and their texts, which the answer echoes): exactly
    one of them, as the SDK sends (it leaves out what is not given, so a null is a client's mistake here)."""
    given = [name for name in ("texts", "images", "inputs") if getattr(body, name) is not None]
    if len(given) > 1:
        raise InvalidRequest(f"give one of 'texts', 'images' and 'inputs', not {given}", "invalid_value", given[-1])
    if body.texts is not None:
        return body.texts, None
    if body.images is not None:
        return None, [_image_input(image, f"images[{index}]") for index, image in enumerate(body.images)]
    if body.inputs is None:
        raise InvalidRequest("'texts' (or 'images', or 'inputs') is required", "missing_required_parameter", "texts")
    inputs = [_input_parts(item, index) for index, item in enumerate(body.inputs)]
    return [part for item in inputs for part in item.parts if isinstance(part, str)], inputs  # texts echoed


def _image_input(image: str, name: str) -> Conversation:
    return Conversation([ImageInput(image, name)], name)


def _input_parts(item: CohereInput, index: int) -> Conversation:
    """An input's parts in order, each image named by its field's path; adjacent texts joined by a space (a text
    model embeds an input's text content as one text)."""
    parts: list[str | ImageInput] = []
    for number, part in enumerate(item.content):
        if isinstance(part, CohereImage):
            parts.append(ImageInput(part.image_url.url, f"inputs[{index}].content[{number}].image_url.url"))
        elif parts and isinstance(parts[-1], str):
            parts[-1] = f"{parts[-1]} {part.text}"
        else:
            parts.append(part.text)
    if parts == [""]:
        raise InvalidRequest(f"'inputs[{index}]' holds no text", "empty_input", f"inputs[{index}]")
    return Conversation(parts, f"inputs[{index}]")


def _embedding_types(value: list[str] | None) -> tuple[str, ...]:
    if value is None:
        return ("float",)
    unknown = [name for name in value if name not in EMBEDDING_TYPES]
    if unknown:
        known = ", ".join(EMBEDDING_TYPES)
        raise InvalidRequest(f"unknown embedding_types {unknown}; known: {known}", "invalid_value", "embedding_types")
    return tuple(dict.fromkeys(value))
