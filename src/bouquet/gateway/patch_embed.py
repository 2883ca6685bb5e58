"""Inputs of a model whose images enter its decoder (Qwen3-VL-Embedding; Info's image_patch_dim): each input is one
conversation, an instruction (a system message) and the user's parts (texts and images, in order), formatted by the
model's own chat template with the generation prompt added, as Qwen3-VL-Embedding's own embedder does; each image's
placeholder then repeated once per 2 x 2 block of its patches, as Qwen3VLProcessor does. A directory without a
template gets Qwen3-VL's output for these two messages:

    <|im_start|>system\\n{instruction}<|im_end|>\\n<|im_start|>user\\n{parts}<|im_end|>\\n<|im_start|>assistant\\n

an image's part being <|vision_start|><|image_pad|><|vision_end|>. The instruction is the request's system
message, else the model's default ("Represent the user's input."), with a full
stop added when it ends in no punctuation (the embedder's rule). Texts and images so formatted share one space;
the row is the last token's state (models/qwen3_vl.py). Images are decoded and preprocessed on the executor
(images.py's bounds, patch_images.py's steps), then the prompts are tokenized and sent with the images' patches.
"""

from __future__ import annotations

import asyncio
import math
import unicodedata
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.chat_templates import ChatTemplate, TemplateError
from bouquet.encodings import FORMATS, ResponseFormat
from bouquet.gateway.chat_text import Turn
from bouquet.gateway.errors import InvalidRequest, TooLarge
from bouquet.gateway.image_facts import ImageFacts
from bouquet.gateway.image_fetch import fetch_urls
from bouquet.gateway.images import (
    ImageEmbedJob,
    ImageLimits,
    embed_images,
    image_file,
    open_image,
)
from bouquet.gateway.jobs import AS_THE_MODEL, EmbedJob
from bouquet.gateway.service import complete_options, embedding_model
from bouquet.st_messages import StMessages

if TYPE_CHECKING:
    from bouquet.gateway.patch_images import PatchProcessing
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service

DEFAULT_INSTRUCTION = "Represent the user's input."
EMPTY_INPUT = "NULL"  # Qwen3-VL-Embedding's embedder's text for an input of no text or image
IMAGE_PAD, VISION_START, VISION_END = "<|image_pad|>", "<|vision_start|>", "<|vision_end|>"
TEMPLATE_TOKENS = 16  # the template's own tokens, at most: a bound for admission before tokenizing
# One request's patches, float32: a bound on its memory, and half gRPC's message limit (256 MiB) so that a chunk of
# them always fits a message. A config whose max_pixels allows larger images (16.7 million pixels make 400 MiB of
# patches) gets those refused, not cut down.
MAX_REQUEST_PATCH_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class ImageInput:
    source: str | bytes  # a data URI or base64 of an image file, its bytes, or a URL (image_fetch.py)
    name: str  # the field a refusal names (`messages[0].content[1].image_url.url`)


@dataclass(frozen=True)
class Conversation:
    """One input: the user's parts in order, texts and images, and the instruction (None: the model's default)."""

    parts: list[str | ImageInput]
    name: str  # the field a refusal of the whole input names
    instruction: str | None = None

    @property
    def images(self) -> list[ImageInput]:
        return [part for part in self.parts if isinstance(part, ImageInput)]


@dataclass(frozen=True)
class ConversationJob:
    """vLLM's chat form of /v1/embeddings as one conversation; a model that takes no patch images answers it as a
    text or an image job (api/multimodal.py)."""

    model: str | None
    conversation: Conversation
    options: RowOptions = AS_THE_MODEL
    response_format: ResponseFormat = FORMATS["float"]
    turns: tuple[Turn, ...] = ()  # the messages as sent, for a text model whose texts are conversations (chat_text.py)


def prompt(
    conversation: Conversation, image_tokens: list[int], template: ChatTemplate | None = None,
    st: StMessages | None = None,
) -> str:  # fmt: skip
    """The conversation as the model's chat template writes it (else as Qwen3-VL's does, below), each image's one
    placeholder then repeated for its tokens as Qwen3VLProcessor repeats it. By the embedder's rule (`st` None) a
    system message always and the generation prompt; by sentence-transformers' (`st`), the instruction word for word
    and no system message without one, the generation prompt as its config says."""
    system = _instruction(conversation.instruction) if st is None else conversation.instruction or ""
    generation = st is None or st.generation_prompt
    if template is None:
        return _builtin_prompt(conversation, image_tokens, system, generation)
    user = [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in _user_parts(conversation)]
    messages = [{"role": "system", "content": [{"type": "text", "text": system}]}] if system else []
    messages.append({"role": "user", "content": user})
    try:
        text = template.render(messages, generation)
    except TemplateError as error:
        raise InvalidRequest(f"{conversation.name}: {error}", "invalid_value", conversation.name) from None
    pieces = text.split(IMAGE_PAD)
    if len(pieces) != len(image_tokens) + 1:
        raise InvalidRequest(
            f"the model's chat template wrote {len(pieces) - 1} image placeholders for {len(image_tokens)} images",
            "invalid_value",
            conversation.name,
        )
    return pieces[0] + "".join(IMAGE_PAD * n + rest for n, rest in zip(image_tokens, pieces[1:], strict=True))


def _builtin_prompt(conversation: Conversation, image_tokens: list[int], system: str, generation: bool) -> str:
    """Qwen3-VL's chat template's output for a system (if any) and a user message, for a model directory without
    one."""
    counts = iter(image_tokens)
    content = "".join(
        part if isinstance(part, str) else VISION_START + IMAGE_PAD * next(counts) + VISION_END
        for part in _user_parts(conversation)
    )
    head = f"<|im_start|>system\n{system}<|im_end|>\n" if system else ""
    tail = "<|im_start|>assistant\n" if generation else ""
    return f"{head}<|im_start|>user\n{content}<|im_end|>\n{tail}"


def _user_parts(conversation: Conversation) -> list[str | ImageInput]:
    """The user's parts; "NULL" for a conversation of none (an instruction alone), as the embedder writes it."""
    return conversation.parts or [EMPTY_INPUT]


def _instruction(text: str | None) -> str:
    text = (text or "").strip() or DEFAULT_INSTRUCTION
    return text if unicodedata.category(text[-1]).startswith("P") else text + "."


async def embed_image_job(service: Service, job: ImageEmbedJob) -> tuple[ServedModel, Any, int]:
    """Images to embed each alone: in the model's template with its default instruction for a model whose images
    enter its decoder, else as images.py embeds them."""
    model = embedding_model(service, job.model)
    if model.images is None or not model.images.patch_dim:
        model, rows, tokens, _ = await embed_images(service, job)
        return model, rows, tokens
    inputs = zip(job.images, job.names, strict=True)
    conversations = [Conversation([ImageInput(source, name)], name) for source, name in inputs]
    rows, tokens, _ = await embed_conversations(service, model, conversations, job.options)
    return model, rows, tokens


def require_patches(model: ServedModel) -> PatchProcessing:
    assert model.images is not None and model.images.patch_dim, "asked of a model of patch images only"
    if model.images.patches is None:
        raise InvalidRequest(
            f"the model {model.id!r} takes images, but the gateway cannot preprocess them: {model.images.unusable}",
            "no_image_input",
            "model",
        )
    return model.images.patches


def load_patches(
    part: ImageInput, processing: PatchProcessing, limits: ImageLimits
) -> tuple[tuple[np.ndarray, tuple[int, int, int]], ImageFacts]:
    """One image's patches and grid, and its facts, on the executor."""
    image, facts = open_image(image_file(part.source, part.name, limits.max_bytes), part.name, limits)
    try:
        return processing(image), facts
    except ValueError as error:  # smart_resize's refusal of an extreme aspect ratio
        raise InvalidRequest(f"{part.name}: {error}", "invalid_image", part.name) from None


async def embed_conversations(
    service: Service, model: ServedModel, conversations: list[Conversation], options: RowOptions,
    prompt_name: str | None = None,
) -> tuple[Any, int, list[ImageFacts]]:  # fmt: skip
    """Rows [N, elements] of the conversations in the options' encoding, the tokens they took, and the facts of
    their images in order. A model saved by sentence-transformers takes `prompt_name`'s prompt (else its default)
    as the instruction of a conversation without one."""
    processing = require_patches(model)
    st = model.images.st_messages if model.images is not None else None
    if st is not None:
        default = model.prompt(prompt_name)
        conversations = [c if c.instruction is not None else replace(c, instruction=default) for c in conversations]
    images = [part for conversation in conversations for part in conversation.images]
    service.check_inputs(len(conversations))
    _check_patch_bytes(len(images), processing)
    options = complete_options(options, model)
    limits = ImageLimits(service.config.max_image_bytes, service.config.max_image_pixels)
    tokenizer = model.require_tokenizer()
    loop = asyncio.get_running_loop()
    facts: list[ImageFacts] = []

    async def batch() -> Batch:
        opened = await asyncio.gather(
            *(loop.run_in_executor(service.executor, load_patches, part, processing, limits) for part in fetched)
        )
        facts.extend(item for _, item in opened)
        loaded = [patches for patches, _ in opened]
        counts = iter(math.prod(grid) // processing.merge_size**2 for _, grid in loaded)
        template = model.images.chat_template if model.images is not None else None
        prompts = [prompt(c, [next(counts) for _ in c.images], template, st) for c in conversations]
        *sequences, pad = await tokenizer.encode_text_only([*prompts, IMAGE_PAD])
        _check_sequences(sequences, conversations, pad, model.max_seq_length)
        packed = Batch.pack(sequences, options)
        if not images:
            return packed
        _check_loaded_bytes(sum(patches.nbytes for patches, _ in loaded))
        patches = np.concatenate([patches for patches, _ in loaded])
        grids = np.array([grid for _, grid in loaded], np.int32)
        return packed.with_patch_images(patches, grids, [len(c.images) for c in conversations])

    estimate = sum(_token_bound(c, processing) for c in conversations)
    service.check_tokens(estimate)
    sources = await fetch_urls(
        service.config, [part.source for part in images], [part.name for part in images], service.metrics
    )
    fetched = [ImageInput(source, part.name) for source, part in zip(sources, images, strict=True)]
    work = estimate + len(images) * (processing.max_pixels // processing.patch_size**2)  # the vision tower's patches
    rows, tokens = await service.compute(model, work, batch)
    return rows, tokens, facts


async def embed_texts(service: Service, job: EmbedJob, model: ServedModel) -> tuple[Any, int]:
    """A text job for a model saved by sentence-transformers whose inputs are conversations: each text one, its
    prompt (`prompt_name`'s, else the default) the system message, as sentence-transformers' encode() writes a
    text; rows in the job's encoding and the tokens they took. A text over the model's limit is refused, not cut."""
    assert job.texts is not None, "texts are formatted, token ids are not"
    conversations = [Conversation([text], f"input[{index}]") for index, text in enumerate(job.texts)]
    rows, tokens, _ = await embed_conversations(service, model, conversations, job.options, job.prompt_name)
    return rows, tokens


def _check_sequences(sequences: list[list[int]], conversations: list[Conversation], pad: list[int], limit: int) -> None:
    """Every prompt within the model's limit (an image's tokens are never cut), the placeholder one token."""
    if len(pad) != 1:
        raise InvalidRequest(f"the model's tokenizer has no {IMAGE_PAD} token: it cannot take images", "no_image_input")
    for sequence, conversation in zip(sequences, conversations, strict=True):
        if len(sequence) > limit:
            raise InvalidRequest(
                f"{conversation.name} makes {len(sequence)} tokens with its images, over the model's limit of {limit}",
                "context_length_exceeded",
                conversation.name,
            )


def _token_bound(conversation: Conversation, processing: PatchProcessing) -> int:
    """At most the tokens the conversation makes: a text's bytes, an image's at the largest size."""
    per_image = processing.max_pixels // (processing.patch_size * processing.merge_size) ** 2 + 2
    texts = sum(len(part.encode()) for part in conversation.parts if isinstance(part, str))
    return (
        TEMPLATE_TOKENS
        + len((conversation.instruction or DEFAULT_INSTRUCTION).encode())
        + texts
        + per_image * len(conversation.images)
    )


def _check_loaded_bytes(total: int) -> None:
    if total > MAX_REQUEST_PATCH_BYTES:
        raise TooLarge(
            f"the images make {total >> 20} MiB of patches, over the limit of {MAX_REQUEST_PATCH_BYTES >> 20} MiB a "
            "request: send fewer or smaller images",
            "payload_too_large",
        )


def _check_patch_bytes(count: int, processing: PatchProcessing) -> None:
    """Before any decoding: a count of images that could not fit even at the smallest size the config allows."""
    per_image = 4 * processing.patch_dim * max(1, processing.min_pixels // processing.patch_size**2)
    limit = max(1, MAX_REQUEST_PATCH_BYTES // per_image)
    if count > limit:
        raise TooLarge(f"{count} images, over the limit of {limit} a request for this model", "too_many_inputs")
