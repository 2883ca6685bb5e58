"""Zero-shot scores between the texts and images of one CLIP or SigLIP model: vLLM's /score with a side given as
its multimodal form, `{"content": [{"type": "image_url", "image_url": {"url"}}, {"type": "text", "text"}, ...]}`
(each part one item of that side).

A pair's score is the cosine of its two embeddings, which is what vLLM's /score gives for an embedding model
(CLIP and SigLIP included) and what sentence-transformers' `similarity` gives. Asked for its activation (vLLM's
`use_activation: true`), the model's zero-shot probability instead, as transformers' forward gives it: SigLIP's
sigmoid(exp(logit_scale) * cosine + logit_bias) (`logits_per_text.sigmoid()`), CLIP's softmax over each image's
texts of exp(logit_scale) * cosine (`logits_per_image.softmax(dim=1)`); asked for none (`use_activation: false`),
that logit itself. The scale and bias are the checkpoint's, from the replica's Info.

Each distinct text and image is embedded once, texts and images concurrently, as /v1/embeddings and
/embeddings_image embed them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from bouquet.gateway.errors import InvalidRequest
from bouquet.gateway.images import ImageEmbedJob, embed_images
from bouquet.gateway.jobs import EmbedJob

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service


@dataclass(frozen=True)
class Item:
    """One side of a pair: a text, or an image (a data URI or base64) with the name a refusal gives it."""

    text: str | None = None
    image: str | None = None
    name: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return ("text", self.text) if self.text is not None else ("image", self.image or "")


@dataclass(frozen=True)
class ZeroShotJob:
    model: str | None
    pairs: list[tuple[Item, Item]]
    activation: bool | None = None  # None: the cosine; True: the model's probability; False: its logit


async def zero_shot_scores(service: Service, job: ZeroShotJob) -> tuple[ServedModel, np.ndarray, int]:
    """One score per pair ([N] float32: the cosine, or the model's probability or logit as the job asks), the
    model, and the tokens its texts and images took."""
    if job.activation is not None:
        _check_logit(service.catalog.get(job.model), job)
    items = [item for pair in job.pairs for item in pair]
    texts = list(dict.fromkeys(item.text for item in items if item.text is not None))
    images = list(dict.fromkeys((item.image, item.name) for item in items if item.image is not None))
    image_job = ImageEmbedJob(job.model, [image for image, _ in images], [name for _, name in images])
    (text_model, text_rows, text_tokens), (image_model, image_rows, image_tokens) = await asyncio.gather(
        service.embed(EmbedJob(job.model, texts, None)) if texts else _nothing(),
        _image_rows(service, image_job) if images else _nothing(),
    )
    vectors = {("text", text): row for text, row in zip(texts, _unit(text_rows), strict=True)}
    vectors |= {("image", image): row for (image, _), row in zip(images, _unit(image_rows), strict=True)}
    cosines = np.array([np.dot(vectors[a.key], vectors[b.key]) for a, b in job.pairs], np.float64)
    model = text_model or image_model
    return model, _scored(cosines, job, model).astype(np.float32), text_tokens + image_tokens


def _check_logit(model: ServedModel, job: ZeroShotJob) -> None:
    """Before any work: the model has a zero-shot logit, and for CLIP's softmax each pair is a text and an image."""
    if model.logit_scale is None:
        raise InvalidRequest(
            f"the model {model.id!r} has no zero-shot logit (no logit_scale in its checkpoint): leave "
            "'use_activation' out for the cosine",
            "invalid_value",
            "use_activation",
        )
    if job.activation and model.logit_bias is None and any(_image_of(pair) is None for pair in job.pairs):
        raise InvalidRequest(
            "a CLIP probability is a softmax over an image's texts: every pair must be a text and an image",
            "invalid_value",
            "use_activation",
        )


def _scored(cosines: np.ndarray, job: ZeroShotJob, model: ServedModel) -> np.ndarray:  # [N] float64
    if job.activation is None:
        return cosines
    assert model.logit_scale is not None, "checked before the work"
    logits: np.ndarray = np.exp(model.logit_scale) * cosines + (model.logit_bias or 0.0)
    if not job.activation:
        return logits
    if model.logit_bias is not None:  # trained with the sigmoid loss (SigLIP): each pair on its own
        sigmoid: np.ndarray = 1 / (1 + np.exp(-logits))
        return sigmoid
    return _softmax_per_image(logits, [_image_of(pair) for pair in job.pairs])


def _image_of(pair: tuple[Item, Item]) -> str | None:
    """The image of a pair of a text and an image; None for two texts or two images."""
    first, second = pair
    if (first.image is None) == (second.image is None):
        return None
    return first.image if first.image is not None else second.image


def _softmax_per_image(logits: np.ndarray, images: list[str | None]) -> np.ndarray:
    """CLIP's zero-shot probabilities: a softmax over the logits of each image's pairs (its texts)."""
    probabilities = np.empty_like(logits)
    for image in set(images):
        where = np.array([key == image for key in images])
        exp = np.exp(logits[where] - logits[where].max())
        probabilities[where] = exp / exp.sum()
    return probabilities


async def _image_rows(service: Service, job: ImageEmbedJob) -> tuple[ServedModel, Any, int]:
    model, rows, tokens, _ = await embed_images(service, job)
    return model, rows, tokens


async def _nothing() -> tuple[Any, np.ndarray, int]:
    return None, np.zeros((0, 0), np.float32), 0


def _unit(rows: Any) -> np.ndarray:  # [N, D] float64, each row of length 1
    vectors: np.ndarray = np.asarray(rows, np.float64)
    lengths: np.ndarray = np.linalg.norm(vectors, axis=1, keepdims=True)
    unit: np.ndarray = vectors / np.maximum(lengths, 1e-12)
    return unit
