"""Image inputs over real HTTP on loopback: a tiny CLIP and a tiny SigLIP (random weights, saved by transformers with
their image processors) behind the real gateway, images of sizes other than the processor's sent as data URIs and
base64 through Infinity's `/embeddings_image`, its `/embeddings` with `"modality": "image"` and vLLM's `messages`
form of `/v1/embeddings`, against transformers' own processor and `get_image_features` (float32, cosine >= 0.99999);
a text and an image of one model in the same space (SigLIP's text as its tokenizer pads it, `padding="max_length"`);
`dimensions` and base64; every bad image a 400 naming the input, the server answering after. The gateway's
preprocessing is also checked bit for bit against transformers'."""

from __future__ import annotations

import base64
import io
import json
import shutil
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from conftest import row_cosines
from in_process import engines, runs_an_event_loop, served
from PIL import Image
from test_clip import _clip, _save
from test_siglip import padded_text_features, save_siglip

from bouquet.encodings import Encoding, encode_rows
from bouquet.gateway import images as gateway_images
from bouquet.gateway.image_processing import model_images, parse_processor_config

BOUND = 0.99999
SIZES = [(50, 80), (300, 120), (32, 32), (17, 9)]  # (width, height); the processors' size is 32
MAX_IMAGE_BYTES = 200_000


def _processor(family: str):
    from transformers import CLIPImageProcessor, SiglipImageProcessor

    if family == "clip":
        return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    return SiglipImageProcessor(size={"height": 32, "width": 32}, resample=2)  # bilinear: the config's, not a default


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path: Path) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("image-api")
    clip_path, siglip_path = root / "tiny-clip", root / "tiny-siglip"
    built = {
        "clip": (clip_path, _save(_clip(eos_token_id=102), clip_path, minilm_path)),
        "siglip": (siglip_path, save_siglip(siglip_path, minilm_path, projection_size=64)),  # one space
    }
    shutil.copytree(clip_path, root / "tiny-clip-bare")  # no preprocessor_config.json
    for family, (path, _) in built.items():
        _processor(family).save_pretrained(path)
    return {**built, "bare": (root / "tiny-clip-bare", built["clip"][1])}


@pytest.fixture(scope="module")
def server(models) -> Iterator[httpx.Client]:
    with (
        engines(*(path for path, _ in models.values())) as built,
        served(built, listen=True, max_image_bytes=MAX_IMAGE_BYTES) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client


def _image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A gradient with noise: resizing or cropping at the wrong place moves its pixels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels, "RGB")
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
        image = Image.fromarray(np.dstack([pixels, alpha]), "RGBA")
    return image


def _file(image: Image.Image, format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format, quality=95) if format == "JPEG" else image.save(buffer, format=format)
    return buffer.getvalue()


def _data_uri(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def _reference(family: str, models, files: list[bytes]) -> np.ndarray:
    path, model = models[family]
    images = [Image.open(io.BytesIO(data)) for data in files]
    pixels = _processor(family).from_pretrained(path)(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        return model.get_image_features(pixel_values=pixels).pooler_output.numpy()


def _text_reference(family: str, server: httpx.Client, models, text: str) -> np.ndarray:
    """transformers' text features: SigLIP's with its tokenizer's padding="max_length", as SigLIP's docs ask (it
    was trained on padded texts: test_siglip.py); CLIP's for the text as the server tokenizes it (its EOS pooling
    reads no pad)."""
    path, model = models[family]
    if family == "siglip":
        return padded_text_features(path, model, [text])
    ids = server.post("/tokenize", json={"model": f"tiny-{family}", "inputs": text}).json()[0]
    with torch.no_grad():
        return model.get_text_features(input_ids=torch.tensor([[token["id"] for token in ids]])).pooler_output.numpy()


def _rows(response: httpx.Response) -> np.ndarray:
    assert response.status_code == 200, response.text
    return np.array([item["embedding"] for item in response.json()["data"]], np.float32)


def _assert_close(rows: np.ndarray, expected: np.ndarray) -> None:
    cosines = row_cosines(rows, expected)
    assert cosines.min() >= BOUND, f"cosines {np.round(cosines, 7)}"


def _test_files() -> list[bytes]:
    files = [_file(_image(w, h, seed)) for seed, (w, h) in enumerate(SIZES)]
    files.append(_file(_image(64, 40, 7, "RGBA")))  # transparency composited onto white
    files.append(_file(_image(90, 61, 8), "JPEG"))
    return files


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_images_of_every_size_match_transformers_on_each_route(server: httpx.Client, models, family: str) -> None:
    files, model = _test_files(), f"tiny-{family}"
    expected = _reference(family, models, files)
    inputs = [_data_uri(data) if index % 2 else base64.b64encode(data).decode() for index, data in enumerate(files)]
    batch = _rows(server.post("/embeddings_image", json={"model": model, "input": inputs}))
    _assert_close(batch, expected)
    unified = _rows(server.post("/embeddings", json={"model": model, "input": inputs, "modality": "image"}))
    np.testing.assert_allclose(unified, batch, atol=1e-6)
    for index in (0, 1):  # vLLM's chat form: one image a request
        content = [{"type": "image_url", "image_url": {"url": _data_uri(files[index])}}]
        body = {"model": model, "messages": [{"role": "user", "content": content}]}
        _assert_close(_rows(server.post("/v1/embeddings", json=body)), expected[index : index + 1])


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_a_text_and_an_image_of_one_model_share_its_space(server: httpx.Client, models, family: str) -> None:
    """The text on /v1/embeddings (and vLLM's text message) and the image on /embeddings_image give transformers'
    cosine between its text and image features."""
    text, image = "a photo of a small cat", _file(_image(120, 90, 3))
    text_row = _rows(server.post("/v1/embeddings", json={"model": f"tiny-{family}", "input": text}))
    message = {"model": f"tiny-{family}", "messages": [{"role": "user", "content": text}]}
    np.testing.assert_allclose(_rows(server.post("/v1/embeddings", json=message)), text_row, atol=1e-6)
    image_row = _rows(server.post("/embeddings_image", json={"model": f"tiny-{family}", "input": _data_uri(image)}))
    expected_text = _text_reference(family, server, models, text)
    _assert_close(text_row, expected_text)
    expected_image = _reference(family, models, [image])
    served_cosine = float(row_cosines(text_row, image_row)[0])
    assert abs(served_cosine - float(row_cosines(expected_text, expected_image)[0])) < 1e-5


def test_dimensions_and_base64_apply_to_images(server: httpx.Client) -> None:
    image = _data_uri(_file(_image(70, 50, 5)))
    full = _rows(server.post("/embeddings_image", json={"model": "tiny-clip", "input": [image]}))[0]
    cut = _rows(server.post("/embeddings_image", json={"model": "tiny-clip", "input": [image], "dimensions": 16}))[0]
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), atol=1e-6)
    body = {"model": "tiny-clip", "messages": [{"role": "user", "content": [{"type": "image_url",
            "image_url": {"url": image}}]}], "encoding_format": "base64"}  # fmt: skip
    answer = server.post("/v1/embeddings", json=body)
    assert answer.status_code == 200, answer.text
    decoded = np.frombuffer(base64.b64decode(answer.json()["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(decoded, full, atol=1e-6)
    assert answer.json()["usage"]["prompt_tokens"] == 17  # the image's tokens: a class token and 16 patches


def test_images_are_decoded_and_preprocessed_off_the_event_loop(server: httpx.Client, monkeypatch) -> None:
    """Each image's decode and preprocessing runs on the gateway's executor, in a thread that runs no event loop."""
    on_a_loop: list[bool] = []
    load = gateway_images.load_pixels

    def recording(*args):
        on_a_loop.append(runs_an_event_loop())
        return load(*args)

    monkeypatch.setattr(gateway_images, "load_pixels", recording)
    inputs = [_data_uri(_file(_image(40 + index, 30, index))) for index in range(3)]
    assert len(_rows(server.post("/embeddings_image", json={"model": "tiny-clip", "input": inputs}))) == 3
    assert on_a_loop == [False] * 3


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_compact_encodings_of_images_are_their_float_rows_encoded(server: httpx.Client, family: str) -> None:
    """int8 and uint8 as encodings.py defines them, binary and ubinary as sentence-transformers' quantize_embeddings
    gives them, of the float rows of the same images (a value within 1e-5 of zero may take either sign)."""
    from sentence_transformers.util.quantization import quantize_embeddings

    body = {"model": f"tiny-{family}", "input": [_data_uri(data) for data in _test_files()]}
    floats = _rows(server.post("/embeddings_image", json={**body, "encoding_format": "float"}))
    unsure = np.packbits(np.abs(floats) <= 1e-5, axis=1).astype(bool)
    for name in ("int8", "uint8", "binary", "ubinary"):
        answer = server.post("/embeddings_image", json={**body, "encoding_format": name})
        assert answer.status_code == 200, answer.text
        rows = np.array([item["embedding"] for item in answer.json()["data"]], np.int64)
        if name in ("binary", "ubinary"):
            assert not ((rows != quantize_embeddings(floats, name)) & ~unsure).any(), name
        else:  # the same grid, a rounding apart at most
            assert np.abs(rows - encode_rows(floats, Encoding[name.upper()]).astype(np.int64)).max() <= 1, name


def _png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height pixels, with one tiny compressed row behind it: a decompression
    bomb as Pillow's header reader meets it."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = chunk(b"IDAT", zlib.compress(b"\0" * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + rows + chunk(b"IEND", b"")


def _jpeg_header_only(width: int, height: int) -> bytes:
    """A baseline JPEG's start and frame header (3 components) claiming width x height, then its end: no scan."""
    frame = struct.pack(">BHHB", 8, height, width, 3) + b"".join(struct.pack(">BBB", c, 0x11, 0) for c in (1, 2, 3))
    return b"\xff\xd8\xff\xc0" + struct.pack(">H", len(frame) + 2) + frame + b"\xff\xd9"


def _gif_header_only(width: int, height: int) -> bytes:
    """A GIF whose screen and one image claim width x height, with one tiny code block behind them."""
    screen = b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0)
    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, width, height, 0)
    return screen + image + b"\x02\x02\x44\x01\x00\x3b"


def _noise_png(side: int) -> bytes:
    return _file(Image.fromarray(np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)))


_GOOD = _data_uri(_file(_image(40, 30, 1)))
BAD_IMAGES = [
    # (input, code, words the message holds)
    (_data_uri(b"\x89PNG\r\n\x1a\n" + b"\0garbage" * 20), "invalid_image", "not a readable image"),
    (_data_uri(_file(_image(64, 64, 2))[:300]), "invalid_image", "corrupt PNG"),  # truncated mid-stream
    (base64.b64encode(b"plain text, not an image").decode(), "unknown_image_format", "not an image in a format"),
    (_data_uri(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"), "unknown_image_format", "PNG, JPEG"),
    (_data_uri(_noise_png(300)), "image_too_large", f"over the limit of {MAX_IMAGE_BYTES}"),
    (_data_uri(_png_header_only(100_000, 100_000)), "image_too_large", "pixels"),  # Pillow's own bomb error
    (_data_uri(_png_header_only(7_000, 7_000)), "image_too_large", "7000 x 7000 pixels"),  # over ours only
    (_data_uri(_jpeg_header_only(65_000, 65_000), "jpeg"), "image_too_large", "pixels"),  # Pillow's bomb error
    (_data_uri(_jpeg_header_only(7_000, 7_000), "jpeg"), "image_too_large", "7000 x 7000 pixels"),
    (_data_uri(_gif_header_only(65_000, 65_000), "gif"), "image_too_large", "pixels"),
    (_data_uri(_gif_header_only(9_000, 5_000), "gif"), "image_too_large", "9000 x 5000 pixels"),
    ("http://127.0.0.1:9/cat.png", "image_url_refused", "fetches nothing"),
    ("https://example.com/cat.png", "image_url_refused", "URL"),
    ("data:image/png,rawbytes", "invalid_image", "without base64"),
    ("data:image/png;base64,@@@@", "invalid_image", "neither a data URI"),
]


@pytest.mark.parametrize(("image", "code", "words"), BAD_IMAGES)
def test_a_bad_image_is_a_400_naming_it_and_the_server_answers_after(
    server: httpx.Client, image: str, code: str, words: str
) -> None:
    answer = server.post("/embeddings_image", json={"model": "tiny-siglip", "input": [_GOOD, image]})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert (error["code"], error["param"]) == (code, "input[1]") and words in error["message"], error
    assert "input[1]" in error["message"]
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}]
    chat = server.post("/v1/embeddings", json={"model": "tiny-clip", "messages": messages})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages[0].content[0].image_url.url"
    assert server.post("/embeddings_image", json={"model": "tiny-siglip", "input": _GOOD}).status_code == 200


_TEXT_AND_IMAGE = [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": _GOOD}}]


@pytest.mark.parametrize(
    ("body", "code", "param"),
    [
        ({"messages": [{"role": "user", "content": _TEXT_AND_IMAGE}]}, "invalid_value", "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": "x"}}]}]},
         "invalid_value", "messages[0].content[0].type"),
        ({"input": [_GOOD, [1, 2]], "modality": "image"}, "invalid_type", "input[1]"),
        ({"input": _GOOD, "modality": "video"}, "unsupported_parameter", "modality"),
        ({"user": "u"}, "missing_required_parameter", "input"),  # neither `input` nor `messages`
        ({"messages": [{"role": "user", "content": "a"}], "x": 1}, "unsupported_parameter", "x"),
    ],
)  # fmt: skip
def test_bodies_that_are_not_one_text_or_image_are_refused(server: httpx.Client, body: dict, code: str, param: str):
    answer = server.post("/v1/embeddings", json={"model": "tiny-clip", **body})
    assert answer.status_code in (400, 422), answer.text
    assert (answer.json()["error"]["code"], answer.json()["error"]["param"]) == (code, param)


def test_a_model_without_its_processor_config_refuses_images_saying_why(server: httpx.Client) -> None:
    answer = server.post("/embeddings_image", json={"model": "tiny-clip-bare", "input": _GOOD})
    assert answer.status_code == 400 and answer.json()["error"]["code"] == "no_image_input", answer.text
    assert "no preprocessor_config.json" in answer.json()["error"]["message"]
    assert server.post("/v1/embeddings", json={"model": "tiny-clip-bare", "input": "a cat"}).status_code == 200


def test_a_text_model_refuses_images(minilm_fp32) -> None:
    with served([minilm_fp32], listen=True) as running, httpx.Client(base_url=running.url) as client:
        answer = client.post("/embeddings_image", json={"input": _GOOD})
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "no_image_input", answer.text
        assert "takes no images" in answer.json()["error"]["message"]


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_preprocessing_is_transformers_bit_for_bit(tmp_path: Path, family: str) -> None:
    """Every size (upscaled, downscaled, narrower than the crop) and mode (alpha, palette, grey, CMYK)."""
    _processor(family).save_pretrained(tmp_path)
    reference = _processor(family).from_pretrained(tmp_path)
    ours = parse_processor_config((tmp_path / "preprocessor_config.json").read_text())
    for width, height in [*SIZES, (7, 500), (33, 31), (1000, 3)]:
        for mode in ("RGB", "RGBA", "P", "L", "LA", "CMYK"):
            image = _image(width, height, width * height, "RGBA" if mode != "RGB" else "RGB")
            image = image if mode in ("RGB", "RGBA") else image.convert(mode)
            expected = reference(images=image, return_tensors="np")["pixel_values"][0]
            np.testing.assert_array_equal(ours(image), expected, err_msg=f"{width} x {height} {mode}")


def test_an_old_clip_feature_extractor_config_is_followed_as_transformers_reads_it(tmp_path: Path) -> None:
    """openai/clip-vit-base-patch32's layout: `size` and `crop_size` as ints, no rescale keys (1/255)."""
    from transformers import CLIPImageProcessor

    config = {"crop_size": 32, "do_center_crop": True, "do_normalize": True, "do_resize": True, "resample": 3,
              "feature_extractor_type": "CLIPFeatureExtractor", "size": 32, "image_mean": [0.48145466, 0.4578275,
              0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]}  # fmt: skip
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    reference = CLIPImageProcessor.from_pretrained(tmp_path)
    ours = parse_processor_config(json.dumps(config))
    for width, height in SIZES:
        image = _image(width, height, 11)
        np.testing.assert_array_equal(ours(image), reference(images=image, return_tensors="np")["pixel_values"][0])


_NO_NORMALIZE = {"do_normalize": False}


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ("", "no preprocessor_config.json"),
        (json.dumps({"size": {"shortest_edge": 32}, "do_center_crop": False, **_NO_NORMALIZE}), "varying sizes"),
        (json.dumps({"size": {"height": 64, "width": 64}, **_NO_NORMALIZE}), "shape [3, 64, 64], not [3, 32, 32]"),
        (json.dumps({"size": {"longest_edge": 32}, **_NO_NORMALIZE}), "only {'shortest_edge'} or {'height', 'width'}"),
        (json.dumps({"size": {"height": 32, "width": 32}, "resample": 9}), "not one of Pillow's filters"),
        (json.dumps({"size": {"height": 32, "width": 32}}), "do_normalize without 'image_mean'"),
        ("{not json", "cannot be followed"),
    ],
)
def test_a_config_the_gateway_cannot_follow_leaves_images_unusable_saying_why(config: str, why: str) -> None:
    images = model_images((3, 32, 32), 17, config)
    assert images is not None and images.processing is None and why in images.unusable, images
    assert model_images((), 0, config) is None  # a text model takes none
