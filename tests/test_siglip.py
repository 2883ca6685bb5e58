"""SigLIP (transformers' SiglipModel) against transformers' own `get_text_features` and `get_image_features`, on a
tiny random-weight model saved by `save_pretrained` beside the MiniLM tokenizer, its files as a released SigLIP's are
(input_ids alone, `model_max_length` 64, no export-time padding): texts of several lengths packed in one step against
the tokenizer called with `padding="max_length"`, as SigLIP's docs ask (pooled at the last position, a pad for any
shorter text; with the tokenizer's attention mask when its config gives one; to a `model_max_length` shorter than
the position table), and the unpadded rows shown far off; several images in another step (the MAP head)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from family_models import TOKENIZER_FILES, spread_weights

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.text_padding import TextPadding
from bouquet.tokenizer import TextTokenizer

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
IMAGE_SIZE, PATCH = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2
PAD_ID = 0  # the MiniLM tokenizer's [PAD]
TEXTS = [
    "a", "a photo of a cat", "two dogs running on a beach at noon, one of them brown", "a diagram " * 40,
    "the quick brown fox jumps over the lazy dog " * 3,
]  # fmt: skip


def save_siglip(
    path: Path,
    tokenizer_dir: Path,
    projection_size: int = 64,
    attention_mask: bool = False,
    model_max_length: int = 64,
):
    """A tiny random-weight SiglipModel saved at `path` beside the MiniLM tokenizer; the model, in eval mode. Its
    image rows are as wide as the vision tower (64); text rows as `projection_size` (a real SigLIP's are equal, and
    bouquet refuses one whose are not). The tokenizer as a released SigLIP's gives input_ids alone, unless
    `attention_mask`."""
    from transformers import SiglipConfig, SiglipModel

    tower = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = SiglipConfig(
        text_config=dict(tower, vocab_size=30522, max_position_embeddings=64, projection_size=projection_size),
        vision_config=dict(tower, image_size=IMAGE_SIZE, patch_size=PATCH),
    )
    model = SiglipModel(config)
    spread_weights(model, seed=0, scale=0.3)
    with torch.no_grad():  # patches of 192 pixels at std 1 would drown the position embeddings
        model.vision_model.embeddings.patch_embedding.weight.mul_(0.1)
        model.vision_model.head.probe.mul_(3.0)  # a probe far from the keys' scale makes the MAP head's weights peak
    model.save_pretrained(path)
    save_tokenizer(path, tokenizer_dir, attention_mask, model_max_length)
    return model.eval()


def save_tokenizer(path: Path, tokenizer_dir: Path, attention_mask: bool, model_max_length: int) -> None:
    """The MiniLM tokenizer's files with a SigLIP tokenizer's settings: no padding or truncation saved in
    tokenizer.json, `model_max_length`, and `model_input_names` input_ids alone (transformers' conversion of SigLIP
    saves it so) unless `attention_mask`."""
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    (path / "tokenizer.json").write_text(json.dumps({**tokenizer, "truncation": None, "padding": None}))
    config = {**json.loads((path / "tokenizer_config.json").read_text()), "model_max_length": model_max_length}
    if not attention_mask:
        config["model_input_names"] = ["input_ids"]
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def padded_text_features(path: Path, model: torch.nn.Module, texts: list[str]) -> np.ndarray:
    """What a user of transformers gets: the saved tokenizer called with `padding="max_length"` (to its
    model_max_length; an attention_mask if its config gives one), through `get_text_features`."""
    from transformers import AutoTokenizer

    inputs = AutoTokenizer.from_pretrained(path)(texts, padding="max_length", truncation=True, return_tensors="pt")
    with torch.no_grad():
        return model.get_text_features(**inputs).pooler_output.numpy()


def unpadded_text_features(model: torch.nn.Module, texts: list[list[int]]) -> np.ndarray:
    """transformers' rows for the texts as sent, one a forward: not what SigLIP was trained on."""
    with torch.no_grad():
        return torch.cat(
            [model.get_text_features(input_ids=torch.tensor([ids])).pooler_output for ids in texts]
        ).numpy()


@pytest.fixture(scope="module")
def siglip(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("siglip") / "hf"
    return path, save_siglip(path, minilm_path)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, siglip) -> Iterator[Engine]:
    engine = Engine(EngineConfig(model_path=siglip[0], device="cpu", dtype=request.param, cpu_warmup_tokens=0))
    yield engine
    engine.close()


def _engine(path: Path) -> Engine:
    return Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))


def _ids(path: Path, limit: int) -> list[list[int]]:
    """The texts as the gateway tokenizes them (bouquet's own tokenizer, truncated at the model's limit)."""
    return TextTokenizer(path / "tokenizer.json", max_length=limit).encode(TEXTS)


def _images(count: int) -> np.ndarray:  # [N, 3, S, S] float32
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)).numpy()


def _assert_close(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    print(f"min cosine {cosines.min():.7f}")  # shown with -rP
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.7f} per row {np.round(cosines, 6)}"


def test_texts_match_transformers_padded_to_max_length(engine: Engine, siglip) -> None:
    """A released SigLIP's tokenizer: input_ids alone, so the pads are keys like any token; every text at 64."""
    path, model = siglip
    assert engine.dimension == 64 and engine.max_seq_length == 64
    assert engine.runner.model.text_padding == TextPadding(PAD_ID, masked=False, max_length=64)
    ids = _ids(path, engine.max_seq_length)
    assert sorted(len(text) for text in ids) == [3, 7, 15, 29, 64]  # the long one cut at 64: no pad
    _assert_close(engine.embed(Batch.pack(ids)), padded_text_features(path, model, TEXTS), engine.config.dtype)


def test_unpadded_texts_are_far_from_what_transformers_gives_padded(engine: Engine, siglip) -> None:
    """What the parity tests rest on: rows of the texts as sent (the old reference) are far from the padded ones
    for every text shorter than 64, so serving them unpadded would fail those tests; a full text is the same."""
    path, model = siglip
    ids = _ids(path, engine.max_seq_length)
    cosines = row_cosines(engine.embed(Batch.pack(ids)), unpadded_text_features(model, ids))
    print(f"cosines to the unpadded rows {np.round(cosines, 4)}")  # shown with -rP
    short = np.array([len(text) < 64 for text in ids])
    assert cosines[short].max() < 0.99 and cosines[~short].min() >= BOUNDS[engine.config.dtype]


def test_image_features_match_transformers(engine: Engine, siglip) -> None:
    images = _images(3)
    with torch.no_grad():
        expected = siglip[1].get_image_features(pixel_values=torch.from_numpy(images)).pooler_output.numpy()
    _assert_close(engine.embed(Batch.pack_images(images, IMAGE_TOKENS)), expected, engine.config.dtype)


def test_a_tokenizer_with_an_attention_mask_masks_its_pads(tmp_path: Path, siglip, minilm_path: Path) -> None:
    """A tokenizer config that names no model_input_names gives an attention mask: pads are never keys, so one pad
    at the last position stands for them all; transformers' rows with and without that mask differ."""
    path, model = siglip
    shutil.copytree(path, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf", minilm_path, attention_mask=True, model_max_length=64)
    engine = _engine(tmp_path / "hf")
    try:
        assert engine.runner.model.text_padding == TextPadding(PAD_ID, masked=True, max_length=64)
        rows = engine.embed(Batch.pack(_ids(path, 64)))
    finally:
        engine.close()
    expected = padded_text_features(tmp_path / "hf", model, TEXTS)
    _assert_close(rows, expected, "float32")
    assert row_cosines(expected, padded_text_features(path, model, TEXTS))[:3].max() < 0.99


def test_texts_are_padded_to_the_tokenizers_model_max_length(tmp_path: Path, siglip, minilm_path: Path) -> None:
    """A model_max_length of 32 under a 64-position table: texts cut and padded at 32, as transformers' tokenizer
    does; without a pad token, texts run as sent (transformers cannot pad them)."""
    path, model = siglip
    shutil.copytree(path, tmp_path / "hf")
    save_tokenizer(tmp_path / "hf", minilm_path, attention_mask=False, model_max_length=32)
    engine = _engine(tmp_path / "hf")
    try:
        assert engine.max_seq_length == 32 and engine.runner.model.text_length == 32
        rows = engine.embed(Batch.pack(_ids(path, 32)))
    finally:
        engine.close()
    _assert_close(rows, padded_text_features(tmp_path / "hf", model, TEXTS), "float32")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        named = json.loads((tmp_path / "hf" / name).read_text())
        (tmp_path / "hf" / name).write_text(
            json.dumps({key: value for key, value in named.items() if key != "pad_token"})
        )
    engine = _engine(tmp_path / "hf")
    try:
        assert engine.runner.model.text_padding is None
        ids = _ids(path, 32)
        _assert_close(engine.embed(Batch.pack(ids)), unpadded_text_features(model, ids), "float32")
    finally:
        engine.close()


def test_text_and_image_rows_of_different_widths_are_refused_at_load(tmp_path: Path, minilm_path: Path) -> None:
    """Text rows 48 wide and image rows 64 wide share no space (transformers' own logits fail on them): refused when
    the model loads, never served with one side's rows cut to the other's width."""
    model = save_siglip(tmp_path, minilm_path, projection_size=48)
    with torch.no_grad(), pytest.raises(RuntimeError):  # transformers cannot compare them either
        model(input_ids=torch.tensor([[5, 6]]), pixel_values=torch.from_numpy(_images(1)))
    with pytest.raises(ValueError, match=r"projection_size 48.*hidden_size 64.*differ in width"):
        Engine(EngineConfig(model_path=tmp_path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
