"""SigLIP 2 (NaFlex) over real HTTP on loopback: a tiny random-weight Siglip2Model saved by transformers with its own
image processor's config (max_num_patches 48, patch 8, its mean and std: not the defaults) behind the real gateway.
Images of several sizes and aspect ratios in one request on Infinity's `/embeddings_image` (data URIs, base64 and a
multipart upload) and vLLM's `messages` form of `/v1/embeddings`, against transformers' own processor and
`get_image_features` (float32, cosine >= 0.99999; served in bfloat16, >= 0.999); the usage is each image's
patches; a text and an image in one space, as transformers' forward scores them (`/score`); the gateway's
preprocessing bit for bit against transformers' Siglip2ImageProcessorPil (the default processor where torchvision
is absent, as here)."""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import row_cosines
from in_process import api, engines, served
from prometheus_client.parser import text_string_to_metric_families
from siglip2_models import (
    MAX_NUM_PATCHES,
    PAD_ID,
    image,
    image_features,
    png,
    processed,
    processor,
    save_siglip2,
    text_features,
)

from bouquet.gateway.image_processing import model_images
from bouquet.gateway.naflex_images import NaflexProcessing, parse_naflex_config
from bouquet.models.siglip2 import MAX_IMAGE_PATCHES

BOUND = 0.99999
BOUND_BFLOAT16 = 0.999
SIZES = [(50, 80), (300, 120), (32, 32), (17, 9), (9, 300), (1000, 3)]  # (width, height)
NAME = "tiny-siglip2"


@pytest.fixture(scope="module")
def model(tmp_path_factory, minilm_path: Path) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("siglip2-api") / NAME
    return path, save_siglip2(path, minilm_path)


@pytest.fixture(scope="module")
def server(model) -> Iterator[httpx.Client]:
    with (
        engines(model[0]) as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client


def _rows(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], np.float32)


def _data_uri(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"


def test_images_of_every_size_match_transformers_and_count_their_patches(server: httpx.Client, model) -> None:
    pictures = [image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    _, grids, inputs = processed(model[0], pictures)
    expected = image_features(model[1], inputs)
    files = [png(picture) for picture in pictures]
    inputs_sent = [
        _data_uri(data) if index % 2 else base64.b64encode(data).decode() for index, data in enumerate(files)
    ]
    answer = server.post("/embeddings_image", json={"model": NAME, "input": inputs_sent})
    rows = _rows(answer)
    assert row_cosines(rows, expected).min() >= BOUND, row_cosines(rows, expected)
    assert answer.json()["usage"]["prompt_tokens"] == int(grids.prod(1).sum())  # each image's patches
    uploaded = server.post("/embeddings_image", params={"model": NAME}, files=[("file", ("a.png", files[3]))])
    np.testing.assert_allclose(_rows(uploaded), rows[3:4], atol=1e-6)
    content = [{"type": "image_url", "image_url": {"url": _data_uri(files[1])}}]
    chat = server.post("/v1/embeddings", json={"model": NAME, "messages": [{"role": "user", "content": content}]})
    np.testing.assert_allclose(_rows(chat), rows[1:2], atol=1e-6)


def test_a_text_and_an_image_share_the_models_space(server: httpx.Client, model) -> None:
    """The text on /v1/embeddings (padded as Siglip2Processor pads it), the image on /embeddings_image, both in one
    request as Jina's objects, and /score between them: transformers' rows and the cosine its forward gives
    (logits_per_text with the scale and bias taken off)."""
    path, reference = model
    text, picture = "a photo of a small cat", image(120, 90, 3)
    text_row = _rows(server.post("/v1/embeddings", json={"model": NAME, "input": text}))
    ids = [token["id"] for token in server.post("/tokenize", json={"model": NAME, "inputs": text}).json()[0]]
    _, _, inputs = processed(path, [picture])
    with torch.no_grad():
        padded = torch.tensor([[*ids, *[PAD_ID] * (64 - len(ids))]])  # as Siglip2Processor pads it, with its mask
        mask = (padded != PAD_ID).long()
        logits = reference(input_ids=padded, attention_mask=mask, **inputs).logits_per_text[0, 0]
        cosine = float((logits - reference.logit_bias) / reference.logit_scale.exp())
    assert row_cosines(text_row, text_features(reference, [ids])).min() >= BOUND
    data_uri = _data_uri(png(picture))
    image_row = _rows(server.post("/embeddings_image", json={"model": NAME, "input": data_uri}))
    assert abs(float(row_cosines(text_row, image_row)[0]) - cosine) < 1e-5
    jina = server.post("/v1/embeddings", json={"model": NAME, "input": [{"image": data_uri}, {"text": text}]})
    np.testing.assert_allclose(_rows(jina), np.concatenate([image_row, text_row]), atol=1e-6)  # one request, in order
    content = {"content": [{"type": "image_url", "image_url": {"url": data_uri}}]}
    score = server.post("/score", json={"model": NAME, "text_1": text, "text_2": content})
    assert score.status_code == 200, score.text
    assert abs(score.json()["data"][0]["score"] - cosine) < 2e-5
    probability = server.post("/score", json={"model": NAME, "text_1": text, "text_2": content, "use_activation": True})
    assert abs(probability.json()["data"][0]["score"] - float(logits.sigmoid())) < 1e-5, probability.text


def test_bfloat16_serves_images_and_texts_near_transformers_float32(model) -> None:
    """The model served in bfloat16 over real HTTP: its images of every size and a text against transformers'
    float32 rows (cosine >= 0.999)."""
    path, reference = model
    pictures = [image(w, h, seed) for seed, (w, h) in enumerate(SIZES)]
    expected = image_features(reference, processed(path, pictures)[2])
    inputs = [_data_uri(png(picture)) for picture in pictures]
    text = "two dogs playing in the snow"
    with (
        engines(path, dtype="bfloat16") as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        rows = _rows(client.post("/embeddings_image", json={"model": NAME, "input": inputs}))
        text_row = _rows(client.post("/v1/embeddings", json={"model": NAME, "input": text}))
        ids = [token["id"] for token in client.post("/tokenize", json={"model": NAME, "inputs": text}).json()[0]]
    assert row_cosines(rows, expected).min() >= BOUND_BFLOAT16, row_cosines(rows, expected)
    assert row_cosines(text_row, text_features(reference, [ids])).min() >= BOUND_BFLOAT16


def test_a_bad_image_among_good_ones_is_a_400_naming_it(server: httpx.Client) -> None:
    good = _data_uri(png(image(40, 30, 1)))
    answer = server.post("/embeddings_image", json={"model": NAME, "input": [good, _data_uri(b"\x89PNG garbage")]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "input[1]", answer.text
    assert server.post("/embeddings_image", json={"model": NAME, "input": good}).status_code == 200


def test_an_image_over_the_replicas_patch_bound_is_refused_by_the_gateway(tmp_path: Path, minilm_path: Path) -> None:
    """A processor config whose max_num_patches is over the most patches an image the replica takes (its model's
    bound, in Info): an image that would make more is the route's 400 naming it, on Infinity's and Cohere's routes,
    and no chunk of the request reaches a replica; a small image (upscaled at most 100 times) stays under the bound
    and is embedded."""
    path = tmp_path / NAME
    save_siglip2(path, minilm_path, max_num_patches=MAX_IMAGE_PATCHES + 1000)
    small, large = _data_uri(png(image(3, 2, 1))), _data_uri(png(image(40, 30, 2)))
    patches = parse_naflex_config((path / "preprocessor_config.json").read_text()).patches(40, 30)
    assert MAX_IMAGE_PATCHES < patches <= MAX_IMAGE_PATCHES + 1000  # what the replica would refuse
    with engines(path) as built, api(built) as client:
        sent = _chunks_sent(client)
        answer = client.post("/embeddings_image", json={"model": NAME, "input": [small, large]})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["param"] == "input[1]" and error["code"] == "image_too_large", error
        assert f"makes {patches} patches" in error["message"] and f"limit of {MAX_IMAGE_PATCHES}" in error["message"]
        cohere = client.post("/v2/embed", json={"model": NAME, "input_type": "image", "embedding_types": ["float"],
                                                "images": [large, small]})  # fmt: skip
        assert cohere.status_code == 400 and cohere.json()["message"].startswith("images[0] makes"), cohere.text
        assert _chunks_sent(client) == sent
        rows = _rows(client.post("/embeddings_image", json={"model": NAME, "input": small}))
        assert rows.shape == (1, 64) and _chunks_sent(client) == sent + 1


def _chunks_sent(client: httpx.Client) -> float:
    """The chunks the gateway has sent to replicas (its queue-time histogram's count)."""
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == "bouquet_gateway_queue_seconds_count":
                return sample.value
    raise AssertionError("no bouquet_gateway_queue_seconds_count on /metrics")


@pytest.mark.parametrize("max_num_patches", [MAX_NUM_PATCHES, 256, 7])
def test_preprocessing_is_transformers_bit_for_bit(tmp_path: Path, max_num_patches: int) -> None:
    """Every size (upscaled, downscaled, extreme aspect ratios, smaller than a patch) and mode (alpha, palette,
    grey, CMYK: transformers converted to RGB first, as the model takes three channels), patches and grids."""
    reference = processor(max_num_patches)
    reference.do_convert_rgb = True
    reference.save_pretrained(tmp_path)
    reference = type(reference).from_pretrained(tmp_path)
    ours = parse_naflex_config((tmp_path / "preprocessor_config.json").read_text())
    for width, height in [*SIZES, (7, 500), (33, 31), (5, 3), (640, 480), (2000, 1)]:
        for mode in ("RGB", "RGBA", "P", "L", "CMYK"):
            picture = image(width, height, width * height, "RGBA" if mode != "RGB" else "RGB")
            picture = picture if mode in ("RGB", "RGBA") else picture.convert(mode)
            expected = reference(images=picture, return_tensors="np")
            rows, columns = expected["spatial_shapes"][0]
            patches, grid = ours(picture)
            assert grid == (1, rows, columns), (width, height)
            np.testing.assert_array_equal(patches, expected["pixel_values"][0, : rows * columns])


def test_a_default_config_and_configs_the_gateway_cannot_follow() -> None:
    default = parse_naflex_config(json.dumps({"image_processor_type": "Siglip2ImageProcessor"}))
    assert default == NaflexProcessing(16, 256, 2, 1 / 255, (0.5,) * 3, (0.5,) * 3)
    images = model_images((), 0, json.dumps({"patch_size": 8}), 3 * 8 * 8, image_sequences=True)
    assert images is not None and images.usable and images.tokens == 256 and not images.patch_dim
    bounded = model_images((), 0, json.dumps({"patch_size": 8}), 3 * 8 * 8, image_sequences=True, max_patches=100)
    assert bounded is not None and bounded.tokens == 100 and bounded.max_patches == 100  # no image is sent over it
    for config, why in [
        ({"patch_size": 16}, "patches of 768 values, not 192"),
        ({"patch_size": 8, "resample": 9}, "not one of Pillow's filters"),
        ({"patch_size": 8, "do_resize": False}, "do_resize false"),
        ({"patch_size": 8, "image_mean": [0.5, 0.5]}, "one value or three"),
    ]:
        unusable = model_images((), 0, json.dumps(config), 3 * 8 * 8, image_sequences=True)
        assert unusable is not None and not unusable.usable and why in unusable.unusable, unusable
