"""CLIP in the layouts sentence-transformers saves, served over real HTTP (loopback) against sentence-transformers'
own `encode` of texts and of PIL images (float32 cosine >= 0.99999, bfloat16 >= 0.999), images of sizes other than
the processor's.

A tiny random-weight CLIPModel is saved by transformers with its CLIPProcessor, which transformers 5 writes as
processor_config.json, the image processor's settings nested inside (no preprocessor_config.json); then:
- "st": sentence-transformers' own save of it (5.4+: one multimodal Transformer module at the root);
- "clip-module": its deprecated CLIPModel module saved as the installed version saves it;
- "hub": the layout 2.x-5.3 saved and the hub's CLIP models have (`0_CLIPModel`, no sentence_bert_config.json, the
  image processor alone in preprocessor_config.json).
None has a Normalize module: sentence-transformers gives raw rows, and so does bouquet by default."""

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
from st_image_checks import assert_close, image_files, response_rows
from test_clip import _clip, _save

from bouquet.image_processor_file import read_image_processor_json
from bouquet.st_layout import read_st_layout

LAYOUTS = ("st", "clip-module", "hub")
TEXTS = ["a photo of a cat", "two dogs playing in the snow near a red house", "x", "an empty room at night"]


def _image_processor():
    from transformers import CLIPImageProcessor

    return CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})


def _hub_layout(hf: Path, out: Path) -> None:
    """What sentence-transformers 2.x-5.3 saved: modules.json naming `sentence_transformers.models.CLIPModel` in
    `0_CLIPModel`, the model and tokenizer there, and the image processor's preprocessor_config.json."""
    folder = out / "0_CLIPModel"
    shutil.copytree(hf, folder, ignore=shutil.ignore_patterns("processor_config.json"))
    _image_processor().save_pretrained(folder)
    module = {"idx": 0, "name": "0", "path": "0_CLIPModel", "type": "sentence_transformers.models.CLIPModel"}
    (out / "modules.json").write_text(json.dumps([module]))


@pytest.fixture(scope="module")
def layouts(tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import CLIPModel
    from transformers import AutoTokenizer, CLIPProcessor

    root = tmp_path_factory.mktemp("clip-st")
    hf = root / "hf"
    _save(_clip(eos_token_id=102), hf, minilm_path)
    CLIPProcessor(image_processor=_image_processor(), tokenizer=AutoTokenizer.from_pretrained(hf)).save_pretrained(hf)
    assert (hf / "processor_config.json").is_file() and not (hf / "preprocessor_config.json").exists()
    paths = {name: root / f"tiny-clip-{name}" for name in LAYOUTS}
    SentenceTransformer(str(hf), device="cpu").save(str(paths["st"]))
    SentenceTransformer(modules=[CLIPModel(str(hf))], device="cpu").save(str(paths["clip-module"]))
    _hub_layout(hf, paths["hub"])
    return paths


@pytest.fixture(scope="module")
def reference(layouts: dict[str, Path]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Each layout's rows as sentence-transformers loads and encodes it: (texts, images)."""
    from sentence_transformers import SentenceTransformer

    images = [Image.open(io.BytesIO(data)) for data in image_files()]
    rows = {}
    for name, path in layouts.items():
        model = SentenceTransformer(str(path), device="cpu")
        rows[name] = (model.encode(TEXTS, convert_to_numpy=True), model.encode(images, convert_to_numpy=True))
    return rows


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def server(request, layouts: dict[str, Path]) -> Iterator[tuple[httpx.Client, str]]:
    with (
        engines(*layouts.values(), dtype=request.param) as built,
        served(built, listen=True) as running,
        httpx.Client(base_url=running.url, timeout=120) as client,
    ):
        yield client, request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_texts_and_images_match_sentence_transformers_encode(server, reference, layout: str) -> None:
    client, dtype = server
    model = f"tiny-clip-{layout}"
    texts = response_rows(client.post("/v1/embeddings", json={"model": model, "input": TEXTS}))
    inputs = [base64.b64encode(data).decode() for data in image_files()]
    images = response_rows(client.post("/embeddings_image", json={"model": model, "input": inputs}))
    expected_texts, expected_images = reference[layout]
    assert_close(texts, expected_texts, dtype)
    assert_close(images, expected_images, dtype)


def test_each_layout_is_read_as_a_model_that_pools_itself(layouts: dict[str, Path]) -> None:
    for name, path in layouts.items():
        layout = read_st_layout(path)
        assert layout.model_pools and layout.pooling is None and layout.normalize is False, name
        assert layout.transformer_dir == (path / "0_CLIPModel" if name == "hub" else path)


def test_processor_config_nests_the_image_processor_and_wins_as_in_transformers(tmp_path: Path) -> None:
    """transformers reads the nested settings first; preprocessor_config.json alone is read as it is; neither:
    none."""
    assert read_image_processor_json(tmp_path) == ""
    _image_processor().save_pretrained(tmp_path)
    alone = (tmp_path / "preprocessor_config.json").read_text()
    assert read_image_processor_json(tmp_path) == alone
    nested = {**json.loads(alone), "crop_size": {"height": 24, "width": 24}}
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_processor": nested, "processor_class": "x"}))
    assert json.loads(read_image_processor_json(tmp_path)) == nested
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "CLIPProcessor"}))
    assert read_image_processor_json(tmp_path) == alone  # a processor config from before transformers nested it


def _edit(path: Path, change) -> None:
    path.write_text(json.dumps(change(json.loads(path.read_text()))))


_POOLING = {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
_REFUSED = [
    ("config.json", lambda c: {**c, "architectures": ["BertModel"]}, "for BertModel; bouquet runs those of CLIPModel"),
    ("sentence_bert_config.json", lambda c: {**c, "modality_config": {"text": {"method": "forward"}}},
     "modality 'text' through 'forward'"),
    ("modules.json", lambda m: [*m, _POOLING], "expected Dense or Normalize"),
]  # fmt: skip


@pytest.mark.parametrize(("file", "change", "words"), _REFUSED)
def test_what_bouquet_cannot_run_as_sentence_transformers_would_is_refused(
    tmp_path: Path, layouts: dict[str, Path], file: str, change, words: str
) -> None:
    model = tmp_path / "model"
    shutil.copytree(layouts["st"], model)
    _edit(model / file, change)
    with pytest.raises(ValueError, match="not supported") as refused:
        read_st_layout(model)
    assert words in str(refused.value)
