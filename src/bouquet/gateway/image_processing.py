"""A model's image processor, as its preprocessor_config.json says, with Pillow and numpy (no torch): transformers'
CLIPImageProcessor (resize the shortest edge, then crop the centre) and SiglipImageProcessor (resize to a size,
no crop), step for step as transformers' Pillow backend runs them, so the pixels are the same bits:

1. RGB: an image with alpha (or a palette's transparency) composited onto white, any other mode converted;
2. resize with Pillow's filter the config names (`resample`), to `size`: `shortest_edge` keeps the aspect ratio
   (the long edge `int(edge * long / short)`), `height`/`width` is that size exactly;
3. centre crop to `crop_size` (top and left `(size - crop) // 2`, zeros around an image smaller than the crop);
4. rescale in float64 then float32 (`rescale_factor`, 1/255), then normalise in float32 ((x - mean) / std).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import jinja2
import numpy as np
from PIL import Image

from bouquet.chat_templates import ChatTemplate
from bouquet.gateway.naflex_images import NaflexProcessing, parse_naflex_config
from bouquet.gateway.patch_images import PatchProcessing, parse_patch_config
from bouquet.gateway.pixel_steps import RESAMPLE_FILTERS, rescale_normalize, to_rgb
from bouquet.st_messages import StMessages


@dataclass(frozen=True)
class ImageProcessing:
    """What to do to an RGB image before the model sees it; `shape` is the (C, H, W) it comes out as."""

    shortest_edge: int | None  # resize keeping the aspect ratio; else `size`
    size: tuple[int, int] | None  # (height, width) to resize to; None with shortest_edge None: no resize
    resample: int  # Pillow's filter
    crop: tuple[int, int] | None  # (height, width) of the centre crop; None: none
    rescale: float | None  # the factor on the 0-255 values; None: none
    mean: tuple[float, ...] | None  # per channel; None: no normalisation
    std: tuple[float, ...] | None

    def __post_init__(self) -> None:
        if self.crop is None and self.size is None:  # a resize of the shortest edge alone leaves sizes varying
            raise ValueError("images of varying sizes: the config resizes no image to a fixed size and crops none")

    @property
    def shape(self) -> tuple[int, int, int]:
        """(C, H, W) of every processed image."""
        height_width = self.crop or self.size
        assert height_width is not None  # __post_init__
        return (3, *height_width)

    def __call__(self, image: Image.Image) -> np.ndarray:  # [3, H, W] float32
        image = to_rgb(image)
        target = self._resized_size(image.width, image.height)
        if target is not None and target != (image.height, image.width):
            image = image.resize((target[1], target[0]), resample=Image.Resampling(self.resample))
        pixels = np.asarray(image).transpose(2, 0, 1)  # [3, H, W] uint8
        if self.crop is not None:
            pixels = center_crop(pixels, self.crop)
        return rescale_normalize(pixels, self.rescale, self.mean, self.std)

    def _resized_size(self, width: int, height: int) -> tuple[int, int] | None:
        """(height, width) after the resize, or None when the config does not resize."""
        if self.shortest_edge is None:
            return self.size
        short, long = (width, height) if width <= height else (height, width)
        new_long = int(self.shortest_edge * long / short)
        return (new_long, self.shortest_edge) if width <= height else (self.shortest_edge, new_long)


def center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """pixels [C, H, W] cut to crop's (height, width) about the centre; zeros around an image smaller than it."""
    channels, height, width = pixels.shape
    crop_height, crop_width = crop
    if height < crop_height or width < crop_width:  # padded as transformers pads: centred, rounding up at the top
        padded = np.zeros((channels, max(height, crop_height), max(width, crop_width)), pixels.dtype)
        top, left = -(-(padded.shape[1] - height) // 2), -(-(padded.shape[2] - width) // 2)
        padded[:, top : top + height, left : left + width] = pixels
        pixels, height, width = padded, padded.shape[1], padded.shape[2]
    top, left = (height - crop_height) // 2, (width - crop_width) // 2
    return pixels[:, top : top + crop_height, left : left + crop_width]


def parse_processor_config(text: str) -> ImageProcessing:
    """preprocessor_config.json's text as an ImageProcessing; ValueError naming what it cannot follow. Keys left out
    take transformers' defaults for the processor (old CLIP configs leave out the rescale: 1/255)."""
    config: dict[str, Any] = json.loads(text)
    kind = str(config.get("image_processor_type") or config.get("feature_extractor_type") or "")
    clip_like = kind.startswith("CLIP")  # an int `size` is CLIP's shortest edge, SigLIP's square
    shortest_edge, size = _size(config, clip_like) if config.get("do_resize", True) else (None, None)
    crop = _crop(config) if config.get("do_center_crop", "crop_size" in config) else None
    resample = int(config.get("resample", 3))  # bicubic, CLIP's and SigLIP's
    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample {resample} is not one of Pillow's filters {RESAMPLE_FILTERS}")
    rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None
    mean = std = None
    if config.get("do_normalize", True):
        mean, std = _per_channel(config, "image_mean"), _per_channel(config, "image_std")
    return ImageProcessing(shortest_edge, size, resample, crop, rescale, mean, std)


def _size(config: dict[str, Any], clip_like: bool) -> tuple[int | None, tuple[int, int] | None]:
    size = config.get("size")
    if isinstance(size, int):
        return (size, None) if clip_like else (None, (size, size))
    if not isinstance(size, dict):
        raise ValueError(f"size {size!r}: expected {{'shortest_edge'}} or {{'height', 'width'}}")
    if set(size) == {"shortest_edge"}:
        return int(size["shortest_edge"]), None
    if set(size) == {"height", "width"}:
        return None, (int(size["height"]), int(size["width"]))
    raise ValueError(f"size {size!r}: only {{'shortest_edge'}} or {{'height', 'width'}} are followed")


def _crop(config: dict[str, Any]) -> tuple[int, int]:
    crop = config.get("crop_size")
    if isinstance(crop, int):
        return crop, crop
    if isinstance(crop, dict) and set(crop) == {"height", "width"}:
        return int(crop["height"]), int(crop["width"])
    raise ValueError(f"crop_size {crop!r}: expected an int or {{'height', 'width'}}")


def _per_channel(config: dict[str, Any], key: str) -> tuple[float, ...]:
    if key not in config:
        raise ValueError(f"do_normalize without {key!r}")
    value = config[key]
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ValueError(f"{key} {value!r}: one value or three (RGB)")
    return tuple(float(v) for v in values)


@dataclass(frozen=True)
class ModelImages:
    """What a model that takes images takes, from its replica's Info: the tokens one image counts for, its (C, H, W),
    and how to preprocess one; `processing` None when the gateway cannot (`unusable` says why). A model whose
    images are sequences of their own, each of its own size (SigLIP 2), has a NaflexProcessing, `tokens` the most
    patches one makes and no shape. A model that takes images of any size inside token sequences (Qwen3-VL) has
    `patch_dim` and `patches` instead."""

    tokens: int
    shape: tuple[int, ...]
    processing: ImageProcessing | NaflexProcessing | None
    unusable: str = ""
    patch_dim: int = 0  # the values of one patch; 0: fixed-size images (tokens and shape)
    patches: PatchProcessing | None = None  # set with patch_dim when the gateway can preprocess them
    chat_template: ChatTemplate | None = None  # a conversation model's own; None: patch_embed.py's format
    st_messages: StMessages | None = None  # a conversation model saved by sentence-transformers: its formatting
    max_patches: int = 0  # SigLIP 2's: the most patches an image may make, its replicas' bound (Info); 0: none

    @property
    def usable(self) -> bool:
        return (self.patches if self.patch_dim else self.processing) is not None

    @property
    def max_image_bytes(self) -> int:
        """An image's float32 values at most, preprocessed."""
        if isinstance(self.processing, NaflexProcessing):
            return 4 * self.tokens * self.processing.patch_dim
        return 4 * int(np.prod(self.shape))


def model_images(
    shape: tuple[int, ...], tokens: int, processor_json: str, patch_dim: int = 0, chat_template: str = "",
    image_sequences: bool = False, max_patches: int = 0, st_messages: StMessages | None = None,
) -> ModelImages | None:  # fmt: skip
    """A model's images (None: it takes none), preprocessed as its preprocessor_config.json says; a config the
    gateway cannot follow, or one whose images are not the shape the model takes, leaves images unusable."""
    if not tokens and not patch_dim:
        return None
    if not processor_json:
        patch_dim = 0 if image_sequences else patch_dim  # its images are embedded each alone, as CLIP's are
        why = "its model directory has no preprocessor_config.json (nor a processor_config.json holding one)"
        return ModelImages(tokens, shape, None, why, patch_dim)
    if image_sequences:
        return _image_sequences(processor_json, patch_dim, max_patches)
    if patch_dim:
        return _patch_images(processor_json, patch_dim, chat_template, st_messages)
    try:
        processing = parse_processor_config(processor_json)
    except (ValueError, TypeError, KeyError) as error:  # json's errors are ValueErrors
        return ModelImages(tokens, shape, None, f"its preprocessor_config.json cannot be followed: {error}")
    if processing.shape != shape:
        why = f"its preprocessor_config.json makes images of shape {list(processing.shape)}, not {list(shape)}"
        return ModelImages(tokens, shape, None, why)
    return ModelImages(tokens, shape, processing)


def _image_sequences(processor_json: str, patch_dim: int, max_patches: int) -> ModelImages:
    """SigLIP 2's: each image embedded alone, a sequence of at most `max_num_patches` tokens, and at most the
    replicas' `max_patches` (an image over it is refused: images.py), whichever is fewer."""
    try:
        processing = parse_naflex_config(processor_json)
    except (ValueError, TypeError, KeyError) as error:
        return ModelImages(0, (), None, f"its preprocessor_config.json cannot be followed: {error}")
    if processing.patch_dim != patch_dim:
        why = f"its preprocessor_config.json makes patches of {processing.patch_dim} values, not {patch_dim}"
        return ModelImages(0, (), None, why)
    most = min(processing.max_num_patches, max_patches or processing.max_num_patches)
    return ModelImages(most, (), processing, max_patches=max_patches)


def _patch_images(
    processor_json: str, patch_dim: int, chat_template: str, st_messages: StMessages | None
) -> ModelImages:
    try:
        patches = parse_patch_config(processor_json)
        template = ChatTemplate(chat_template) if chat_template else None
    except (ValueError, TypeError, KeyError, jinja2.TemplateError) as error:
        return ModelImages(0, (), None, f"its preprocessor_config.json cannot be followed: {error}", patch_dim)
    if patches.patch_dim != patch_dim:
        why = f"its preprocessor_config.json makes patches of {patches.patch_dim} values, not {patch_dim}"
        return ModelImages(0, (), None, why, patch_dim)
    return ModelImages(0, (), None, "", patch_dim, patches, template, st_messages)
