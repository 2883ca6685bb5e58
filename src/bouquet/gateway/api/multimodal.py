"""Image inputs in the bodies vLLM and Infinity take (the routes are OpenAI's, api/openai.py; the decoding and
preprocessing gateway/images.py):
- vLLM's chat form of `/v1/embeddings`: `messages`, each a `role` and a `content` that is a text or a list of
  parts, `{"type": "text", "text"}` or `{"type": "image_url", "image_url": {"url"}}`; one text or one image a
  request, as a CLIP or SigLIP model embeds each alone; for a model whose images enter its decoder (Qwen3-VL),
  one conversation: texts and images together, a system message its instruction (gateway/patch_embed.py); for a
  text model whose texts are conversations, one user message after an optional system message, its prompt
  (gateway/chat_text.py);
- Infinity's `/embeddings_image` (`input`: an image or a list of images), and its `/embeddings` with
  `"modality": "image"`;
- Jina's (jina-clip's) objects in `input` of `/v1/embeddings`: `{"text": ...}` or `{"image": ...}` each, beside
  plain texts, rows in input order in one space (gateway/mixed_inputs.py).
An image is a data URI (`data:image/png;base64,...`) or base64; a URL is refused unless on an origin the operator
lists (gateway/image_fetch.py). `/embeddings_image` also takes images as raw bytes (api/image_upload.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import msgspec
from msgspec import Meta

from bouquet.batch import RowOptions
from bouquet.encodings import ResponseFormat
from bouquet.gateway.api.fields import (
    Dimensions,
    EmbedDtype,
    EncodingFormat,
    Endianness,
    Model,
    Text,
    TokenIds,
    described,
    refuse_unless,
    response_format,
)
from bouquet.gateway.chat_text import Turn, user_text
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.http.decode import BodyDecoder, RequestBody
from bouquet.gateway.images import ImageEmbedJob
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.patch_embed import Conversation, ConversationJob, ImageInput, embed_conversations, embed_image_job
from bouquet.gateway.service import embedding_model

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service

Image = Annotated[
    str,
    Meta(
        min_length=1,
        description="a data URI (data:image/png;base64,...) or base64 of an image file; a URL only on an origin the "
        "server lists (--image-url-origin)",
    ),
]


class ImageUrl(msgspec.Struct, forbid_unknown_fields=True):
    url: Image
    detail: Annotated[str, described("OpenAI's; no effect on an embedding")] | None = None


class TextPart(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    text: Text


class ImagePart(msgspec.Struct, tag="image_url", tag_field="type", forbid_unknown_fields=True):
    image_url: ImageUrl


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Annotated[
        str,
        described(
            "user, as vLLM's examples send; any role is read alike, but a text model whose texts are conversations "
            "takes an optional system message (its prompt) and one user message"
        ),
    ]
    content: Text | Annotated[list[TextPart | ImagePart], Meta(min_length=1)]


class ChatEmbeddingsRequest(RequestBody):
    """vLLM's chat form of `/v1/embeddings` (a body with `messages`): one text or one image to embed, or for a model
    whose images enter its decoder (Qwen3-VL-Embedding) one input of texts and images, a system message its
    instruction; for a text model whose texts are conversations, a user message, a system message its prompt."""

    messages: Annotated[list[Message], Meta(min_length=1)]
    model: Model = None
    encoding_format: EncodingFormat = None
    dimensions: Dimensions = None
    user: str | None = None
    normalize: Annotated[bool, described("vLLM's; default: as the model's Normalize module says")] | None = None
    embed_dtype: EmbedDtype = None
    endianness: Endianness = None


class InputObject(msgspec.Struct, forbid_unknown_fields=True):
    """Jina's input object (jina-clip's API): a text or an image, exactly one of them."""

    text: Text | None = None
    image: Image | None = None


# OpenAI's `input` (fields.Input) with Jina's objects among its items.
EmbeddingsInput = Annotated[
    Text | Annotated[list[Text | int | TokenIds | InputObject], Meta(min_length=1)],
    described(
        "a text, a list of texts, a list of token ids, or a list of texts and lists of token ids; or texts and "
        'Jina\'s objects, {"text": ...} or {"image": ...} (a data URI, base64, or a URL on a listed origin); never '
        "empty. Token ids are refused with --no-token-id-input (400 token_ids_refused)."
    ),
]


def has_objects(value: str | list[Any]) -> bool:
    return not isinstance(value, str) and any(isinstance(item, InputObject) for item in value)


def object_inputs(value: list[Any]) -> list[Conversation]:
    """Texts and Jina's objects as inputs of one part each, an image named `input[i].image` in a refusal."""
    inputs = []
    for index, item in enumerate(value):
        name = f"input[{index}]"
        if isinstance(item, str):
            inputs.append(Conversation([item], name))
        elif not isinstance(item, InputObject):
            raise InvalidRequest(f"'{name}': token ids do not mix with Jina's objects", "invalid_type", name)
        elif (item.text is None) == (item.image is None):
            raise InvalidRequest(f"'{name}' must hold one of 'text' and 'image'", "invalid_value", name)
        else:
            part = item.text if item.text is not None else ImageInput(item.image or "", f"{name}.image")
            inputs.append(Conversation([part], name))
    return inputs


class ImageEmbeddingsRequest(RequestBody):
    """Infinity's `/embeddings_image`: images to embed, answered as OpenAI's embeddings."""

    input: Image | Annotated[list[Image], Meta(min_length=1)]
    model: Model = None
    encoding_format: EncodingFormat = None
    dimensions: Dimensions = None
    user: str | None = None
    modality: Annotated[Any, described("Infinity's", type="string", enum=["image", None], nullable=True)] = None


CHAT_EMBEDDINGS = BodyDecoder(ChatEmbeddingsRequest)
IMAGE_EMBEDDINGS = BodyDecoder(ImageEmbeddingsRequest)


def chat_job(body: ChatEmbeddingsRequest) -> ConversationJob:
    """vLLM's `messages` as one conversation: system messages' texts its instruction, the other messages' parts (texts
    and images, each named by its field's path) in order."""
    instruction: list[str] = []
    parts: list[str | ImageInput] = []
    turns = tuple(_turn(message, f"messages[{m}]") for m, message in enumerate(body.messages))
    for m, message in enumerate(body.messages):
        contents = [message.content] if isinstance(message.content, str) else message.content
        for p, part in enumerate(contents):
            if isinstance(part, ImagePart):
                parts.append(ImageInput(part.image_url.url, f"messages[{m}].content[{p}].image_url.url"))
            else:
                text = part if isinstance(part, str) else part.text
                (instruction if message.role == "system" else parts).append(text)
    formats = response_format(body.encoding_format, body.embed_dtype, body.endianness)
    options = RowOptions(body.dimensions, body.normalize, encoding=formats.encoding)
    conversation = Conversation(parts, "messages", "\n".join(instruction) if instruction else None)
    return ConversationJob(body.model, conversation, options, formats, turns)


def _turn(message: Message, name: str) -> Turn:
    """A message's role, texts and images' field paths, as a text model whose texts are conversations reads it."""
    contents = [message.content] if isinstance(message.content, str) else message.content
    texts = tuple(part if isinstance(part, str) else part.text for part in contents if not isinstance(part, ImagePart))
    images = tuple(f"{name}.content[{p}]" for p, part in enumerate(contents) if isinstance(part, ImagePart))
    return Turn(message.role, texts, images, name)


def text_job(job: ConversationJob, model: ServedModel) -> EmbedJob:
    """A text model's conversation (chat_text.py) as its user text, the system message's text its literal prompt."""
    text, prompt = user_text(job.turns, model.prompt(None))
    return EmbedJob(job.model, [text], None, job.options, prompt=prompt, response_format=job.response_format)


def single_input_job(job: ConversationJob) -> EmbedJob | ImageEmbedJob:
    """The one text or image of a conversation, for a model that embeds each alone (CLIP, SigLIP, text models)."""
    conversation = job.conversation
    texts = [part for part in conversation.parts if isinstance(part, str)]
    texts = [conversation.instruction, *texts] if conversation.instruction is not None else texts
    images = conversation.images
    if len(texts) + len(images) != 1:
        raise InvalidRequest(
            f"'messages' holds {len(texts)} texts and {len(images)} images; a request embeds one text or one image "
            "(an image and a text are embedded apart, in the same space)",
            "invalid_value",
            "messages",
        )
    if images:
        return ImageEmbedJob(job.model, [images[0].source], [images[0].name], job.options, job.response_format)
    return EmbedJob(job.model, texts, None, job.options, response_format=job.response_format)


async def embed_chat(service: Service, job: ConversationJob) -> tuple[ServedModel, Any, int]:
    """A conversation's row: one sequence of texts and images for a model whose images enter its decoder, else its
    one text or image."""
    model = embedding_model(service, job.model)
    if model.images is not None and model.images.patch_dim:
        rows, tokens, _ = await embed_conversations(service, model, [job.conversation], job.options)
        return model, rows, tokens
    if model.conversations:
        return await service.embed(text_job(job, model))
    single = single_input_job(job)
    if isinstance(single, ImageEmbedJob):
        return await embed_image_job(service, single)
    return await service.embed(single)


def image_job(body: ImageEmbeddingsRequest) -> ImageEmbedJob:
    """Infinity's `/embeddings_image` body as its images."""
    refuse_unless(body.modality, "modality", "image", "this route embeds images")
    formats = response_format(body.encoding_format, None, None)
    return images_job(body.model, body.input, RowOptions(body.dimensions, None, encoding=formats.encoding), formats)


def images_job(
    model: str | None, value: str | list[Any], options: RowOptions, formats: ResponseFormat
) -> ImageEmbedJob:
    """`input` as images (Infinity's `/embeddings_image`, or `/embeddings` with `"modality": "image"`): a string or
    a list of strings, each named `input[i]` in a refusal."""
    images = [value] if isinstance(value, str) else value
    for index, item in enumerate(images):
        if not isinstance(item, str):
            raise InvalidRequest(
                f"'input[{index}]' must be an image (a data URI or base64), not a list of token ids",
                "invalid_type",
                f"input[{index}]",
            )
    names = ["input"] if isinstance(value, str) else [f"input[{index}]" for index in range(len(images))]
    return ImageEmbedJob(model, images, names, options, formats)
