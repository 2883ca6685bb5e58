"""SigLIP 2's text length against transformers 5: its Siglip2Processor pads and cuts every text at 64 tokens (the
class's text_kwargs), whatever the tokenizer's `model_max_length` or the position table say, in the call SigLIP 2's
docs show (`padding="max_length", max_length=64, truncation=True`), in a call naming nothing, and in
sentence-transformers' (which names no length and sets `model_max_length` from its `max_seq_length`). Served over
the gateway (in-process, ASGI) against `get_text_features` on both calls' inputs (float32 cosine >= 0.99999), on a
tiny random-weight Siglip2Model saved with its Siglip2Processor and a real Siglip2Tokenizer, its tokenizer_config.json
setting `model_max_length` 32 ("short") or 128 ("long"), or 80 text positions ("positions"); and sentence-transformers'
own save of "short" (its max_seq_length 32) against its `encode` of a batch padded to 64.

What transformers cannot run or reads two ways is refused at load: fewer than 64 positions (its forward raises), and
a `max_length` or `padding` in tokenizer_config.json, which a call naming none takes over the class's 64 while the
documented call does not."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from in_process import engines, served
from siglip2_models import save_siglip2_processor

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

BOUND = 0.99999
MIDDLE = "an old map of Paris and London " * 4  # between 32 and 64 tokens
LONG = "an old map of Paris and London " * 8  # over 80
TEXTS = ["A Photo of a Cat", "two dogs playing in the snow", MIDDLE, LONG]
SERVED = ("short", "long", "positions", "st-short")
DOCUMENTED = {"padding": "max_length", "max_length": 64, "truncation": True}


def _set_tokenizer_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    from sentence_transformers import SentenceTransformer

    root = tmp_path_factory.mktemp("siglip2-text-length")
    save_siglip2_processor(root / "base")
    save_siglip2_processor(root / "positions", positions=80)
    for name, length in (("short", 32), ("long", 128)):
        shutil.copytree(root / "base", root / name)
        _set_tokenizer_config(root / name, model_max_length=length)
    SentenceTransformer(str(root / "short"), device="cpu").save(str(root / "st-short"))
    return {name: root / name for name in ("base", *SERVED)}


@pytest.fixture(scope="module")
def client(models: dict[str, Path]) -> Iterator:
    with engines(*(models[name] for name in SERVED)) as built, served(built) as running:
        yield running.client


def transformers_rows(path: Path, **settings: object) -> np.ndarray:
    """get_text_features on what the processor saved at `path` gives TEXTS with `settings`."""
    from transformers import AutoProcessor, Siglip2Model

    inputs = AutoProcessor.from_pretrained(path)(text=TEXTS, return_tensors="pt", **settings)
    assert inputs["input_ids"].shape == (len(TEXTS), 64)
    with torch.no_grad():
        return Siglip2Model.from_pretrained(path).eval().get_text_features(**inputs).pooler_output.numpy()


def test_the_texts_span_the_lengths_that_matter(models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(models["base"])(TEXTS)["input_ids"]]
    assert lengths[2] in range(33, 64) and lengths[3] > 80, lengths


@pytest.mark.parametrize("name", SERVED[:3])
def test_texts_are_cut_and_padded_at_64_as_transformers_does(client, models: dict[str, Path], name: str) -> None:
    answer = client.post("/v1/embeddings", json={"model": name, "input": TEXTS})
    assert answer.status_code == 200, answer.text
    rows = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
    for settings in (DOCUMENTED, {}):
        cosines = row_cosines(rows, transformers_rows(models[name], **settings))
        assert cosines.min() >= BOUND, (settings, np.round(cosines, 6))


def test_sentence_transformers_max_seq_length_does_not_cut_texts(client, models: dict[str, Path]) -> None:
    """Its save of "short" keeps max_seq_length 32, yet its processor call cuts at 64: a batch holding a text over 64
    tokens is padded to 64, where its rows are transformers' padded ones."""
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(models["st-short"]), device="cpu")
    assert st.max_seq_length == 32
    answer = client.post("/v1/embeddings", json={"model": "st-short", "input": TEXTS})
    assert answer.status_code == 200, answer.text
    rows = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
    cosines = row_cosines(rows, st.encode(TEXTS))
    assert cosines.min() >= BOUND, np.round(cosines, 6)


@pytest.mark.parametrize(
    ("change", "refusal"),
    [({"max_length": 32}, "{'max_length': 32} makes transformers' processor"),
     ({"padding": "longest"}, "{'padding': 'longest'} makes transformers' processor")],
)  # fmt: skip
def test_a_saved_call_setting_the_documented_call_overrides_is_refused(
    tmp_path: Path, models: dict[str, Path], change: dict, refusal: str
) -> None:
    """transformers' two calls give other inputs for such a directory (what the refusal says), so bouquet refuses
    it rather than serve one of them."""
    from transformers import AutoProcessor

    path = tmp_path / "model"
    shutil.copytree(models["base"], path)
    _set_tokenizer_config(path, **change)
    processor = AutoProcessor.from_pretrained(path)
    plain, documented = (processor(text=TEXTS[:2], **settings)["input_ids"] for settings in ({}, DOCUMENTED))
    assert plain != documented
    with pytest.raises(ValueError, match=r"tokenizer_config\.json") as error:
        Engine(EngineConfig(path, "cpu", "float32", cpu_warmup_tokens=0))
    assert refusal in str(error.value) and "max_length=64" in str(error.value)


def test_fewer_positions_than_the_processor_pads_to_is_refused(tmp_path: Path) -> None:
    from transformers import AutoProcessor, Siglip2Model

    save_siglip2_processor(tmp_path, positions=48)
    inputs = AutoProcessor.from_pretrained(tmp_path)(text=TEXTS[:1], return_tensors="pt")
    with pytest.raises(ValueError, match="max_position_embeddings"), torch.no_grad():
        Siglip2Model.from_pretrained(tmp_path).get_text_features(**inputs)
    with pytest.raises(ValueError, match="max_position_embeddings 48 is fewer than the 64 tokens"):
        Engine(EngineConfig(tmp_path, "cpu", "float32", cpu_warmup_tokens=0))
