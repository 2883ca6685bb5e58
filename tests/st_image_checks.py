"""What the tests of image models saved by sentence-transformers share (test_clip_st_layouts.py,
test_siglip_st_layouts.py, test_siglip2_st_layouts.py): the images they send, reading a served answer's rows, the
issue's bounds against sentence-transformers' own rows, and (SigLIP and SigLIP 2, whose texts are padded) how its
padding compares and what the load says about it."""

from __future__ import annotations

import logging
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import row_cosines
from test_image_api import _file, _image

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

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


def assert_st_rows_where_padding_reaches_max_length(
    client: httpx.Client, reference: dict[str, np.ndarray], model: str, texts: list[str], long: str, dtype: str,
    pads_to_max_length: bool,
) -> None:  # fmt: skip
    """Beside a text of max_length tokens sentence-transformers pads every text to max_length, so each of its rows
    ("st batch") is what bouquet serves; so are its rows of the short texts alone ("st texts") when it was saved
    padding to max_length, and they are not when it pads to the batch's longest (what the load warning says)."""
    rows = response_rows(client.post("/v1/embeddings", json={"model": model, "input": [*texts, long]}))
    assert_close(rows, reference["st batch"], dtype)
    alone = row_cosines(rows[: len(texts)], reference["st texts"])
    if pads_to_max_length:
        assert_close(rows[: len(texts)], reference["st texts"], dtype)
    else:
        assert alone.max() < 0.99, f"sentence-transformers' rows of the short texts alone: cosines {alone}"


def assert_load_warnings(
    layouts: dict[str, Path], expected: dict[str, int], warning: str, named: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Loading each layout logs `warning` as often as `expected` says, naming the directory and `named`."""
    for name, count in expected.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bouquet"):
            Engine(EngineConfig(layouts[name], "cpu", "float32", cpu_warmup_tokens=0)).close()
        said = [record.getMessage() for record in caplog.records if warning in record.getMessage()]
        assert len(said) == count, (name, said)
        assert all(str(layouts[name]) in message and named in message for message in said)
