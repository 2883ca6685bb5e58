"""Zero-shot scores over real HTTP (vLLM's /score with a side in its multimodal `{"content": [...]}` form) on the tiny
CLIP and SigLIP of test_image_api, against transformers' own CLIPModel / SiglipModel forward (SigLIP's texts padded
by its processor with padding="max_length", as its docs show): the score is the cosine of a text's and an image's
features, which is transformers' logits_per_image with the model's scale (and SigLIP's bias) taken off."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pytest
import test_image_api
import torch
from PIL import Image
from test_image_api import _data_uri, _file, _image, _processor

models = test_image_api.models  # its module-scoped fixtures: the tiny models, and a server of them
server = test_image_api.server
LABELS = ["a photo of a small cat", "a diagram", "two dogs on a beach at noon"]


def _cosines(family: str, models, server: httpx.Client, texts: list[str], files: list[bytes]) -> np.ndarray:
    """transformers' logits_per_text ([texts, images]) with the logit scale and bias undone."""
    model = models[family][1]
    with torch.no_grad():
        bias = model.logit_bias if family == "siglip" else 0.0
        return ((_logits(family, models, server, texts, files) - bias) / model.logit_scale.exp()).numpy()


def _logits(family: str, models, server: httpx.Client, texts: list[str], files: list[bytes]) -> torch.Tensor:
    """transformers' logits_per_text ([texts, images]). SigLIP's inputs from its processor with
    padding="max_length", as SigLIP's docs show (it was trained on padded texts); CLIP's texts as the server
    tokenizes them, one a forward (its EOS pooling reads no pad)."""
    path, model = models[family]
    images = [Image.open(io.BytesIO(data)) for data in files]
    if family == "siglip":
        from transformers import AutoTokenizer, SiglipProcessor

        processor = SiglipProcessor(_processor(family).from_pretrained(path), AutoTokenizer.from_pretrained(path))
        inputs = processor(text=texts, images=images, padding="max_length", return_tensors="pt")
        with torch.no_grad():
            return model(**inputs).logits_per_text
    pixels = _processor(family).from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([_ids(server, "tiny-clip", text)]), pixel_values=pixels).logits_per_text[0]
                for text in texts]  # fmt: skip
        return torch.stack(rows)


def _ids(server: httpx.Client, model: str, text: str) -> list[int]:
    return [token["id"] for token in server.post("/tokenize", json={"model": model, "inputs": text}).json()[0]]


def _scores(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["score"] for item in response.json()["data"]])


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_texts_against_images_score_as_transformers_forward(server: httpx.Client, models, family: str) -> None:
    name = f"tiny-{family}"
    files = [_file(_image(w, h, seed)) for seed, (w, h) in enumerate([(70, 40), (32, 50), (90, 90)])]
    content = {"content": [{"type": "image_url", "image_url": {"url": _data_uri(data)}} for data in files]}
    expected = _cosines(family, models, server, LABELS, files)
    one_text = _scores(server.post("/score", json={"model": name, "text_1": LABELS[1], "text_2": content}))
    np.testing.assert_allclose(one_text, expected[1], atol=2e-5)
    pairwise = _scores(server.post("/v1/score", json={"model": name, "queries": LABELS, "documents": content}))
    np.testing.assert_allclose(pairwise, np.diag(expected), atol=2e-5)
    images_first = _scores(server.post("/score", json={"model": name, "data_1": content, "data_2": LABELS}))
    np.testing.assert_allclose(images_first, np.diag(expected), atol=2e-5)


def test_content_parts_mix_texts_and_images_and_refusals_name_the_part(server: httpx.Client, models) -> None:
    image = _file(_image(40, 60, 5))
    parts = [{"type": "text", "text": LABELS[0]}, {"type": "image_url", "image_url": {"url": _data_uri(image)}}]
    body = {"model": "tiny-clip", "text_1": LABELS[0], "text_2": {"content": parts}}
    scores = _scores(server.post("/score", json=body))
    assert scores[0] == pytest.approx(1.0, abs=1e-5)  # a text against itself
    np.testing.assert_allclose(scores[1], _cosines("clip", models, server, LABELS[:1], [image])[0, 0], atol=2e-5)
    bad = {**body, "text_2": {"content": [parts[0], {"type": "image_url", "image_url": {"url": "aGVsbG8="}}]}}
    response = server.post("/score", json=bad)
    assert response.status_code == 400 and "text_2.content[1].image_url.url" in response.text, response.text
    uneven = {"model": "tiny-clip", "text_1": LABELS[:2], "text_2": {"content": parts + parts}}
    assert server.post("/score", json=uneven).status_code == 400
    text_model = server.post("/score", json={"model": "tiny-clip-bare", "text_1": "x", "text_2": {"content": parts}})
    assert text_model.status_code == 400 and "no_image_input" in text_model.text, text_model.text


def test_siglips_probabilities_and_logits_are_transformers_forward(server: httpx.Client, models) -> None:
    """`use_activation: true`: SigLIP's zero-shot probability, transformers' logits_per_text.sigmoid(), each pair on
    its own; `false`: the logit itself; the scale and bias the replica read from the checkpoint."""
    files = [_file(_image(w, h, seed)) for seed, (w, h) in enumerate([(70, 40), (32, 50)])]
    content = {"content": [{"type": "image_url", "image_url": {"url": _data_uri(data)}} for data in files]}
    logits = _logits("siglip", models, server, LABELS, files)  # [texts, images]
    body = {"model": "tiny-siglip", "text_1": LABELS[2], "text_2": content}
    probabilities = _scores(server.post("/score", json={**body, "use_activation": True}))
    np.testing.assert_allclose(probabilities, logits[2].sigmoid().numpy(), atol=1e-5)
    raw = _scores(server.post("/score", json={**body, "activation": False}))
    np.testing.assert_allclose(raw, logits[2].numpy(), rtol=1e-5, atol=1e-5)
    pairs = {"model": "tiny-siglip", "data_1": content, "data_2": LABELS[:2], "use_activation": True}
    np.testing.assert_allclose(_scores(server.post("/score", json=pairs)), np.diag(logits.sigmoid().numpy()), atol=1e-5)
    cosines = _scores(server.post("/score", json=body))  # unasked: the cosine, as vLLM's /score gives
    np.testing.assert_allclose(cosines, _cosines("siglip", models, server, LABELS, files)[2], atol=2e-5)


def test_clips_probabilities_are_a_softmax_over_each_images_texts(server: httpx.Client, models) -> None:
    """CLIP's zero-shot probabilities, transformers' logits_per_image.softmax(dim=1): each image's labels."""
    files = [_file(_image(w, h, seed)) for seed, (w, h) in enumerate([(70, 40), (32, 50)])]
    logits = _logits("clip", models, server, LABELS, files)  # [texts, images]
    for index, data in enumerate(files):
        content = {"content": [{"type": "image_url", "image_url": {"url": _data_uri(data)}}]}
        body = {"model": "tiny-clip", "data_1": content, "data_2": LABELS, "use_activation": True}
        answer = _scores(server.post("/score", json=body))  # the image against each label
        np.testing.assert_allclose(answer, logits.T.softmax(dim=1)[index].numpy(), atol=1e-5)
    both = {"content": [{"type": "image_url", "image_url": {"url": _data_uri(data)}} for data in files]}
    body = {"model": "tiny-clip", "data_1": both, "data_2": LABELS[:2], "use_activation": False}
    np.testing.assert_allclose(_scores(server.post("/score", json=body)), np.diag(logits.numpy()), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": "tiny-clip", "text_1": "a", "text_2": {"content": [{"type": "text", "text": "b"}]},
          "use_activation": True}, "every pair must be a text and an image"),
        ({"model": "tiny-siglip", "text_1": "a", "text_2": {"content": [{"type": "text", "text": "b"}]},
          "activation": True, "use_activation": False}, "disagree"),
    ],
)  # fmt: skip
def test_zero_shot_activation_refusals(server: httpx.Client, body: dict, says: str) -> None:
    answer = server.post("/score", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "use_activation", answer.text
    assert says in answer.json()["error"]["message"]
