"""Image inputs: each a data URI (`data:image/png;base64,...`) or plain base64 of an image file, or its raw bytes
(a body of its own or a multipart upload: api/image_upload.py), or a URL on an origin the operator lists (fetched by
image_fetch.py), decoded and
preprocessed as the model's processor does (image_processing.py; naflex_images.py for SigLIP 2) on the gateway's
executor, never on the event loop, then sent to a replica as float32 pixels (Batch.pack_images), or as patches each
image a sequence of its own (Batch.pack_image_sequences), and embedded like texts (`Service.compute`).

Unless the operator lists origins to fetch from (--image-url-origin), nothing is fetched: a URL is refused
(server-side request forgery), whatever its scheme. Before any decoding an
input is bounded in bytes (base64's length says them) and then in pixels (Pillow reads the header first; a PNG that
claims 100,000 x 100,000 pixels is refused before a byte of it is inflated); only common raster formats are opened
(Pillow's EPS, for one, would run Ghostscript). Every refusal is a 400 naming the input (`input[2]`)."""

from __future__ import annotations

import asyncio
import binascii
import io
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from bouquet.batch import Batch, RowOptions
from bouquet.encodings import FORMATS, ResponseFormat
from bouquet.gateway.errors import InvalidRequest, TooLarge
from bouquet.gateway.image_facts import ImageFacts, image_facts
from bouquet.gateway.image_fetch import fetch_urls
from bouquet.gateway.image_processing import ImageProcessing, ModelImages
from bouquet.gateway.jobs import AS_THE_MODEL
from bouquet.gateway.naflex_images import NaflexProcessing
from bouquet.gateway.service import complete_options, embedding_model

if TYPE_CHECKING:
    from bouquet.gateway.replicas.catalog import ServedModel
    from bouquet.gateway.service import Service

IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")  # what Pillow opens here; any other is unknown
URL_SCHEMES = ("http://", "https://", "ftp://", "file:", "s3://", "gs://")
MAX_REQUEST_PIXEL_BYTES = 256 * 1024 * 1024  # one request's preprocessed pixels, float32: a bound on its memory


@dataclass(frozen=True)
class ImageEmbedJob:
    """Images to embed, each a data URI or base64 of an image file, its raw bytes, or a URL, with the name a refusal
    gives it (`input[2]`, `messages[0].content[1].image_url.url`); a job as jobs.py's are, beside the code that runs
    it."""

    model: str | None
    images: list[str | bytes]
    names: list[str]
    options: RowOptions = AS_THE_MODEL  # as EmbedJob's; `encoding` is response_format's
    response_format: ResponseFormat = FORMATS["float"]


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int  # of an image's file
    max_pixels: int  # width x height, from its header
    max_patches: int = 0  # SigLIP 2's patches an image, as its replicas take them (ModelImages); 0: no bound


def image_file(source: str | bytes, name: str, max_bytes: int) -> bytes:
    """An input's image file: its bytes as sent (or fetched), the base64 of a data URI, or plain base64; a URL or
    anything else is refused, and so is a file over `max_bytes`, before its base64 is decoded."""
    if isinstance(source, bytes):
        if len(source) > max_bytes:
            raise InvalidRequest(
                f"{name} is an image of {len(source)} bytes, over the limit of {max_bytes}", "image_too_large", name
            )
        return source
    head = source[:16].lower()
    if head.startswith(URL_SCHEMES):
        raise InvalidRequest(
            f"{name} is a URL; this server fetches nothing (unless its operator lists origins: "
            "--image-url-origin): send the image inline, as a data URI (data:image/png;base64,...), base64 or its "
            "bytes",
            "image_url_refused",
            name,
        )
    payload = source
    if head.startswith("data:"):
        header, comma, payload = source.partition(",")
        if not comma or not header.lower().endswith(";base64"):
            raise InvalidRequest(
                f"{name} is a data URI without base64 (data:image/png;base64,...)", "invalid_image", name
            )
    if len(payload) // 4 * 3 > max_bytes:
        raise InvalidRequest(
            f"{name} is an image of about {len(payload) // 4 * 3} bytes, over the limit of {max_bytes}",
            "image_too_large",
            name,
        )
    try:
        return binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(
            f"{name} is neither a data URI (data:image/png;base64,...) nor base64", "invalid_image", name
        ) from None


def open_image(data: bytes, name: str, limits: ImageLimits) -> tuple[Image.Image, ImageFacts]:
    """The decoded image (its first frame), after its header has been read and its pixels counted; and its facts
    (size, format and depth, as its file has them)."""
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise InvalidRequest(
            f"{name} is not an image in a format read here ({', '.join(IMAGE_FORMATS)})", "unknown_image_format", name
        ) from None
    except Image.DecompressionBombError:
        raise _too_many_pixels(name, None, limits.max_pixels) from None
    except Exception as error:  # any failure to read a client's header is its file's fault
        raise InvalidRequest(f"{name} is not a readable image: {error}", "invalid_image", name) from None
    if image.width * image.height > limits.max_pixels:
        raise _too_many_pixels(name, image.size, limits.max_pixels)
    try:
        image.load()
        return ImageOps.exif_transpose(image), image_facts(image)  # turned as transformers' load_image turns it
    except Exception as error:  # truncated data, a corrupt stream: Pillow raises many kinds
        raise InvalidRequest(f"{name} is a corrupt {image.format} image: {error}", "invalid_image", name) from None


def _too_many_pixels(name: str, size: tuple[int, int] | None, limit: int) -> InvalidRequest:
    what = f"{size[0]} x {size[1]} pixels" if size is not None else "an image of too many pixels"
    return InvalidRequest(f"{name} is {what}, over the limit of {limit} pixels", "image_too_large", name)


Processing = ImageProcessing | NaflexProcessing
Pixels = np.ndarray | tuple[np.ndarray, tuple[int, int, int]]  # [C, H, W], or SigLIP 2's patches and grid


def load_pixels(
    source: str | bytes, name: str, processing: Processing, limits: ImageLimits
) -> tuple[Pixels, ImageFacts]:
    """One input to the model's pixels [C, H, W] float32 (or its patches and grid), and its facts: on the executor
    (decoding and resizing hold the GIL little, and never the event loop)."""
    image, facts = open_image(image_file(source, name, limits.max_bytes), name, limits)
    if isinstance(processing, NaflexProcessing) and limits.max_patches:
        _check_patches(processing.patches(image.width, image.height), name, limits.max_patches)
    return processing(image), facts


def _check_patches(patches: int, name: str, limit: int) -> None:
    """Before the resize: the replica would refuse the image, and the whole request with it."""
    if patches > limit:
        raise InvalidRequest(
            f"{name} makes {patches} patches at this model's max_num_patches, over the limit of {limit} an image",
            "image_too_large",
            name,
        )


def pack(loaded: list[Pixels], images: ModelImages, options: RowOptions) -> Batch:
    """The images as the model takes them: one fixed-size image a sequence, or SigLIP 2's patches, each image a
    sequence as long as its own."""
    if isinstance(images.processing, NaflexProcessing):
        patches = [item for item in loaded if isinstance(item, tuple)]
        grids = np.array([grid for _, grid in patches], np.int32).reshape(-1, 3)
        return Batch.pack_image_sequences(np.concatenate([values for values, _ in patches]), grids, options)
    return Batch.pack_images(
        np.stack([item for item in loaded if isinstance(item, np.ndarray)]), images.tokens, options
    )


def require_images(model: ServedModel) -> tuple[ModelImages, Processing]:
    if model.images is None:
        raise InvalidRequest(f"the model {model.id!r} takes no images; it embeds text", "no_image_input", "model")
    if model.images.patch_dim:  # its images enter its decoder, in its template (patch_embed.py)
        raise InvalidRequest(
            f"the model {model.id!r} embeds images in its chat template: send them to /v1/embeddings (messages) "
            "or /embeddings_image",
            "no_image_input",
            "model",
        )
    if model.images.processing is None:
        raise InvalidRequest(
            f"the model {model.id!r} takes images, but the gateway cannot preprocess them: {model.images.unusable}",
            "no_image_input",
            "model",
        )
    return model.images, model.images.processing


async def embed_images(service: Service, job: ImageEmbedJob) -> tuple[ServedModel, Any, int, list[ImageFacts]]:
    """Rows [N, elements] of the job's images in its response format's encoding, the tokens they took (an
    image's, as its model lays it out), and each image's facts."""
    model = embedding_model(service, job.model)
    images, processing = require_images(model)
    service.check_inputs(len(job.images))
    _check_pixel_bytes(len(job.images), images)
    options = complete_options(job.options, model)
    limits = ImageLimits(service.config.max_image_bytes, service.config.max_image_pixels, images.max_patches)
    loop = asyncio.get_running_loop()
    facts: list[ImageFacts] = []

    async def batch() -> Batch:
        loaded = await asyncio.gather(
            *(
                loop.run_in_executor(service.executor, load_pixels, source, name, processing, limits)
                for source, name in zip(sources, job.names, strict=True)
            )
        )
        facts.extend(item for _, item in loaded)
        return pack([pixels for pixels, _ in loaded], images, options)

    # Exact, or SigLIP 2's most patches an image (its processor resizes each image to nearly that many): never an
    # estimate from bytes, which admission would scale by what it learned of texts.
    estimate = len(job.images) * images.tokens
    service.check_tokens(estimate)
    sources = await fetch_urls(
        service.config, job.images, job.names, service.metrics
    )  # before admission: a slow server holds none
    rows, tokens = await service.compute(model, estimate, batch, exact=True)
    return model, rows, tokens, facts


def _check_pixel_bytes(count: int, images: ModelImages) -> None:
    limit = max(1, MAX_REQUEST_PIXEL_BYTES // images.max_image_bytes)
    if count > limit:
        raise TooLarge(f"{count} images, over the limit of {limit} a request for this model", "too_many_inputs")
