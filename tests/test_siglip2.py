"""SigLIP 2 (transformers' Siglip2Model, NaFlex) against transformers' own `get_text_features` and
`get_image_features`, on a tiny random-weight model saved by `save_pretrained` with its image processor's config:
images of several sizes and aspect ratios through transformers' own processor (max_num_patches 48, not its 256), so
their grids differ in rows, columns and patch count, some narrower than the 8 x 8 position table (shrunk, with
antialiasing) and some wider (grown); each image its own sequence, no padding, several in one step; texts of several
lengths; and steps that mix texts and images."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import row_cosines
from siglip2_models import PAD_ID, image, image_features, processed, save_siglip2, text_features

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.models.siglip2_vision import antialias_weights
from bouquet.text_padding import TextPadding, read_text_padding

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
SIZES = [(50, 80), (300, 120), (32, 32), (17, 9), (9, 300), (640, 480)]  # (width, height)


@pytest.fixture(scope="module")
def siglip2(tmp_path_factory, minilm_path: Path) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("siglip2") / "hf"
    return path, save_siglip2(path, minilm_path)


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, siglip2) -> Iterator[Engine]:
    engine = Engine(EngineConfig(model_path=siglip2[0], device="cpu", dtype=request.param, cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def reference(siglip2) -> tuple[Batch, np.ndarray]:
    """The images as transformers' processor patches them, each a sequence of its own, and transformers' rows for
    them (its padded batch with pixel_attention_mask)."""
    path, model = siglip2
    patches, grids, inputs = processed(path, [image(w, h, seed) for seed, (w, h) in enumerate(SIZES)])
    return Batch.pack_image_sequences(np.concatenate(patches), grids), image_features(model, inputs)


def _texts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(1000, 30000, (n,), generator=generator).tolist() for n in (1, 9, 64, 30, 4)]


def _assert_close(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    print(f"min cosine {cosines.min():.7f}")  # shown with -rP
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.7f} per row {np.round(cosines, 6)}"


def test_the_images_make_grids_of_every_kind(reference) -> None:
    """What the other tests rely on: rows and columns on both sides of the table's 8, several patch counts."""
    grids = reference[0].image_grid_thw
    assert (grids[:, 1] < 8).any() and (grids[:, 1] > 8).any() and (grids[:, 2] < 8).any() and (grids[:, 2] > 8).any()
    assert len(set(grids.prod(1).tolist())) >= 4 and grids.prod(1).max() <= 48


def test_images_of_several_sizes_in_one_step_match_transformers(engine: Engine, reference) -> None:
    batch, expected = reference
    assert engine.image_patches == (3 * 8 * 8, 1, -1, True, 16384) and engine.image_tokens == 0
    _assert_close(engine.embed(batch), expected, engine.config.dtype)


def test_texts_match_transformers_as_its_processor_pads_them(engine: Engine, siglip2) -> None:
    """Padded to 64 (Siglip2Processor's max_length, whatever the tokenizer's model_max_length) with the tokenizer's
    pad token and its attention mask, pooled at the last position (a pad): unpadded rows would be far off (the last
    check)."""
    texts = _texts()
    assert engine.dimension == 64 and engine.max_seq_length == 64
    assert engine.runner.model.text_padding == TextPadding(PAD_ID, masked=True, max_length=512)
    rows = engine.embed(Batch.pack(texts))
    _assert_close(rows, text_features(siglip2[1], texts), engine.config.dtype)
    with torch.no_grad():
        unpadded = siglip2[1].get_text_features(input_ids=torch.tensor([texts[1]])).pooler_output.numpy()
    assert row_cosines(rows[1:2], unpadded)[0] < 0.99


def test_texts_of_a_tokenizer_without_an_attention_mask_attend_to_their_pads(tmp_path: Path, siglip2) -> None:
    """A tokenizer config that gives input_ids alone (as SigLIP's own do): the pads are keys, every text runs at 64
    tokens, as transformers runs the processor's output."""
    path, model = siglip2
    shutil.copytree(path, tmp_path / "hf")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({**config, "model_input_names": ["input_ids"]}))
    engine = Engine(EngineConfig(model_path=tmp_path / "hf", device="cpu", dtype="float32", cpu_warmup_tokens=0))
    try:
        assert engine.runner.model.text_padding == TextPadding(PAD_ID, masked=False, max_length=512)
        texts = _texts()
        _assert_close(engine.embed(Batch.pack(texts)), text_features(model, texts, masked=False), "float32")
    finally:
        engine.close()
    assert read_text_padding(path) == TextPadding(PAD_ID, masked=True, max_length=512)
    (tmp_path / "hf" / "tokenizer_config.json").write_text(json.dumps({**config, "pad_token": None}))
    (tmp_path / "hf" / "special_tokens_map.json").unlink()
    assert read_text_padding(tmp_path / "hf") is None  # no pad token: texts run as sent


def test_a_step_mixing_texts_and_images_gives_each_its_own_row(engine: Engine, siglip2, reference) -> None:
    """Texts around images in one step (each tower on its own sequences): every row as transformers', in order."""
    images, expected_images = reference
    texts = _texts()
    expected_texts = text_features(siglip2[1], texts)
    step = Batch.concat([Batch.pack(texts[:2]), images.slice(0, 3), Batch.pack(texts[2:]), images.slice(3, 6)])
    assert step.image_sequences and step.budget_tokens == step.num_tokens  # an image counts its patches, once
    rows = engine.embed(step)
    expected = np.concatenate([expected_texts[:2], expected_images[:3], expected_texts[2:], expected_images[3:]])
    _assert_close(rows, expected, engine.config.dtype)
    texts_alone = step.slice(0, 2)  # a step may take a request's texts alone: images of none
    assert texts_alone.image_grid_thw is not None and not len(texts_alone.image_grid_thw)
    _assert_close(engine.embed(texts_alone), expected_texts[:2], engine.config.dtype)


def test_the_resized_position_table_is_torchs_antialiased_bilinear() -> None:
    """The closed-form weights against F.interpolate itself, shrinking and growing each axis."""
    table = torch.randn(1, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    for rows, columns in [(3, 16), (8, 8), (1, 34), (13, 5)]:
        expected = F.interpolate(table, size=(rows, columns), mode="bilinear", align_corners=False, antialias=True)
        weights_rows, weights_columns = (
            antialias_weights(rows, 8, table.device),
            antialias_weights(columns, 8, table.device),
        )
        resized = torch.einsum("ri,bdij,cj->bdrc", weights_rows, table, weights_columns)
        torch.testing.assert_close(resized, expected, rtol=1e-5, atol=1e-5)


def test_images_that_do_not_fill_their_sequences_are_refused(engine: Engine, reference) -> None:
    """The engine's own check (the replica checks first: test_siglip2_wire.py)."""
    images = reference[0].slice(0, 2)
    cut = Batch.from_packed(np.zeros(images.num_tokens, np.int32), np.array([0, 10, images.num_tokens], np.int32))
    shifted = cut.with_patch_images(images.pixel_values, images.image_grid_thw, [1, 1])
    with pytest.raises(ValueError, match="a sequence of its own"):
        engine.embed(shifted)
