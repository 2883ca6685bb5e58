"""Qwen3-VL's image processor (transformers' Qwen2VLImageProcessor, Pillow backend) with Pillow and numpy, no
torch: an image keeps (about) its own size, so each image is its own grid of patches and its own token count.

1. RGB as transformers makes it (pixel_steps.py);
2. `smart_resize`: both sides rounded to a multiple of patch x merge (the factor), then scaled (keeping the aspect
   ratio) into [min_pixels, max_pixels] (`size`'s shortest_edge and longest_edge, which count pixels), resized with
   the config's Pillow filter;
3. rescale and normalise (pixel_steps.py);
4. patchify: the [3, H, W] pixels cut into p x p patches, ordered merge x merge block by block (row by row), each
   patch repeated over the temporal patch (a still image is two equal frames) and flattened as (channel, frame,
   row, column): [rows * columns, 3 * temporal * p * p], with the grid (1, rows, columns) in patches.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from bouquet.gateway.pixel_steps import RESAMPLE_FILTERS, rescale_normalize, to_rgb

MAX_ASPECT_RATIO = 200  # transformers' smart_resize refuses a longer side over 200 times the shorter


@dataclass(frozen=True)
class PatchProcessing:
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    min_pixels: int
    max_pixels: int
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @property
    def patch_dim(self) -> int:
        return 3 * self.temporal_patch_size * self.patch_size**2

    def grid(self, width: int, height: int) -> tuple[int, int, int]:
        """(1, rows, columns) in patches of an image of this size: its token count, before any pixel is read."""
        resized_height, resized_width = smart_resize(height, width, self.patch_size * self.merge_size,
                                                     self.min_pixels, self.max_pixels)  # fmt: skip
        return 1, resized_height // self.patch_size, resized_width // self.patch_size

    def tokens(self, width: int, height: int) -> int:
        """The placeholder tokens an image of this size takes in a prompt: one per merge x merge block."""
        return math.prod(self.grid(width, height)) // self.merge_size**2

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The image's patches [P, patch_dim] float32 and its grid (1, rows, columns)."""
        image = to_rgb(image)
        _, rows, columns = self.grid(image.width, image.height)
        size = (columns * self.patch_size, rows * self.patch_size)
        if size != image.size:
            image = image.resize(size, resample=Image.Resampling(self.resample))
        values = rescale_normalize(np.asarray(image).transpose(2, 0, 1), self.rescale, self.mean, self.std)
        return self._patchify(values), (1, rows, columns)

    def _patchify(self, values: np.ndarray) -> np.ndarray:  # [3, H, W] -> [P, patch_dim]
        p, m, frames = self.patch_size, self.merge_size, self.temporal_patch_size
        channels, height, width = values.shape
        rows, columns = height // p, width // p
        blocks = values.reshape(channels, rows // m, m, p, columns // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
        repeated = np.broadcast_to(blocks[:, :, :, :, :, None], (*blocks.shape[:5], frames, p, p))
        return np.ascontiguousarray(repeated.reshape(rows * columns, self.patch_dim), np.float32)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(height, width) each a multiple of `factor`, their product within [min_pixels, max_pixels], the aspect ratio
    kept as closely as that allows: transformers' rule, float for float."""
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"an aspect ratio over {MAX_ASPECT_RATIO}: {width} x {height} pixels")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar, w_bar = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def parse_patch_config(text: str) -> PatchProcessing:
    """A Qwen2-VL / Qwen3-VL preprocessor_config.json's text; ValueError naming what it cannot follow. Keys left out
    take transformers' defaults for Qwen2VLImageProcessor."""
    config: dict[str, Any] = json.loads(text)
    if not config.get("do_resize", True):
        raise ValueError("do_resize false: images would keep sizes that are not multiples of the patch grid")
    size = config.get("size") or {}
    min_pixels = int(config.get("min_pixels") or size.get("shortest_edge") or 56 * 56)
    max_pixels = int(config.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280)
    resample = int(config.get("resample", 3))
    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample {resample} is not one of Pillow's filters {RESAMPLE_FILTERS}")
    rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None
    mean = std = None
    if config.get("do_normalize", True):
        clip_mean, clip_std = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
        mean = tuple(float(v) for v in config.get("image_mean", clip_mean))
        std = tuple(float(v) for v in config.get("image_std", clip_std))
    return PatchProcessing(
        patch_size=int(config.get("patch_size", 14)), merge_size=int(config.get("merge_size", 2)),
        temporal_patch_size=int(config.get("temporal_patch_size", 2)), min_pixels=min_pixels, max_pixels=max_pixels,
        resample=resample, rescale=rescale, mean=mean, std=std,
    )  # fmt: skip
