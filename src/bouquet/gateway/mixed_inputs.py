"""Inputs of which each is a text or an image, embedded into one space with the rows in input order: Cohere v2's
`inputs` and `images` (api/cohere.py), Jina's `{"text"}` / `{"image"}` objects in `input` (api/openai.py).

A model that embeds a text or an image alone (CLIP, SigLIP) gets the texts as one text job (the request's prompt
and truncation apply) and the images as one image job, run together, their rows put back in input order; an input
holding both a text and an image is refused, as such a model has no row for the two together. A model whose images
enter its decoder (Qwen3-VL-Embedding) gets every input as one conversation of its parts, in its chat template
(patch_embed.py), so that its texts share the images' space. A text model answers a request with any image
400 `no_image_input`, before any work is done."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from bouquet.encodings import ResponseFormat
from bouquet.gateway.chunking import all_or_none
from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.image_facts import ImageFacts
from bouquet.gateway.images import ImageEmbedJob, embed_images, require_images
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.patch_embed import Conversation, ImageInput, embed_conversations
from bouquet.gateway.service import embedding_model

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service


_Rows = tuple[np.ndarray, int, list[ImageFacts]]  # a group's rows, its tokens, and its images' facts


@dataclass(frozen=True)
class MixedJob:
    """Each input's parts (texts and images, in order; a refusal names the input by its conversation's name) and
    the text job its texts are embedded by (its options, prompt, truncation and response format are the job's;
    its `texts` are filled here)."""

    inputs: list[Conversation]
    text_job: EmbedJob

    @property
    def model(self) -> str | None:
        return self.text_job.model

    @property
    def response_format(self) -> ResponseFormat:
        return self.text_job.response_format


async def embed_mixed(service: Service, job: MixedJob) -> tuple[ServedModel, Any, int, list[ImageFacts]]:
    """Rows [N, elements] of the inputs, in order, in the job's encoding; the tokens they took; and the facts of
    the images among them, in order."""
    model = embedding_model(service, job.model)
    if model.images is not None and model.images.patch_dim:
        options, prompt_name = job.text_job.options, job.text_job.prompt_name
        rows, tokens, facts = await embed_conversations(service, model, job.inputs, options, prompt_name)
        return model, rows, tokens, facts
    parts = [_one_part(conversation) for conversation in job.inputs]
    images = [(index, part) for index, part in enumerate(parts) if isinstance(part, ImageInput)]
    texts = [(index, part) for index, part in enumerate(parts) if isinstance(part, str)]
    if not images:
        model, rows, tokens = await service.embed(replace(job.text_job, texts=[text for _, text in texts]))
        return model, rows, tokens, []
    require_images(model)
    groups = [([i for i, _ in images], _image_rows(service, job, [image for _, image in images]))]
    if texts:
        groups.append(([i for i, _ in texts], _text_rows(service, job, [text for _, text in texts])))
    results = await all_or_none([call for _, call in groups])
    places = [(indices, rows) for (indices, _), (rows, _, _) in zip(groups, results, strict=True)]
    facts = results[0][2]  # the images' group's
    return model, _in_order(len(parts), places), sum(tokens for _, tokens, _ in results), facts


def _one_part(conversation: Conversation) -> str | ImageInput:
    if len(conversation.parts) != 1:
        texts = sum(isinstance(part, str) for part in conversation.parts)
        raise InvalidRequest(
            f"'{conversation.name}' holds {texts} texts and {len(conversation.images)} images; this model embeds a "
            "text or an image alone (each in the same space): send them as inputs of their own",
            "invalid_value",
            conversation.name,
        )
    return conversation.parts[0]


async def _image_rows(service: Service, job: MixedJob, images: list[ImageInput]) -> _Rows:
    image_job = ImageEmbedJob(
        job.model,
        [image.source for image in images],
        [image.name for image in images],
        job.text_job.options,
        job.response_format,
    )
    _, rows, tokens, facts = await embed_images(service, image_job)
    return rows, tokens, facts


async def _text_rows(service: Service, job: MixedJob, texts: list[str]) -> _Rows:
    _, rows, tokens = await service.embed(replace(job.text_job, texts=texts))
    return rows, tokens, []


def _in_order(count: int, groups: list[tuple[list[int], np.ndarray]]) -> np.ndarray:
    """Each group's rows put at its inputs' places."""
    first = groups[0][1]
    rows = np.empty((count, *first.shape[1:]), first.dtype)
    for places, group_rows in groups:
        rows[places] = group_rows
    return rows
