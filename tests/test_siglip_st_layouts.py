"""SigLIP in the layouts sentence-transformers 6 saves, served over real HTTP (float32 cosine >= 0.99999, bfloat16
>= 0.999): texts against transformers' own SiglipModel loaded from that directory, its tokenizer called with
`padding="max_length"` as SigLIP's docs ask; images against sentence-transformers' `encode` of PIL images of sizes
other than the processor's.

sentence-transformers pads a batch's texts to its longest, so its own row of a shorter text moves with its batch
(st_model_pools.py); where its padding reaches max_length (a batch holding a text of that length, or a model saved
with processing_kwargs padding "max_length") its rows are transformers' padded ones, and bouquet's must equal them.

A tiny random-weight SiglipModel (test_siglip.py) is saved by transformers with its SiglipProcessor (transformers 5
nests the image processor in processor_config.json); then:
- "st": sentence-transformers' own save of it (one multimodal Transformer module at the root);
- "clip-module": wrapped in its deprecated CLIPModel module (which 6.x loads any such model with), saved;
- "max-length": its Transformer with processing_kwargs {"text": {"padding": "max_length"}}, saved.
sentence-transformers 2.x-5.3 could not load a SigLIP (their CLIPModel module was transformers' CLIPModel), so no
older layout of one exists."""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from in_process import engines, served
from PIL import Image
from st_image_checks import (
    assert_close,
    assert_load_warnings,
    assert_st_rows_where_padding_reaches_max_length,
    image_files,
    response_rows,
)
from test_siglip import save_siglip

from bouquet.st_layout import read_st_layout

LAYOUTS = ("st", "clip-module", "max-length")
SHORT = ["a photo of a cat", "two dogs playing in the snow near a red house", "x", "an empty room at night"]
LONG = "a diagram of a house " * 20  # over 64 tokens: cut at max_length, where no pad follows it
WARNING = "pads this model's texts to each batch's longest"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import CLIPModel
    from transformers import AutoTokenizer, SiglipImageProcessor, SiglipProcessor

    root = tmp_path_factory.mktemp("siglip-st")
    hf = root / "hf"
    save_siglip(hf, minilm_path)
    images = SiglipImageProcessor(size={"height": 32, "width": 32})
    SiglipProcessor(image_processor=images, tokenizer=AutoTokenizer.from_pretrained(hf)).save_pretrained(hf)
    paths = {name: root / f"tiny-siglip-{name}" for name in LAYOUTS}
    SentenceTransformer(str(hf), device="cpu").save(str(paths["st"]))
    SentenceTransformer(modules=[CLIPModel(str(hf))], device="cpu").save(str(paths["clip-module"]))
    padded = Transformer(str(hf), processing_kwargs={"text": {"padding": "max_length"}})
    SentenceTransformer(modules=[padded], device="cpu").save(str(paths["max-length"]))
    return {"hf": hf, **paths}


@pytest.fixture(scope="module")
def reference(layouts: dict[str, Path]) -> dict[str, dict[str, np.ndarray]]:
    """Per layout: transformers' rows of SHORT padded to max_length ("texts"), sentence-transformers' encode of
    SHORT ("st texts") and of SHORT beside LONG ("st batch"), and of the PIL images ("images")."""
    import torch
    from sentence_transformers import SentenceTransformer
    from transformers import AutoTokenizer, SiglipModel

    images = [Image.open(io.BytesIO(data)) for data in image_files()]
    rows = {}
    for name in LAYOUTS:
        path = layouts[name]
        inputs = AutoTokenizer.from_pretrained(path)(SHORT, padding="max_length", truncation=True, return_tensors="pt")
        with torch.no_grad():
            texts = SiglipModel.from_pretrained(path).eval().get_text_features(**inputs).pooler_output.numpy()
        model = SentenceTransformer(str(path), device="cpu")
        rows[name] = {"texts": texts, "st texts": model.encode(SHORT), "st batch": model.encode([*SHORT, LONG]),
                      "images": model.encode(images)}  # fmt: skip
    return rows


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def server(request, layouts: dict[str, Path]) -> Iterator[tuple[httpx.Client, str]]:
    with (
        engines(*(layouts[name] for name in LAYOUTS), dtype=request.param) as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client, request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_texts_match_transformers_padded_and_images_sentence_transformers(server, reference, layout: str) -> None:
    client, dtype = server
    model = f"tiny-siglip-{layout}"
    texts = response_rows(client.post("/v1/embeddings", json={"model": model, "input": SHORT}))
    inputs = [base64.b64encode(data).decode() for data in image_files()]
    images = response_rows(client.post("/embeddings_image", json={"model": model, "input": inputs}))
    assert_close(texts, reference[layout]["texts"], dtype)
    assert_close(images, reference[layout]["images"], dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_texts_equal_sentence_transformers_where_its_padding_reaches_max_length(server, reference, layout: str) -> None:
    client, dtype = server
    assert_st_rows_where_padding_reaches_max_length(
        client,
        reference[layout],
        f"tiny-siglip-{layout}",
        SHORT,
        LONG,
        dtype,
        pads_to_max_length=layout == "max-length",
    )


def test_the_load_says_once_when_sentence_transformers_pads_otherwise(layouts: dict[str, Path], caplog) -> None:
    expected = {"st": 1, "clip-module": 1, "max-length": 0, "hf": 0}
    assert_load_warnings(layouts, expected, WARNING, "max_length", caplog)


def test_each_layout_is_read_as_a_model_that_pools_itself(layouts: dict[str, Path]) -> None:
    paddings = {"st": "longest", "clip-module": "longest", "max-length": "max_length"}
    for name, padding in paddings.items():
        layout = read_st_layout(layouts[name])
        assert layout.model_pools and layout.pooling is None and layout.normalize is False, name
        assert layout.transformer_dir == layouts[name] and layout.text_padding == padding, name


@pytest.mark.parametrize(
    "processing",
    [{"image": {"size": {"height": 16, "width": 16}}}, {"text": {"max_length": 16}}, {"text": {"padding": False}},
     {"common": {"padding": "max_length"}}],
)  # fmt: skip
def test_processing_kwargs_bouquet_does_not_follow_are_refused(tmp_path: Path, layouts, processing) -> None:
    model = tmp_path / "model"
    shutil.copytree(layouts["st"], model)
    settings = model / "sentence_bert_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "processing_kwargs": processing}))
    with pytest.raises(ValueError, match=r"processing_kwargs .* is not supported") as refused:
        read_st_layout(model)
    assert str(settings) in str(refused.value)
