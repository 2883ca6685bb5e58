"""Texts and images in one request, over real HTTP on loopback to a tiny CLIP (random weights, saved by transformers
with its image processor) and the bundled MiniLM behind the real gateway:
- Cohere v2's `images` (data URIs) and `inputs` (text and `image_url` parts) through the real `cohere` SDK's
  `ClientV2`, against transformers' processor, `get_image_features` and `get_text_features` (float32, cosine >=
  0.99999), texts and images of one request in input order and in one space; an image URL only from an origin the
  server lists (a loopback http.server), equal to the same image inline; refusals in Cohere's body: images on a text
  model, a text and an image in one input of CLIP, a URL off the list, a bad image, two of texts, images and inputs;
- Jina's (jina-clip's) `{"text"}` and `{"image"}` objects in `input` of `/v1/embeddings`, beside plain texts: the
  same rows as Cohere's, `dimensions` and base64 applied; refusals in OpenAI's body naming the input."""

from __future__ import annotations

import base64
import contextlib
import functools
import http.server
import io
import threading
from collections.abc import Iterator
from pathlib import Path

import cohere
import httpx
import numpy as np
import pytest
import torch
from conftest import row_cosines
from in_process import engines, served
from PIL import Image
from sentence_transformers.util.quantization import quantize_embeddings
from test_clip import _clip, _save
from test_image_api import _assert_close, _data_uri, _file, _image, _processor, _reference, _rows

from bouquet.encodings import Encoding, encode_rows
from bouquet.engine.engine import Engine

CLIP, TEXT_MODEL = "tiny-clip", "all-MiniLM-L6-v2"
FILES = [_file(_image(50, 80, 0)), _file(_image(300, 120, 1)), _file(_image(90, 61, 2), "JPEG")]
TEXTS = ["a photo of a small cat", "a chart of quarterly revenue"]


@pytest.fixture(scope="module")
def clip(tmp_path_factory, minilm_path: Path) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("cohere-images") / CLIP
    model = _save(_clip(eos_token_id=102), path, minilm_path)
    _processor("clip").save_pretrained(path)
    return path, model


class QuietFiles(http.server.SimpleHTTPRequestHandler):
    """A directory's files, without a log line a request, and quiet when the gateway hangs up at its byte cap."""

    def copyfile(self, source, outputfile) -> None:  # type: ignore[no-untyped-def]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            super().copyfile(source, outputfile)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def image_origin(tmp_path_factory) -> Iterator[str]:
    """A loopback http.server over a directory holding the test's images."""
    root = tmp_path_factory.mktemp("cohere-image-files")
    for index, data in enumerate(FILES):
        (root / f"{index}.png").write_bytes(data)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietFiles, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_port}"
    server.shutdown()


@pytest.fixture(scope="module")
def url(clip, minilm_fp32: Engine, minilm_path: Path, image_origin: str) -> Iterator[str]:
    with (
        engines(clip[0]) as built,
        served(
            [*built, minilm_fp32], listen=True, model_dirs=(minilm_path,), image_url_origins=(image_origin,)
        ) as running,
    ):
        yield running.url


@pytest.fixture(scope="module")
def client(url: str) -> cohere.ClientV2:
    return cohere.ClientV2(api_key="unused", base_url=url, timeout=120)


@pytest.fixture(scope="module")
def web(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=120) as client:
        yield client


def _floats(response) -> np.ndarray:
    return np.array(response.embeddings.float_, np.float32)


def test_images_embed_as_transformers_clip(client: cohere.ClientV2, clip) -> None:
    expected = _reference("clip", {"clip": clip}, FILES)
    images = [_data_uri(data, "jpeg" if index == 2 else "png") for index, data in enumerate(FILES)]
    response = client.embed(model=CLIP, images=images, input_type="image", embedding_types=["float", "int8"])
    _assert_close(_floats(response), expected)
    assert response.meta.billed_units.input_tokens == 3 * 17
    int8 = np.array(response.embeddings.int8, np.int64)  # the float rows' int8 (encodings.py), a rounding apart
    assert np.abs(int8 - encode_rows(_floats(response), Encoding.INT8).astype(np.int64)).max() <= 1


def test_inputs_mix_texts_and_images_in_order_in_one_space(client: cohere.ClientV2, clip, minilm_path: Path) -> None:
    """Text inputs and image inputs in one request: each row where its input was, equal to the texts and the
    images embedded apart, and transformers' cosine between a text and an image."""
    from transformers import AutoTokenizer

    image_part = {"type": "image_url", "image_url": {"url": _data_uri(FILES[0])}}
    inputs = [
        {"content": [{"type": "text", "text": TEXTS[0]}]},
        {"content": [image_part]},
        {"content": [{"type": "text", "text": "a chart of"}, {"type": "text", "text": "quarterly revenue"}]},
    ]
    rows = _floats(client.embed(model=CLIP, inputs=inputs, input_type="search_document"))  # type: ignore[arg-type]
    texts = _floats(client.embed(model=CLIP, texts=TEXTS, input_type="search_document"))
    image = _floats(client.embed(model=CLIP, images=[_data_uri(FILES[0])], input_type="image"))
    np.testing.assert_allclose(rows, np.concatenate([texts[:1], image, texts[1:]]), atol=1e-6)
    ids = AutoTokenizer.from_pretrained(minilm_path)(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        features = clip[1].get_text_features(**ids).pooler_output.numpy()
    _assert_close(texts, features)
    expected_image = _reference("clip", {"clip": clip}, FILES[:1])
    assert abs(float(row_cosines(texts[:1], image)[0]) - float(row_cosines(features[:1], expected_image)[0])) < 1e-5


def test_an_image_url_on_a_listed_origin_embeds_as_the_same_image_inline(
    client: cohere.ClientV2, image_origin: str
) -> None:
    by_url = client.embed(model=CLIP, images=[f"{image_origin}/1.png"], input_type="image")
    part = {"type": "image_url", "image_url": {"url": f"{image_origin}/1.png"}}
    in_inputs = client.embed(model=CLIP, inputs=[{"content": [part]}], input_type="image")  # type: ignore[list-item]
    inline = client.embed(model=CLIP, images=[_data_uri(FILES[1])], input_type="image")
    np.testing.assert_allclose(_floats(by_url), _floats(inline), atol=1e-6)
    np.testing.assert_allclose(_floats(in_inputs), _floats(inline), atol=1e-6)
    assert by_url.images == in_inputs.images == inline.images and inline.images[0].width == 300  # the fetched file's


def _turned_jpeg(width: int, height: int) -> bytes:
    """A JPEG stored at width x height whose EXIF orientation (6) turns it a quarter: embedded turned."""
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    _image(width, height, 8).save(buffer, format="JPEG", exif=exif)
    return buffer.getvalue()


DESCRIBED = [  # (file, its facts as Cohere's answer gives them: width, height, format, bit_depth)
    (_file(_image(400, 400, 3), "JPEG"), (400, 400, "jpeg", 24)),  # Cohere's API reference's example image's facts
    (_file(_image(50, 80, 0, "RGBA")), (50, 80, "png", 32)),
    (_file(_image(33, 21, 4).convert("L"), "JPEG"), (33, 21, "jpeg", 8)),
    (_file(_image(40, 30, 6).convert("P"), "GIF"), (40, 30, "gif", 8)),
    (_file(_image(17, 9, 7).convert("1"), "BMP"), (17, 9, "bmp", 1)),
    (_file(_image(24, 24, 9), "WEBP"), (24, 24, "webp", 24)),
    (_turned_jpeg(30, 20), (30, 20, "jpeg", 24)),  # the size as stored, before the turn
]


def test_answers_describe_each_image_as_coheres_api_does(client: cohere.ClientV2, web: httpx.Client) -> None:
    """`images` in the answer (the SDK's Image): each image embedded, in input order among `images` or `inputs`,
    with its file's width, height, format and bit depth; left out when no image was sent."""
    files, facts = [file for file, _ in DESCRIBED], [fact for _, fact in DESCRIBED]
    described = client.embed(model=CLIP, images=[_data_uri(f) for f in files], input_type="image")
    assert described.images is not None and described.texts == []
    assert [(i.width, i.height, i.format, i.bit_depth) for i in described.images] == facts
    assert all(isinstance(image, cohere.Image) for image in described.images)
    inputs = [{"content": [_image_part(_data_uri(files[3]))]}, {"content": [{"type": "text", "text": TEXTS[0]}]},
              {"content": [_image_part(_data_uri(files[1]))]}]  # fmt: skip
    mixed = client.embed(model=CLIP, inputs=inputs, input_type="search_document")  # type: ignore[arg-type]
    assert mixed.images is not None
    assert [(i.width, i.height, i.format, i.bit_depth) for i in mixed.images] == [facts[3], facts[1]]
    np.testing.assert_allclose(_floats(mixed)[[0, 2]], _floats(described)[[3, 1]], atol=1e-6)
    assert client.embed(model=CLIP, texts=TEXTS, input_type="search_query").images is None
    body = {"model": CLIP, "texts": TEXTS, "input_type": "search_query", "embedding_types": ["float"]}
    assert "images" not in web.post("/v2/embed", json=body).json()


def _image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.mark.parametrize(
    ("call", "says"),
    [
        (lambda c, o: c.embed(model=TEXT_MODEL, images=[_data_uri(FILES[0])], input_type="image"),
         "takes no images"),
        (lambda c, o: c.embed(model=TEXT_MODEL, inputs=[{"content": [{"type": "text", "text": "a"}]},
                                                        {"content": [_image_part(_data_uri(FILES[0]))]}],
                              input_type="search_document"), "takes no images"),
        (lambda c, o: c.embed(model=CLIP, inputs=[{"content": [{"type": "text", "text": "a cat"},
                                                               _image_part(_data_uri(FILES[0]))]}],
                              input_type="search_document"), "'inputs[0]' holds 1 texts and 1 images"),
        (lambda c, o: c.embed(model=CLIP, images=["http://127.0.0.2:9/cat.png"], input_type="image"),
         "images[0]"),
        (lambda c, o: c.embed(model=CLIP, inputs=[{"content": [_image_part(f"{o}/nothing.png")]}],
                              input_type="image"), "inputs[0].content[0].image_url.url"),
        (lambda c, o: c.embed(model=CLIP, images=["data:image/png;base64,AAAA"], input_type="image"),
         "images[0]"),
        (lambda c, o: c.embed(model=CLIP, texts=["a"], images=[_data_uri(FILES[0])], input_type="image"),
         "not ['texts', 'images']"),
    ],
)  # fmt: skip
def test_refusals_are_400_in_coheres_body(client: cohere.ClientV2, image_origin: str, call, says: str) -> None:
    with pytest.raises(cohere.BadRequestError) as raised:
        call(client, image_origin)
    assert set(raised.value.body) == {"message"} and says in raised.value.body["message"], raised.value.body
    assert client.embed(model=CLIP, texts=["still answering"], input_type="search_query").embeddings.float_


def test_jinas_objects_embed_texts_and_images_in_input_order(
    web: httpx.Client, client: cohere.ClientV2, image_origin: str
) -> None:
    """jina-clip's body: objects and plain texts in `input`, each row where its input was, the rows Cohere's route
    gives the same texts and images (whose agreement with transformers is tested above)."""
    body = {"model": CLIP, "input": [
        {"text": TEXTS[0]}, {"image": _data_uri(FILES[0])}, TEXTS[1], {"image": f"{image_origin}/1.png"},
    ]}  # fmt: skip
    rows = _rows(web.post("/v1/embeddings", json=body))
    texts = _floats(client.embed(model=CLIP, texts=TEXTS, input_type="search_document"))
    images = _floats(client.embed(model=CLIP, images=[_data_uri(FILES[0]), _data_uri(FILES[1])], input_type="image"))
    np.testing.assert_allclose(rows, np.stack([texts[0], images[0], texts[1], images[1]]), atol=1e-6)
    cut = web.post("/v1/embeddings", json={**body, "dimensions": 16, "encoding_format": "base64"})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == _usage(web, {"model": CLIP, "input": TEXTS}) + 2 * 17
    decoded = np.stack([np.frombuffer(base64.b64decode(item["embedding"]), "<f4") for item in cut.json()["data"]])
    np.testing.assert_allclose(decoded, rows[:, :16] / np.linalg.norm(rows[:, :16], axis=1, keepdims=True), atol=1e-6)


def test_jinas_documented_body_is_taken_as_sent(web: httpx.Client, image_origin: str) -> None:
    """jina-clip's example body as Jina documents it: `normalized` and `embedding_type` (its names for `normalize` and
    `encoding_format`), an image as plain base64; the same rows as OpenAI's names give."""
    items = [{"text": TEXTS[0]}, {"image": base64.b64encode(FILES[2]).decode()}, {"image": f"{image_origin}/0.png"}]
    jina = {"model": CLIP, "dimensions": 32, "normalized": True, "embedding_type": "float", "input": items}
    openai = {"model": CLIP, "dimensions": 32, "normalize": True, "encoding_format": "float", "input": items}
    np.testing.assert_allclose(
        _rows(web.post("/v1/embeddings", json=jina)), _rows(web.post("/v1/embeddings", json=openai))
    )
    binary = _rows(web.post("/v1/embeddings", json={**jina, "embedding_type": "ubinary"}))
    assert binary.shape == (3, 4)  # 32 bits a row, packed
    floats = _rows(web.post("/v1/embeddings", json=jina))
    unsure = np.packbits(np.abs(floats) <= 1e-5, axis=1).astype(bool)  # either sign in another step's arithmetic
    assert not ((binary != quantize_embeddings(floats, "ubinary")) & ~unsure).any()
    disagreeing = web.post("/v1/embeddings", json={**jina, "encoding_format": "base64"})
    assert disagreeing.status_code == 400 and disagreeing.json()["error"]["param"] == "embedding_type"


def _usage(web: httpx.Client, body: dict) -> int:
    return web.post("/v1/embeddings", json=body).json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize(
    ("model", "items", "code", "param"),
    [
        (TEXT_MODEL, [{"text": "a"}, {"image": _data_uri(FILES[0])}], "no_image_input", "model"),
        (CLIP, [{}], "invalid_value", "input[0]"),
        (CLIP, [{"text": "a", "image": _data_uri(FILES[0])}], "invalid_value", "input[0]"),
        (CLIP, [{"text": "a"}, [101, 102]], "invalid_type", "input[1]"),
        (CLIP, [{"image": "data:image/png;base64,AAAA"}], "unknown_image_format", "input[0].image"),
        (CLIP, [{"image": "http://127.0.0.2:9/cat.png"}], "image_url_refused", "input[0].image"),
        (CLIP, [{"video": "clip.mp4"}], "unsupported_parameter", "input[0].video"),
    ],
)
def test_jinas_objects_refused_in_openais_body(web: httpx.Client, model: str, items: list, code: str, param: str):
    response = web.post("/v1/embeddings", json={"model": model, "input": items})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param), error
    assert web.post("/v1/embeddings", json={"model": CLIP, "input": [{"text": "still answering"}]}).status_code == 200


@pytest.mark.parametrize(
    ("inputs", "status", "says"),
    [
        ([{"content": [{"type": "audio", "audio": "x"}]}], 400, "inputs[0].content[0]"),
        ([{"content": [{"type": "image_url", "image_url": {}}]}], 400, "url"),
        ([{"content": [{"type": "image_url", "image_url": "data:image/png;base64,AAAA"}]}], 422, "image_url"),
        ([{"content": []}], 400, "inputs[0].content"),
        ([{"content": [{"type": "text", "text": ""}]}], 400, "inputs[0]"),
    ],
)
def test_malformed_cohere_inputs_are_4xx_in_coheres_body(
    web: httpx.Client, inputs: list, status: int, says: str
) -> None:
    """400, or 422 for a value of the wrong type (as every route answers it)."""
    response = web.post("/v2/embed", json={"model": CLIP, "input_type": "image", "inputs": inputs})
    assert response.status_code == status, response.text
    assert set(response.json()) == {"message"} and says in response.json()["message"], response.json()
