"""SigLIP 2 in the layouts sentence-transformers 6 saves, served over real HTTP (float32 cosine >= 0.99999, bfloat16
>= 0.999): texts against transformers' own Siglip2Model and Siglip2Processor loaded from that directory (its call
pads to max_length, 64, on the tokenizer's left, lowercased), images against sentence-transformers' `encode` and
transformers' forward on PIL images of sizes other than the position table's.

sentence-transformers pads a batch's texts to its longest (still on the left), so its own row of a shorter text moves
with its batch (st_model_pools.py): where its padding reaches max_length (a batch holding a text of that length, or a
model saved with processing_kwargs padding "max_length") its rows are transformers' padded ones, and bouquet's must
equal them.

A tiny random-weight Siglip2Model patched as the released ones are (siglip2_models.save_siglip2_processor: at another
patch sentence-transformers' encode of images fails, as Siglip2Processor's call uses patch 16 and 256 patches
whatever was saved) is saved by transformers with its Siglip2Processor; then:
- "st": sentence-transformers' own save of it (one multimodal Transformer module at the root);
- "clip-module": wrapped in its deprecated CLIPModel module, saved;
- "max-length": its Transformer with processing_kwargs {"text": {"padding": "max_length"}}, saved."""

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
import torch
from in_process import engines, served
from PIL import Image
from siglip2_models import save_siglip2_processor
from st_image_checks import (
    assert_close,
    assert_load_warnings,
    assert_st_rows_where_padding_reaches_max_length,
    image_files,
    response_rows,
)

from bouquet.image_processor_file import PROCESSOR_FILE
from bouquet.st_layout import read_st_layout

LAYOUTS = ("st", "clip-module", "max-length")
SHORT = ["A Photo of a Cat", "two dogs playing in the snow near a red house", "x", "The Eiffel Tower at night"]
LONG = "an old map of Paris " * 20  # over 64 tokens: cut at max_length, where no pad comes before it
WARNING = "pads this model's texts to each batch's longest"


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, Path]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import CLIPModel

    root = tmp_path_factory.mktemp("siglip2-st")
    hf = root / "hf"
    save_siglip2_processor(hf)
    paths = {name: root / f"tiny-siglip2-{name}" for name in LAYOUTS}
    SentenceTransformer(str(hf), device="cpu").save(str(paths["st"]))
    SentenceTransformer(modules=[CLIPModel(str(hf))], device="cpu").save(str(paths["clip-module"]))
    padded = Transformer(str(hf), processing_kwargs={"text": {"padding": "max_length"}})
    SentenceTransformer(modules=[padded], device="cpu").save(str(paths["max-length"]))
    return {"hf": hf, **paths}


@pytest.fixture(scope="module")
def reference(layouts: dict[str, Path]) -> dict[str, dict[str, np.ndarray]]:
    """Per layout: transformers' rows of SHORT as its processor pads them ("texts") and of the PIL images ("images"),
    sentence-transformers' encode of SHORT ("st texts"), of SHORT beside LONG ("st batch") and of the images
    ("st images")."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoProcessor, Siglip2Model

    images = [Image.open(io.BytesIO(data)) for data in image_files()]
    rows = {}
    for name in LAYOUTS:
        path = layouts[name]
        processor = AutoProcessor.from_pretrained(path)
        texts = processor(text=SHORT, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
        pixels = processor(images=images, return_tensors="pt")
        model = Siglip2Model.from_pretrained(path).eval()
        with torch.no_grad():
            own = {"texts": model.get_text_features(**texts).pooler_output.numpy(),
                   "images": model.get_image_features(**pixels).pooler_output.numpy()}  # fmt: skip
        st = SentenceTransformer(str(path), device="cpu")
        rows[name] = {**own, "st texts": st.encode(SHORT), "st batch": st.encode([*SHORT, LONG]),
                      "st images": st.encode(images)}  # fmt: skip
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
def test_texts_and_images_match_transformers_and_sentence_transformers(server, reference, layout: str) -> None:
    client, dtype = server
    model = f"tiny-siglip2-{layout}"
    texts = response_rows(client.post("/v1/embeddings", json={"model": model, "input": SHORT}))
    inputs = [base64.b64encode(data).decode() for data in image_files()]
    images = response_rows(client.post("/embeddings_image", json={"model": model, "input": inputs}))
    assert_close(texts, reference[layout]["texts"], dtype)
    assert_close(images, reference[layout]["st images"], dtype)
    assert_close(images, reference[layout]["images"], dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_texts_equal_sentence_transformers_where_its_padding_reaches_max_length(server, reference, layout: str) -> None:
    client, dtype = server
    assert_st_rows_where_padding_reaches_max_length(
        client,
        reference[layout],
        f"tiny-siglip2-{layout}",
        SHORT,
        LONG,
        dtype,
        pads_to_max_length=layout == "max-length",
    )


def test_the_load_says_once_when_sentence_transformers_pads_otherwise(layouts: dict[str, Path], caplog) -> None:
    expected = {"st": 1, "clip-module": 1, "max-length": 0, "hf": 0}
    assert_load_warnings(layouts, expected, WARNING, "Siglip2Model", caplog)


@pytest.mark.parametrize("settings", [{"max_num_patches": 128}, {"patch_size": 8}, {"max_num_patches": 1024}])
def test_image_settings_sentence_transformers_would_not_use_are_refused(tmp_path: Path, layouts, settings) -> None:
    """Siglip2Processor's call preprocesses at patch 16 into at most 256 patches whatever the saved image processor
    says, so a directory saying otherwise is refused naming the settings; its transformers layout still loads."""
    model = tmp_path / "model"
    shutil.copytree(layouts["st"], model)
    processor = model / PROCESSOR_FILE
    config = json.loads(processor.read_text())
    processor.write_text(json.dumps({**config, "image_processor": {**config["image_processor"], **settings}}))
    with pytest.raises(ValueError, match=r"not what sentence-transformers preprocesses") as refused:
        read_st_layout(model)
    assert str(model) in str(refused.value) and repr(settings)[1:-1] in str(refused.value)
    for name in ("config_sentence_transformers.json", "modules.json", "sentence_bert_config.json"):
        (model / name).unlink()
    assert not read_st_layout(model).model_pools
