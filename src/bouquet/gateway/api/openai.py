"""OpenAI's embeddings API, as its clients (openai, langchain-openai, llama-index, litellm) and vLLM's and
Infinity's call it: `POST /v1/embeddings` (and Infinity's `/embeddings`) with vLLM's extensions, and the model
list `GET /v1/models` (Infinity's `/models`), `GET /v1/models/{model}`."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from msgspec import UNSET, Meta
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.encodings import ResponseFormat
from bouquet.gateway.api.fields import (
    ENCODING_FORMATS,
    Count,
    Dimensions,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    LongInput,
    Model,
    Row,
    described,
    long_input,
    one_of,
    parse_inputs,
    refuse_unless,
    response_format,
    strict,
    text_positions,
)
from bouquet.gateway.api.image_upload import is_upload, upload_job
from bouquet.gateway.api.multimodal import (
    CHAT_EMBEDDINGS,
    IMAGE_EMBEDDINGS,
    ChatEmbeddingsRequest,
    EmbeddingsInput,
    chat_job,
    embed_chat,
    has_objects,
    image_job,
    images_job,
    object_inputs,
)
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.body import read_body, read_request
from bouquet.gateway.http.decode import BodyDecoder, EitherDecoder, RequestBody, ResponseBody
from bouquet.gateway.http.endpoint import endpoint, json_response, unless_disconnected
from bouquet.gateway.images import ImageEmbedJob
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.mixed_inputs import MixedJob, embed_mixed
from bouquet.gateway.patch_embed import ConversationJob, embed_image_job
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service

T = TypeVar("T")


class EmbeddingsRequest(RequestBody):
    """Other fields are refused by name (400 unsupported_parameter) unless the server runs with
    --allow-unknown-fields, so a client never gets other vectors than it asked for without being told."""

    input: EmbeddingsInput
    model: Model = None
    encoding_format: EncodingFormat = None
    dimensions: Dimensions = None
    user: str | None = None
    # vLLM's extensions: honoured as vLLM does, or refused when a value asks for what is not done here
    normalize: Annotated[bool, described("vLLM's; default: as the model's Normalize module says")] | None = None
    # its value is checked where the model's limit is known (service.token_cap), the bounds below only documented
    truncate_prompt_tokens: Annotated[int, Meta(
        description="vLLM's: the first k tokens, specials kept; -1: the model's limit; over the limit: 400",
        extra_json_schema={"minimum": -1, "not": {"enum": [0]}},
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
    modality: Annotated[Any, described(
        "Infinity's; image: `input` holds images (data URIs or base64)", type="string", enum=["text", "image", None],
        nullable=True,
    )] = None  # fmt: skip
    long_input: LongInput = None  # bouquet's: "chunk" embeds an over-long input whole
    # Jina's names for two switches above (its jina-clip body): given beside them, they must agree
    normalized: Annotated[bool, described("Jina's name for normalize")] | None = None
    embedding_type: Annotated[str, one_of(ENCODING_FORMATS, description="Jina's name for encoding_format")] | None = (
        None
    )


EMBEDDINGS = BodyDecoder(EmbeddingsRequest)
# `/v1/embeddings` takes vLLM's chat form beside the text form, told apart by `messages`: either decoded in one pass.
EMBEDDING_BODIES = EitherDecoder(EMBEDDINGS, CHAT_EMBEDDINGS, lambda body: body.messages is not UNSET)


def routes() -> list[Route]:
    return [
        Route("/v1/embeddings", endpoint("/v1/embeddings", _embeddings, work=True), methods=["POST"]),
        Route("/embeddings", endpoint("/embeddings", _embeddings, work=True), methods=["POST"]),  # Infinity's
        Route("/embeddings_image", endpoint("/embeddings_image", _embeddings_image, work=True), methods=["POST"]),
        Route("/v1/models", endpoint("/v1/models", _models), methods=["GET"]),
        Route("/models", endpoint("/models", _models), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("/v1/models/{model}", _model), methods=["GET"]),
    ]


async def _embeddings(service: Service, request: Request) -> Response:
    """Texts or token ids in `input`; Infinity's images in `input` with `"modality": "image"`; or vLLM's chat form,
    `messages` holding one text or one image (api/multimodal.py)."""
    parsed = EMBEDDING_BODIES.decode(await read_body(service, request), strict(service))
    if isinstance(parsed, ChatEmbeddingsRequest):
        return await _answer(service, request, chat_job(parsed))
    if parsed.modality == "image":
        return await _answer(service, request, _image_input(parsed))
    if has_objects(parsed.input):
        return await _answer(service, request, _object_input(parsed))
    return await _answer(service, request, embed_job(parsed))


async def _embeddings_image(service: Service, request: Request) -> Response:
    """Infinity's image route: `input` holds images; or the body is an image's bytes, or a form of image files
    (api/image_upload.py)."""
    if is_upload(request):
        return await _answer(service, request, await upload_job(service, request))
    return await _answer(service, request, image_job(await read_request(service, request, IMAGE_EMBEDDINGS)))


async def _answer(
    service: Service, request: Request, job: EmbedJob | ImageEmbedJob | ConversationJob | MixedJob
) -> Response:
    if isinstance(job, ConversationJob):
        work = embed_chat(service, job)
    elif isinstance(job, MixedJob):
        work = _mixed_rows(service, job)
    else:
        work = embed_image_job(service, job) if isinstance(job, ImageEmbedJob) else service.embed(job)
    model, rows, tokens = await unless_disconnected(request, work)
    return json_response(openai_response(rows, job.model or model.id, tokens, job.response_format))


async def _mixed_rows(service: Service, job: MixedJob) -> tuple[ServedModel, Any, int]:
    """Jina's objects' rows (OpenAI's answer says nothing of the images)."""
    model, rows, tokens, _ = await embed_mixed(service, job)
    return model, rows, tokens


def _image_input(body: EmbeddingsRequest) -> ImageEmbedJob:
    formats = _response_format(body)
    return images_job(body.model, body.input, _row_options(body, formats), formats)


def _object_input(body: EmbeddingsRequest) -> MixedJob:
    """Jina's objects in `input` (with plain texts): each a text or an image, in one space; the texts' job holds
    the options, checked as for texts, and gets its texts from the objects."""
    assert not isinstance(body.input, str)
    return MixedJob(object_inputs(body.input), _texts_job(body, None, None))


def embed_job(body: EmbeddingsRequest) -> EmbedJob:
    """What the types leave to check: the values of names, the inputs of one kind, the two switches agreeing."""
    texts, token_ids = parse_inputs(body.input, "input")
    return _texts_job(body, texts, token_ids)


def _texts_job(body: EmbeddingsRequest, texts: list[str] | None, token_ids: list[list[int]] | None) -> EmbedJob:
    formats = _response_format(body)
    refuse_unless(
        body.add_special_tokens, "add_special_tokens", True, "special tokens are always added, as the model was trained"
    )
    refuse_unless(body.modality, "modality", "text", "only text is embedded here")
    return EmbedJob(
        model=body.model,
        texts=texts,
        token_ids=token_ids,
        options=_row_options(body, formats),
        response_format=formats,
        truncate_tokens=body.truncate_prompt_tokens,
        text_positions=text_positions(body.input, texts, token_ids),
        long_input=long_input(body.long_input),
    )


def _row_options(body: EmbeddingsRequest, formats: ResponseFormat) -> RowOptions:
    normalize = _one_switch(("normalize", body.normalize), ("use_activation", body.use_activation))
    normalize = _one_switch(("normalize", normalize), ("normalized", body.normalized))
    return RowOptions(body.dimensions, normalize, encoding=formats.encoding)


def _response_format(body: EmbeddingsRequest) -> ResponseFormat:
    name = _one_switch(("encoding_format", body.encoding_format), ("embedding_type", body.embedding_type))
    return response_format(name, body.embed_dtype, body.endianness)


def parse_openai(body: bytes, strict: bool = True) -> EmbedJob:
    """A text-form `/v1/embeddings` body's job, from its bytes, decoded as the route decodes it."""
    parsed = EMBEDDING_BODIES.decode(body, strict)
    if isinstance(parsed, ChatEmbeddingsRequest):
        raise ValueError("a chat-form body: its job is multimodal.chat_job's")
    return embed_job(parsed)


def _one_switch(first: tuple[str, T | None], second: tuple[str, T | None]) -> T | None:
    """One switch under two names (vLLM's `normalize` and `use_activation`; OpenAI's `encoding_format` and Jina's
    `embedding_type`): either given, or both alike."""
    if first[1] is not None and second[1] is not None and first[1] != second[1]:
        raise InvalidRequest(
            f"'{first[0]}' and '{second[0]}' are the same switch here; they disagree", "invalid_value", second[0]
        )
    return first[1] if first[1] is not None else second[1]


class Embedding(ResponseBody):
    index: Count
    embedding: Row
    object: Literal["embedding"] = "embedding"


class Usage(ResponseBody):
    prompt_tokens: Count
    total_tokens: Count


class EmbeddingUsage(Usage):
    completion_tokens: Literal[0] = 0  # vLLM's and Infinity's


class EmbeddingList(ResponseBody):
    id: Annotated[str, described("vLLM's and Infinity's: embd-...")]
    created: Annotated[Count, described("unix")]
    data: Annotated[list[Embedding], described("one per input, in order")]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


Task = Annotated[str, described(
    "sparse: a SPLADE model; multi_vector: a ColBERT model (per-token vectors)",
    enum=["embed", "score", "sparse", "multi_vector"],
)]  # fmt: skip
Sparse = Annotated[bool, described("whether /embed_sparse serves it (SPLADE, or bge-m3's sparse head)")]


class ModelStats(ResponseBody):
    """Infinity's `stats` object on each model of /models: what the gateway knows of its capacity."""

    healthy_replicas: Count
    max_batch_tokens: Count


class ModelCard(ResponseBody):
    """OpenAI's model object, plus what a client needs to use it: family, pooling, limit, width."""

    id: str
    created: int
    owned_by: str
    root: Annotated[str, described("the model's own name; id is one of its --served-model-name where given")]
    family: str
    task: Task
    sparse: Sparse
    architecture: str
    pooling: str
    normalize: bool
    dimension: Count
    max_input_length: Count
    dtype: str
    replicas: Annotated[Count, described("healthy replicas serving it")]
    stats: ModelStats
    object: Literal["model"] = "model"


class ModelList(ResponseBody):
    data: list[ModelCard]
    object: Literal["list"] = "list"


def openai_response(rows: np.ndarray, model: str, prompt_tokens: int, response_format: ResponseFormat) -> EmbeddingList:
    """rows: [N, elements] in the format's encoding, each answered as a list of numbers (orjson writes numpy rows
    itself) or as base64 of its bytes: little-endian float32 for plain base64, as OpenAI's clients decode. With
    vLLM's and Infinity's fields beside OpenAI's: the response's `id` and `created`, and `completion_tokens`."""
    embeddings = response_format.answer(rows)
    return EmbeddingList(
        id=f"embd-{uuid.uuid4().hex}",
        created=int(time.time()),
        data=[Embedding(i, row) for i, row in enumerate(embeddings)],
        model=model,
        usage=EmbeddingUsage(prompt_tokens, prompt_tokens),
    )


def model_card(service: Service, model: ServedModel, name: str | None = None) -> ModelCard:
    """The card of `model` under `name` (default: the model's id); `root` is the model's own name (vLLM's, for a
    served name)."""
    replicas = [r for r in service.pool.replicas if r.healthy and r.model is model]
    return ModelCard(
        id=name or model.id, created=0, owned_by="bouquet", root=model.name, family=model.family, task=model.task,
        sparse=bool(model.sparse_dimension), architecture=model.architecture, pooling=model.pooling,
        normalize=model.normalize, dimension=model.dimension, max_input_length=model.max_seq_length,
        dtype=model.dtype, replicas=len(replicas), stats=ModelStats(len(replicas), model.max_batch_tokens),
    )  # fmt: skip


async def _models(service: Service, request: Request) -> Response:
    cards = [model_card(service, model, name) for model in service.catalog.ordered for name in model.listed_names]
    return json_response(ModelList(cards))


async def _model(service: Service, request: Request) -> Response:
    name = request.path_params["model"]
    model = service.catalog.get(name)
    return json_response(model_card(service, model, name if name in model.listed_names else None))
