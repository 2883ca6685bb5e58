"""The gateway's Qwen3-VL preprocessing (gateway/patch_images.py, no torch) against transformers' own
Qwen2VLImageProcessorPil, the Pillow backend Qwen3-VL's processor uses: the same patches, bit for bit, and the same
grids, for images smaller than min_pixels, larger than max_pixels, of odd sizes and of other modes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from qwen3_vl_models import image_processor, images

from bouquet.gateway.patch_images import parse_patch_config, smart_resize

SIZES = [(40, 24), (64, 48), (17, 90), (100, 33), (8, 8), (300, 211), (1, 150), (513, 7)]


@pytest.fixture(scope="module")
def config_text(tmp_path_factory) -> str:
    path: Path = tmp_path_factory.mktemp("qwen3-vl-processor")
    image_processor().save_pretrained(path)
    return (path / "preprocessor_config.json").read_text()


def _reference(picture: Image.Image) -> tuple[np.ndarray, tuple[int, ...]]:
    from transformers import Qwen2VLImageProcessorPil

    processor = image_processor()
    assert isinstance(processor, Qwen2VLImageProcessorPil)
    out = processor(images=[picture], return_tensors="np")
    return np.asarray(out["pixel_values"]), tuple(int(v) for v in out["image_grid_thw"][0])


@pytest.mark.parametrize("size", SIZES)
def test_patches_and_grids_are_transformers_bit_for_bit(config_text: str, size: tuple[int, int]) -> None:
    processing = parse_patch_config(config_text)
    picture = images([size], seed=sum(size))[0]
    patches, grid = processing(picture)
    expected, expected_grid = _reference(picture)
    assert grid == expected_grid and processing.grid(*size) == grid
    assert patches.dtype == np.float32 and patches.shape == expected.shape
    np.testing.assert_array_equal(patches, expected)
    assert processing.tokens(*size) == int(np.prod(grid)) // 4


@pytest.mark.parametrize("mode", ["RGBA", "L", "P", "LA"])
def test_other_modes_are_converted_as_transformers_converts_them(config_text: str, mode: str) -> None:
    rgba = images([(50, 30)], seed=7)[0].convert("RGBA")
    alpha = np.asarray(rgba).copy()
    alpha[..., 3] = np.linspace(0, 255, alpha.shape[1], dtype=np.uint8)[None, :]
    picture = Image.fromarray(alpha, "RGBA").convert(mode)
    patches, _ = parse_patch_config(config_text)(picture)
    np.testing.assert_array_equal(patches, _reference(picture)[0])


def test_smart_resize_is_transformers_rule() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as reference

    for height, width in [(24, 40), (600, 3), (7, 7), (4000, 3000), (33, 100), (16, 16)]:
        assert smart_resize(height, width, 32, 4096, 1_843_200) == reference(height, width, 32, 4096, 1_843_200)
    with pytest.raises(ValueError, match="aspect ratio over 200"):
        smart_resize(1, 201, 32, 4096, 1_843_200)


def test_defaults_and_refusals() -> None:
    defaults = parse_patch_config(json.dumps({"image_processor_type": "Qwen2VLImageProcessor"}))
    assert (defaults.patch_size, defaults.merge_size, defaults.min_pixels) == (14, 2, 56 * 56)
    with pytest.raises(ValueError, match="do_resize"):
        parse_patch_config(json.dumps({"do_resize": False}))
    with pytest.raises(ValueError, match="Pillow's filters"):
        parse_patch_config(json.dumps({"resample": 9}))
