"""Qwen3-VL-Embedding served in bfloat16 and in int8 over real HTTP on loopback: a tiny random-weight Qwen3-VL
(saved by transformers with a Qwen-style tokenizer, its chat template and its image processor) behind the real
gateway, one replica of each dtype; conversations of texts and images of several sizes (vLLM's `messages`), images
alone (`/embeddings_image`), the real `cohere` SDK's `inputs` with image parts and Jina's objects, against
transformers' float32 Qwen3VLModel with Qwen3-VL-Embedding's pooling: bfloat16 cosine >= 0.999, int8 (every linear
of both towers in int8) >= 0.99."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import cohere
import httpx
import numpy as np
import pytest
from conftest import row_cosines
from in_process import engines, served
from qwen3_vl_models import images, png_uri, processor_rows, save_qwen3_vl_with_tokenizer
from st_image_checks import response_rows
from test_qwen3_vl_api import DEFAULT, _reference_conversation, _wire

from bouquet.engine.engine import Engine
from bouquet.layers.linear import Linear, QKVLinear

BOUNDS = {"bfloat16": 0.999, "int8": 0.99}
MODELS = {dtype: f"tiny-qwen3-vl-{dtype}" for dtype in BOUNDS}


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> tuple[Path, object, object]:
    root = tmp_path_factory.mktemp("qwen3-vl-dtypes")
    model, tokenizer = save_qwen3_vl_with_tokenizer(root / MODELS["bfloat16"])
    shutil.copytree(root / MODELS["bfloat16"], root / MODELS["int8"])
    return root, model, tokenizer


@pytest.fixture(scope="module")
def served_engines(qwen3_vl) -> Iterator[tuple[str, dict[str, Engine]]]:
    """The server's URL and its engines by dtype."""
    root = qwen3_vl[0]
    with (
        engines(root / MODELS["bfloat16"], dtype="bfloat16") as half,
        engines(root / MODELS["int8"], dtype="int8") as quantized,
        served([*half, *quantized], listen=True) as running,
    ):
        yield running.url, {"bfloat16": half[0], "int8": quantized[0]}


@pytest.fixture(scope="module")
def url(served_engines) -> str:
    return served_engines[0]


@pytest.fixture(scope="module")
def client(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as http:
        yield http


CAT, CHART, PAGE = images([(40, 24), (100, 33), (17, 90)], seed=4)
# (vLLM's messages, transformers' conversation): an image and a text with an instruction, an image alone, a text
# alone, two images of different sizes with a text between
CASES = [
    ([{"role": "system", "content": "Find the chart of revenue"}, {"role": "user", "content": _wire(CHART, "Q3")}],
     _reference_conversation("Find the chart of revenue.", CHART, "Q3")),
    ([{"role": "user", "content": _wire(CAT)}], _reference_conversation(DEFAULT, CAT)),
    ([{"role": "user", "content": "A photo of a cat on a red sofa."}],
     _reference_conversation(DEFAULT, "A photo of a cat on a red sofa.")),
    ([{"role": "user", "content": _wire(PAGE, "and", CAT)}], _reference_conversation(DEFAULT, PAGE, "and", CAT)),
]  # fmt: skip


@pytest.fixture(scope="module")
def expected(qwen3_vl) -> np.ndarray:
    _, model, tokenizer = qwen3_vl
    return processor_rows(model, tokenizer, [reference for _, reference in CASES])


def _assert_within(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    print(f"{dtype}: min cosine {cosines.min():.6f}")  # shown with -rP
    assert cosines.min() >= BOUNDS[dtype], f"{dtype}: cosines {np.round(cosines, 6)}"


def test_int8_quantizes_both_towers(served_engines) -> None:
    """Every linear of the vision tower (patch embedding, attention, MLP, mergers) and of the decoder runs in int8,
    but a QKV projection a CPU with saturating products keeps in float32."""
    model = served_engines[1]["int8"].model
    for tower in (model.visual, model.language_model):
        linears = [m for m in tower.modules() if isinstance(m, Linear)]
        assert linears and all(m.int8 is not None or isinstance(m, QKVLinear) for m in linears)
        assert any(m.int8 is not None for m in linears)


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_conversations_match_transformers_float32(client: httpx.Client, expected: np.ndarray, dtype: str) -> None:
    rows = np.concatenate(
        [response_rows(client.post("/v1/embeddings", json={"model": MODELS[dtype], "messages": m})) for m, _ in CASES]
    )
    _assert_within(rows, expected, dtype)


@pytest.mark.parametrize("dtype", list(BOUNDS))
def test_images_alone_match_transformers_float32(client: httpx.Client, qwen3_vl, dtype: str) -> None:
    _, model, tokenizer = qwen3_vl
    pictures = images([(64, 48), (300, 211)], seed=9)
    response = client.post("/embeddings_image", json={"model": MODELS[dtype], "input": [png_uri(p) for p in pictures]})
    reference = processor_rows(model, tokenizer, [_reference_conversation(DEFAULT, p) for p in pictures])
    _assert_within(response_rows(response), reference, dtype)


def test_coheres_inputs_are_conversations(url: str, client: httpx.Client, expected: np.ndarray) -> None:
    """Cohere v2's `inputs` through the real SDK: each input's texts and images one conversation, in the model's
    template with its default instruction, the rows of vLLM's `messages` for the same parts."""
    co = cohere.ClientV2(api_key="unused", base_url=url, timeout=120)
    inputs = [{"content": _wire(CAT)}, {"content": _wire(PAGE, "and", CAT)}]
    response = co.embed(model=MODELS["bfloat16"], inputs=inputs, input_type="search_document")  # type: ignore[arg-type]
    rows = np.array(response.embeddings.float_, np.float32)
    _assert_within(rows, expected[[1, 3]], "bfloat16")
    by_images = co.embed(model=MODELS["bfloat16"], images=[png_uri(CAT)], input_type="image")
    np.testing.assert_allclose(np.array(by_images.embeddings.float_, np.float32), rows[:1], atol=1e-6)


def test_jinas_objects_are_conversations_of_one_part(client: httpx.Client, expected: np.ndarray) -> None:
    """Jina's `{"image"}` and `{"text"}` objects in `input`: each one conversation in the model's template, the rows
    of vLLM's `messages` holding that one part."""
    inputs = [{"image": png_uri(CAT)}, {"text": "A photo of a cat on a red sofa."}]
    body = {"model": MODELS["bfloat16"], "input": inputs}
    _assert_within(response_rows(client.post("/v1/embeddings", json=body)), expected[[1, 2]], "bfloat16")
