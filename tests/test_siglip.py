"""SigLIP (transformers' SiglipModel) against transformers' own `get_text_features` and `get_image_features`, on a
tiny random-weight model saved by `save_pretrained` beside the MiniLM tokenizer: texts of several lengths packed in
one step (pooled at each one's last token, bidirectional), several images in another (the MAP head)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from family_models import TOKENIZER_FILES, spread_weights

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
IMAGE_SIZE, PATCH = 32, 8
IMAGE_TOKENS = (IMAGE_SIZE // PATCH) ** 2


def save_siglip(path: Path, tokenizer_dir: Path, projection_size: int = 64):
    """A tiny random-weight SiglipModel saved at `path` beside the MiniLM tokenizer; the model, in eval mode. Its
    image rows are as wide as the vision tower (64); text rows as `projection_size` (a real SigLIP's are equal, and
    bouquet refuses one whose are not)."""
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
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


@pytest.fixture(scope="module")
def siglip(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("siglip") / "hf"
    return path, save_siglip(path, minilm_path)


def _texts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1000, 30000, (n,), generator=generator).tolist() for n in (1, 9, 64, 30, 4)]


def _images(count: int) -> np.ndarray:  # [N, 3, S, S] float32
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=torch.Generator().manual_seed(0)).numpy()


def _assert_close(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    print(f"min cosine {cosines.min():.7f}")  # shown with -rP
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.7f} per row {np.round(cosines, 6)}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_text_and_image_features_match_transformers(siglip, dtype: str) -> None:
    path, model = siglip
    texts, images = _texts(), _images(3)
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype=dtype, cpu_warmup_tokens=0))
    try:
        assert engine.dimension == 64 and engine.max_seq_length == 64
        text_rows = engine.embed(Batch.pack(texts))
        image_rows = engine.embed(Batch.pack_images(images, IMAGE_TOKENS))
    finally:
        engine.close()
    with torch.no_grad():
        expected_texts = torch.stack(
            [model.get_text_features(input_ids=torch.tensor([ids])).pooler_output[0] for ids in texts]
        ).numpy()
        expected_images = model.get_image_features(pixel_values=torch.from_numpy(images)).pooler_output.numpy()
    _assert_close(text_rows, expected_texts, dtype)
    _assert_close(image_rows, expected_images, dtype)


def test_text_and_image_rows_of_different_widths_are_refused_at_load(tmp_path: Path, minilm_path: Path) -> None:
    """Text rows 48 wide and image rows 64 wide share no space (transformers' own logits fail on them): refused when
    the model loads, never served with one side's rows cut to the other's width."""
    model = save_siglip(tmp_path, minilm_path, projection_size=48)
    with torch.no_grad(), pytest.raises(RuntimeError):  # transformers cannot compare them either
        model(input_ids=torch.tensor([[5, 6]]), pixel_values=torch.from_numpy(_images(1)))
    with pytest.raises(ValueError, match=r"projection_size 48.*hidden_size 64.*differ in width"):
        Engine(EngineConfig(model_path=tmp_path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
