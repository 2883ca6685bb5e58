"""SigLIP 2's image processor (transformers' Siglip2ImageProcessor, NaFlex) with Pillow and numpy, no torch, step for
step as its Pillow backend (Siglip2ImageProcessorPil, transformers' default where torchvision is absent) runs it, so
the patches are the same bits: an image keeps its aspect ratio, and each image is its own grid of patches. (Where
torchvision is installed transformers runs its torchvision backend, whose resize differs by a level or two of 255 on
a few pixels: docs/benchmarks.md.)

1. RGB as transformers makes it (pixel_steps.py; the model takes three channels whatever `do_convert_rgb` says);
2. the size: transformers' binary search for the largest scale at which both sides, each rounded up to a multiple
   of the patch size (at least one patch), make at most `max_num_patches` patches; resized with the config's
   Pillow filter;
3. rescale and normalise (pixel_steps.py);
4. patchify: [3, H, W] cut into p x p patches row by row, each flattened as (row, column, channel):
   [rows * columns, p * p * 3], with the grid (1, rows, columns). No padding to `max_num_patches`: an image is
   sequence of its own, as long as its patches (Batch.pack_image_sequences).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image

from bouquet.gateway.pixel_steps import RESAMPLE_FILTERS, rescale_normalize, to_rgb

_SEARCH_EPS = 1e-5  # transformers' get_image_size_for_max_num_patches's


@dataclass(frozen=True)
class NaflexProcessing:
    patch_size: int
    max_num_patches: int
    resample: int
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None

    @property
    def patch_dim(self) -> int:
        return 3 * self.patch_size**2

    def size(self, width: int, height: int) -> tuple[int, int]:
        """(height, width) in pixels after the resize: transformers' search, float for float."""
        low, high = _SEARCH_EPS / 10, 100.0
        while high - low >= _SEARCH_EPS:
            scale = (low + high) / 2
            rows, columns = self._scaled(height, scale), self._scaled(width, scale)
            if (rows / self.patch_size) * (columns / self.patch_size) <= self.max_num_patches:
                low = scale
            else:
                high = scale
        return self._scaled(height, low), self._scaled(width, low)

    def patches(self, width: int, height: int) -> int:
        """The patches an image of this size makes."""
        height, width = self.size(width, height)
        return (height // self.patch_size) * (width // self.patch_size)

    def _scaled(self, size: int, scale: float) -> int:
        return max(self.patch_size, math.ceil(size * scale / self.patch_size) * self.patch_size)

    def __call__(self, image: Image.Image) -> tuple[np.ndarray, tuple[int, int, int]]:
        """The image's patches [P, patch_dim] float32 and its grid (1, rows, columns)."""
        image = to_rgb(image)
        height, width = self.size(image.width, image.height)
        if (width, height) != image.size:
            image = image.resize((width, height), resample=Image.Resampling(self.resample))
        values = rescale_normalize(np.asarray(image).transpose(2, 0, 1), self.rescale, self.mean, self.std)
        p = self.patch_size
        rows, columns = height // p, width // p
        patches = values.reshape(3, rows, p, columns, p).transpose(1, 3, 2, 4, 0).reshape(rows * columns, -1)
        return np.ascontiguousarray(patches, np.float32), (1, rows, columns)


def parse_naflex_config(text: str) -> NaflexProcessing:
    """A SigLIP 2 preprocessor_config.json's text; ValueError naming what it cannot follow. Keys left out take
    transformers' defaults for Siglip2ImageProcessor."""
    config: dict[str, Any] = json.loads(text)
    if not config.get("do_resize", True):
        raise ValueError("do_resize false: images would keep sizes that are not multiples of the patch size")
    resample = int(config.get("resample", 2))  # bilinear, Siglip2ImageProcessor's
    if resample not in RESAMPLE_FILTERS:
        raise ValueError(f"resample {resample} is not one of Pillow's filters {RESAMPLE_FILTERS}")
    patch_size, max_num_patches = int(config.get("patch_size", 16)), int(config.get("max_num_patches", 256))
    if patch_size < 1 or max_num_patches < 1:
        raise ValueError(f"patch_size {patch_size} and max_num_patches {max_num_patches} must be positive")
    rescale = float(config.get("rescale_factor", 1 / 255)) if config.get("do_rescale", True) else None
    mean = std = None
    if config.get("do_normalize", True):
        mean, std = _per_channel(config.get("image_mean", 0.5)), _per_channel(config.get("image_std", 0.5))
    return NaflexProcessing(patch_size, max_num_patches, resample, rescale, mean, std)


def _per_channel(value: Any) -> tuple[float, ...]:
    values = [value] * 3 if isinstance(value, int | float) else list(value)
    if len(values) != 3:
        raise ValueError(f"image_mean and image_std take one value or three (RGB), not {value!r}")
    return tuple(float(v) for v in values)
