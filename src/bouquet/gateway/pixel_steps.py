"""The steps transformers' Pillow image processors share, for image_processing.py (CLIP, SigLIP) and
patch_images.py (Qwen3-VL): RGB conversion, and rescaling then normalisation in their exact float order."""

from __future__ import annotations

import numpy as np
from PIL import Image

RESAMPLE_FILTERS = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}  # Pillow's
WHITE = (255, 255, 255, 255)


def rescale_normalize(
    pixels: np.ndarray, rescale: float | None, mean: tuple[float, ...] | None, std: tuple[float, ...] | None
) -> np.ndarray:  # [3, H, W] float32
    """uint8 pixels [3, H, W] rescaled in float64 then float32, then normalised in float32 ((x - mean) / std), as
    transformers' Pillow backend does."""
    values = pixels.astype(np.float32)
    if rescale is not None:
        values = (pixels.astype(np.float64) * rescale).astype(np.float32)
    if mean is not None and std is not None:
        values = (values - np.array(mean, np.float32)[:, None, None]) / np.array(std, np.float32)[:, None, None]
    return np.ascontiguousarray(values, np.float32)


def to_rgb(image: Image.Image) -> Image.Image:
    """transformers' convert_to_rgb: transparency composited onto white, anything else converted."""
    if image.mode == "RGB":
        return image
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, WHITE), rgba).convert("RGB")
    return image.convert("RGB")
