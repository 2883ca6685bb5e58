"""Qwen3-VL-Embedding over real HTTP on loopback: a tiny random-weight Qwen3-VL (saved by transformers with a
Qwen-style tokenizer, its chat template, and its image processor) behind the real gateway and a real replica.
vLLM's `messages` form of `/v1/embeddings` (texts and images in one conversation, a system message its
instruction) and Infinity's `/embeddings_image` (each image alone, the default instruction) against transformers'
chat template, image processor and Qwen3VLModel with Qwen3-VL-Embedding's pooling (float32, cosine >= 0.99999);
text and image rows come from one template, so they share one space; images of sizes other than the processor's;
bad inputs a 400 naming the field, the server answering after."""

from __future__ import annotations

import base64
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from conftest import row_cosines
from in_process import engines, served
from PIL import Image
from qwen3_vl_models import CHAT_TEMPLATE, images, png_uri, processor_rows, save_qwen3_vl_with_tokenizer
from st_image_checks import response_rows

BOUND = 0.99999
DEFAULT = "Represent the user's input."
MODEL = "tiny-qwen3-vl"


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory) -> tuple[Path, object, object]:
    path = tmp_path_factory.mktemp("qwen3-vl-api") / "tiny-qwen3-vl"
    model, tokenizer = save_qwen3_vl_with_tokenizer(path)
    return path, model, tokenizer


# The same model with another chat template: a thinking block after the generation prompt (as Qwen3's templates
# write with thinking off), and a refusal of its own.
THINKING_TEMPLATE = CHAT_TEMPLATE.replace(
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
).replace(
    "{% elif part['type'] == 'text' %}",
    "{% elif part['type'] == 'text' %}{% if part['text'] == 'forbidden.' %}"
    "{{ raise_exception('System message cannot be forbidden.') }}{% endif %}",
)


@pytest.fixture(scope="module")
def thinking(qwen3_vl) -> Path:
    path = qwen3_vl[0].parent / "tiny-qwen3-vl-thinking"
    shutil.copytree(qwen3_vl[0], path)
    (path / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def client(qwen3_vl, thinking: Path) -> Iterator[httpx.Client]:
    with (
        engines(qwen3_vl[0], thinking) as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as http,
    ):
        yield http


def _user(*parts: str | Image.Image) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image", "image": p} for p in parts]


def _wire(*parts: str | Image.Image) -> list[dict]:
    return [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": png_uri(p)}}
        for p in parts
    ]


def _reference_conversation(instruction: str, *parts: str | Image.Image) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": instruction}]},
        {"role": "user", "content": _user(*parts)},
    ]


def test_conversations_match_transformers(client: httpx.Client, qwen3_vl) -> None:
    """An image with a text and the request's own instruction (a full stop added, as Qwen3-VL-Embedding's embedder
    adds it), an image alone, a text alone, two images of different sizes with a text between, and an instruction
    alone (the embedder's "NULL" input)."""
    _, model, tokenizer = qwen3_vl
    cat, chart, page = images([(40, 24), (100, 33), (17, 90)], seed=4)
    cases = [
        ([{"role": "system", "content": "Find the chart of revenue"}, {"role": "user", "content": _wire(chart, "Q3")}],
         _reference_conversation("Find the chart of revenue.", chart, "Q3")),
        ([{"role": "user", "content": _wire(cat)}], _reference_conversation(DEFAULT, cat)),
        ([{"role": "user", "content": "A photo of a cat on a red sofa."}],
         _reference_conversation(DEFAULT, "A photo of a cat on a red sofa.")),
        ([{"role": "user", "content": _wire(page, "and", cat)}], _reference_conversation(DEFAULT, page, "and", cat)),
        ([{"role": "system", "content": "Find it."}], _reference_conversation("Find it.", "NULL")),  # the embedder's
    ]  # fmt: skip
    rows = np.concatenate(
        [response_rows(client.post("/v1/embeddings", json={"model": MODEL, "messages": m})) for m, _ in cases]
    )
    expected = processor_rows(model, tokenizer, [reference for _, reference in cases])
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, cosines
    np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, rtol=1e-5)  # normalised, as the embedder's
    # One space: the text's row against the image's is transformers' text row against its image row.
    assert abs(float(rows[2] @ rows[1]) - float(expected[2] @ expected[1])) < 1e-4


def test_infinity_image_route_embeds_each_image_alone(client: httpx.Client, qwen3_vl) -> None:
    _, model, tokenizer = qwen3_vl
    pictures = images([(64, 48), (17, 90), (300, 211)], seed=9)
    response = client.post("/embeddings_image", json={"model": MODEL, "input": [png_uri(p) for p in pictures]})
    expected = processor_rows(model, tokenizer, [_reference_conversation(DEFAULT, p) for p in pictures])
    cosines = row_cosines(response_rows(response), expected)
    assert cosines.min() >= BOUND, cosines
    assert response.json()["usage"]["prompt_tokens"] > 3 * 20  # the images' tokens counted with the template's


def test_dimensions_and_base64_apply(client: httpx.Client) -> None:
    picture = png_uri(images([(40, 24)])[0])
    full = response_rows(client.post("/embeddings_image", json={"model": MODEL, "input": [picture]}))
    cut = client.post(
        "/embeddings_image", json={"model": MODEL, "input": [picture], "dimensions": 16, "encoding_format": "base64"}
    )
    assert cut.status_code == 200, cut.text
    values = np.frombuffer(base64.b64decode(cut.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(values, full[0, :16] / np.linalg.norm(full[0, :16]), rtol=1e-4, atol=1e-6)


def test_the_models_own_chat_template_formats_the_inputs(client: httpx.Client, qwen3_vl) -> None:
    """A directory's chat_template.jinja is the one followed (transformers' rendering), not a format of the
    gateway's; a template's own refusal is a 400 naming the input."""
    _, model, tokenizer = qwen3_vl
    cat = images([(64, 48)], seed=6)[0]
    body = {"model": "tiny-qwen3-vl-thinking", "messages": [{"role": "user", "content": _wire(cat, "a cat")}]}
    rows = response_rows(client.post("/v1/embeddings", json=body))
    tokenizer.chat_template = THINKING_TEMPLATE
    try:
        expected = processor_rows(model, tokenizer, [_reference_conversation(DEFAULT, cat, "a cat")])
    finally:
        tokenizer.chat_template = CHAT_TEMPLATE
    assert row_cosines(rows, expected).min() >= BOUND
    plain = response_rows(client.post("/v1/embeddings", json={**body, "model": MODEL}))
    assert row_cosines(rows, plain).max() < 0.999  # the thinking block moved the last token's state
    refused = {"model": "tiny-qwen3-vl-thinking", "messages": [{"role": "system", "content": "forbidden"}]}
    response = client.post("/v1/embeddings", json=refused)
    assert response.status_code == 400, response.text
    assert "System message cannot be forbidden" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("content", "code", "field"),
    [
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}], "image_url_refused",
         "messages[0].content[0].image_url.url"),
        ([{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}], "unknown_image_format",
         "messages[0].content[0].image_url.url"),
        ([{"type": "image_url", "image_url": {"url": png_uri(images([(1, 300)])[0])}}], "invalid_image",
         "messages[0].content[0].image_url.url"),  # an aspect ratio over 200: transformers' smart_resize refuses it
        ([{"type": "text", "text": "the lazy dog " * 300}], "context_length_exceeded", "messages"),
    ],
)  # fmt: skip
def test_bad_inputs_are_400_naming_the_field(client: httpx.Client, content: list, code: str, field: str) -> None:
    response = client.post("/v1/embeddings", json={"model": MODEL, "messages": [{"role": "user", "content": content}]})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, field), error
    assert (
        client.post(
            "/v1/embeddings", json={"model": MODEL, "messages": [{"role": "user", "content": "ok"}]}
        ).status_code
        == 200
    )


def test_zero_shot_scores_are_refused_saying_where_images_go(client: httpx.Client) -> None:
    """/score's texts take no template: a text against an image would compare rows of two formats."""
    image = {"type": "image_url", "image_url": {"url": png_uri(images([(40, 24)])[0])}}
    body = {"model": MODEL, "text_1": "a cat", "text_2": {"content": [image]}}
    response = client.post("/score", json=body)
    assert response.status_code == 400, response.text
    assert "embeds images in its chat template" in response.text


def test_a_request_over_the_patch_bytes_is_413(client: httpx.Client, monkeypatch) -> None:
    """Counted exactly once the images are decoded: their patches, not their files, are what the replica receives."""
    from bouquet.gateway import patch_embed

    pictures = images([(64, 48), (100, 33)], seed=2)
    monkeypatch.setattr(patch_embed, "MAX_REQUEST_PATCH_BYTES", 100_000)
    response = client.post("/embeddings_image", json={"model": MODEL, "input": [png_uri(p) for p in pictures]})
    assert response.status_code == 413, response.text
    assert response.json()["error"]["code"] == "payload_too_large"
    monkeypatch.undo()
    assert client.post("/embeddings_image", json={"model": MODEL, "input": [png_uri(pictures[0])]}).status_code == 200
