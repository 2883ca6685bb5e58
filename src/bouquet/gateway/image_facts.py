"""What an answer may say of each image it embedded: Cohere's v2 embed answers list them (`images`: width, height,
format, bit_depth; an RGB JPEG of 400 x 400 pixels is `{"width": 400, "height": 400, "format": "jpeg",
"bit_depth": 24}` in Cohere's API reference). Read off the image as it is opened (images.py), before any turn by
its EXIF orientation or resize: the file's own size and format."""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image, ImageMode


@dataclass(frozen=True)
class ImageFacts:
    width: int  # in pixels, as the file stores it
    height: int
    format: str  # Pillow's name for it, lower case: "jpeg", "png", "webp", "gif", "bmp", "tiff"
    bit_depth: int  # the bits of one decoded pixel, all channels: 24 RGB, 32 RGBA, 8 grey or a palette, 1 bilevel


def image_facts(image: Image.Image) -> ImageFacts:
    """The facts of an opened image (its header read; `format` is lost on any copy, so before one is made)."""
    mode = ImageMode.getmode(image.mode)
    kind, size = mode.typestr[-2], int(mode.typestr[-1])  # numpy's: "|u1" a byte, "<u2" two, "|b1" a bit
    bits = 1 if kind == "b" else 8 * size
    return ImageFacts(image.width, image.height, (image.format or "").lower(), bits * len(mode.bands))
