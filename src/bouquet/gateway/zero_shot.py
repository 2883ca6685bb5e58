"""Zero-shot scores between the texts and images of one CLIP or SigLIP model: vLLM's /score with a side given as
its multimodal form, `{"content": [{"type": "image_url", "image_url": {"url"}}, {"type": "text", "text"}, ...]}`
(each part one item of that side).

A pair's score is the cosine of its two embeddings, which is what vLLM's /score gives for an embedding model
(CLIP and SigLIP included) and what sentence-transformers' `similarity` gives. transformers' `logits_per_image`
is that cosine times the model's exp(logit_scale) (100 for a trained CLIP), and CLIP's zero-shot probabilities a
softmax of those over the labels; SigLIP's probability is sigmoid(exp(logit_scale) * cosine + logit_bias). The
scale and bias are the model's, which the gateway is not told, so a client applies them (docs: README's /score).

Each distinct text and image is embedded once, texts and images concurrently, as /v1/embeddings and
/embeddings_image embed them."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

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


async def zero_shot_scores(service: Service, job: ZeroShotJob) -> tuple[ServedModel, np.ndarray, int]:
    """One cosine per pair ([N] float32), the model, and the tokens its texts and images took."""
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
    scores = [float(np.dot(vectors[a.key], vectors[b.key])) for a, b in job.pairs]
    return text_model or image_model, np.asarray(scores, np.float32), text_tokens + image_tokens


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
