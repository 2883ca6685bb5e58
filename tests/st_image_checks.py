"""What the tests of image models saved by sentence-transformers share (test_clip_st_layouts.py,
test_siglip_st_layouts.py, test_siglip2_st_layouts.py): the images they send, reading a served answer's rows, and the
issue's bounds against sentence-transformers' own rows."""

from __future__ import annotations

import httpx
import numpy as np
from conftest import row_cosines
from test_image_api import _file, _image

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
SIZES = [(50, 80), (300, 120), (17, 9), (64, 64)]  # (width, height); the processors' size is 32 x 32


def image_files() -> list[bytes]:
    """PNG images of sizes other than the processor's, and a JPEG."""
    files = [_file(_image(width, height, seed)) for seed, (width, height) in enumerate(SIZES)]
    return [*files, _file(_image(90, 61, 8), "JPEG")]


def response_rows(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], np.float32)


def assert_close(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUNDS[dtype], f"cosines {np.round(cosines, 7)}"
    if dtype == "float32":  # raw rows, as sentence-transformers gives them without a Normalize module
        np.testing.assert_allclose(np.linalg.norm(rows, axis=1), np.linalg.norm(expected, axis=1), rtol=1e-4)
