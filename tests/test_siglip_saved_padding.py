"""SigLIP (v1) whose tokenizer was built with the call settings SigLIP was trained with (`padding="max_length"`,
`max_length`, `truncation=True`): transformers 5 keeps them in tokenizer_config.json, and SiglipProcessor's call then
takes them (its class has no text settings of its own: it pads and cuts at the saved `max_length`), while the
tokenizer's own call, as SigLIP's docs show it, pads to its `model_max_length`. A tiny random-weight SiglipModel
(test_siglip.py) saved with SiglipProcessor.save_pretrained and a real SiglipTokenizer (test_siglip_tokenizer.py):
- "saved-64": max_length 64 = model_max_length, as transformers 5 saves it (an attention mask given: pads masked);
- "keys-32": max_length 32 = model_max_length 32 under 64 positions, input_ids alone (pads are keys, as in the
  released checkpoints' files): every pad up to 32 is in the answer;
- "st-keys-32": sentence-transformers' save of "keys-32" with processing_kwargs padding "max_length".
Texts of mixed lengths, one over max_length, in one request, served (ASGI) against transformers' `get_text_features`
on what each call gives (the processor's documented and plain calls, the tokenizer's documented call) and against
sentence-transformers' `encode` (float32 cosine >= 0.99999). A saved max_length other than model_max_length is two
readings in transformers (the processor's and the tokenizer's), and is refused: saved so, and as sentence-transformers
saves "saved-64" with a max_seq_length of 32 (its model_max_length 32; the processor still pads at 64)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from family_models import TOKENIZER_FILES
from in_process import engines, served
from test_siglip import save_siglip
from test_siglip_tokenizer import train_spiece

from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

BOUND = 0.99999
TEXTS = [
    "a photo of a cat", "Two dogs -- running (fast) on the beach", "Return a new string object " * 9,
    "Return a new string object " * 20,  # over 64 tokens: cut at max_length
]  # fmt: skip
SERVED = {"saved-64": 64, "keys-32": 32, "st-keys-32": 32}  # each model's max_length


def save_with_settings(path: Path, minilm_path: Path, spiece: Path, max_length: int, **settings: object) -> None:
    """The tiny SigLIP at `path` with a SiglipTokenizer built with SigLIP's call settings, saved by SiglipProcessor."""
    from transformers import SiglipImageProcessor, SiglipProcessor, SiglipTokenizer

    save_siglip(path, minilm_path)  # the same weights each time
    for name in TOKENIZER_FILES:
        (path / name).unlink()  # MiniLM's, which save_siglip put beside the model
    tokenizer = SiglipTokenizer(
        vocab_file=str(spiece), padding="max_length", max_length=max_length, truncation=True, **settings
    )
    images = SiglipImageProcessor(size={"height": 32, "width": 32})
    SiglipProcessor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)


def edit_tokenizer_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, **changes}))


@pytest.fixture(scope="module")
def models(tmp_path_factory, minilm_path: Path) -> dict[str, Path]:
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer

    root = tmp_path_factory.mktemp("siglip-saved-padding")
    spiece = train_spiece(root / "spiece.model")
    paths = {name: root / name for name in (*SERVED, "st-cut-32", "saved-24")}
    save_with_settings(paths["saved-64"], minilm_path, spiece, 64)
    save_with_settings(paths["keys-32"], minilm_path, spiece, 32, model_max_length=32)
    edit_tokenizer_config(paths["keys-32"], model_input_names=["input_ids"])
    padded = Transformer(str(paths["keys-32"]), processing_kwargs={"text": {"padding": "max_length"}})
    SentenceTransformer(modules=[padded], device="cpu").save(str(paths["st-keys-32"]))
    cut = SentenceTransformer(str(paths["saved-64"]), device="cpu")
    cut.max_seq_length = 32
    cut.save(str(paths["st-cut-32"]))
    save_with_settings(paths["saved-24"], minilm_path, spiece, 24)
    return paths


@pytest.fixture(scope="module")
def client(models: dict[str, Path]) -> Iterator:
    with engines(*(models[name] for name in SERVED)) as built, served(built) as running:
        yield running.client


def text_features(path: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    from transformers import SiglipModel

    with torch.no_grad():
        return SiglipModel.from_pretrained(path).eval().get_text_features(**inputs).pooler_output.numpy()


def transformers_inputs(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """TEXTS as each call transformers' docs show (and a call naming nothing) makes them from what `path` saved."""
    from transformers import AutoProcessor, AutoTokenizer

    processor, tokenizer = AutoProcessor.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return {
        "processor, documented": processor(text=TEXTS, padding="max_length", return_tensors="pt"),
        "processor, plain": processor(text=TEXTS, return_tensors="pt"),
        "tokenizer, documented": tokenizer(TEXTS, padding="max_length", truncation=True, return_tensors="pt"),
    }


def served_rows(client, model: str) -> np.ndarray:
    answer = client.post("/v1/embeddings", json={"model": model, "input": TEXTS})
    assert answer.status_code == 200, answer.text
    return np.array([item["embedding"] for item in answer.json()["data"]], np.float32)


def test_the_texts_span_the_lengths_that_matter(models: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    lengths = [len(ids) for ids in AutoTokenizer.from_pretrained(models["saved-64"])(TEXTS)["input_ids"]]
    assert lengths[0] < lengths[1] < 32 < lengths[2] < 64 < lengths[3], lengths


@pytest.mark.parametrize("name", SERVED)
def test_texts_match_every_call_transformers_documents(client, models: dict[str, Path], name: str) -> None:
    rows = served_rows(client, name)
    for call, inputs in transformers_inputs(models[name]).items():
        assert inputs["input_ids"].shape == (len(TEXTS), SERVED[name]), call
        cosines = row_cosines(rows, text_features(models[name], inputs))
        assert cosines.min() >= BOUND, (call, np.round(cosines, 6))


def test_texts_match_sentence_transformers_padding_to_max_length(client, models: dict[str, Path]) -> None:
    from sentence_transformers import SentenceTransformer

    rows = served_rows(client, "st-keys-32")
    cosines = row_cosines(rows, SentenceTransformer(str(models["st-keys-32"]), device="cpu").encode(TEXTS))
    assert cosines.min() >= BOUND, np.round(cosines, 6)


def test_the_padded_length_is_in_the_rows(client, models: dict[str, Path]) -> None:
    """What the tests above rest on: with pads as keys, the rows of texts padded to 64 rather than 32 are far off."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(models["keys-32"])
    inputs = tokenizer(TEXTS, padding="max_length", max_length=64, truncation=True, return_tensors="pt")
    cosines = row_cosines(served_rows(client, "keys-32"), text_features(models["keys-32"], inputs))
    assert cosines[:2].max() < 0.99, np.round(cosines, 6)


@pytest.mark.parametrize(("name", "saved", "model_max_length"), [("saved-24", 24, 64), ("st-cut-32", 64, 32)])
def test_a_saved_max_length_other_than_model_max_length_is_refused(
    models: dict[str, Path], name: str, saved: int, model_max_length: int
) -> None:
    """The processor pads to the saved max_length, the tokenizer to model_max_length (transformers' two readings,
    which the refusal names)."""
    inputs = transformers_inputs(models[name])
    assert inputs["processor, documented"]["input_ids"].shape[1] == saved
    assert inputs["tokenizer, documented"]["input_ids"].shape[1] == model_max_length
    with pytest.raises(ValueError, match=r"tokenizer_config\.json") as refused:
        Engine(EngineConfig(models[name], "cpu", "float32", cpu_warmup_tokens=0))
    said = str(refused.value)
    assert f"max_length {saved} makes transformers' processor" in said, said
    assert f"pads them to model_max_length {model_max_length}" in said, said
