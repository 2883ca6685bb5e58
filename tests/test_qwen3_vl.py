"""Qwen3-VL as an embedder (Qwen3-VL-Embedding) against transformers' own Qwen3VLModel forward, on a tiny
random-weight Qwen3VLForConditionalGeneration saved by `save_pretrained` with its image processor.

The pooling followed is Qwen3-VL-Embedding's own (its repository's `Qwen3VLEmbedder`, also what vLLM's pooling
runner does for it): the final hidden state of each sequence's last token, L2-normalised. Text-only sequences,
sequences with one image and with two of different sizes (none the processor's default; patches and grids from
transformers' processor) are packed in one step, so a wrong M-RoPE position, a deepstack feature added at the wrong
token, or an image's patches attending to another's move the rows far from the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from qwen3_vl_models import (
    IMAGE_TOKEN,
    VISION_END,
    VISION_START,
    image_tokens,
    images,
    preprocess,
    reference_rows,
    save_qwen3_vl,
)

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
SIZES = [(40, 24), (64, 48), (17, 90), (100, 33)]  # (width, height): none a multiple of the 16-pixel factor


@pytest.fixture(scope="module")
def qwen3_vl(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("qwen3_vl") / "hf"
    return path, save_qwen3_vl(path, minilm_path)


def _words(generator: torch.Generator, n: int) -> list[int]:
    return torch.randint(1000, 29000, (n,), generator=generator).tolist()


def _mixed_sequences(seed: int = 0):
    """Texts and images in one batch: (token sequences, per-sequence patches, per-sequence grids)."""
    generator = torch.Generator().manual_seed(seed)
    processed = [preprocess(picture) for picture in images(SIZES, seed)]
    layouts = [[], [0], [], [1, 2], [3], [0]]  # images per sequence, by index into SIZES
    sequences, patches, grids = [], [], []
    for index, layout in enumerate(layouts):
        ids = _words(generator, 3 + index)
        for image in layout:
            ids += [*image_tokens(processed[image][1]), *_words(generator, 2)]
        sequences.append(ids)
        patches.append([processed[image][0] for image in layout])
        grids.append([processed[image][1] for image in layout])
    sequences[2] = _words(generator, 1)  # a one-token text
    return sequences, patches, grids


def _batch(sequences, patches, grids) -> Batch:
    flat_patches = [p for seq in patches for p in seq]
    flat_grids = [g for seq in grids for g in seq]
    batch = Batch.pack(sequences)
    if not flat_grids:
        return batch
    return batch.with_patch_images(np.concatenate(flat_patches), np.stack(flat_grids), [len(g) for g in grids])


def _engine(path: Path, dtype: str, attention_backend: str = "auto") -> Engine:
    config = EngineConfig(
        model_path=path, device="cpu", dtype=dtype, attention_backend=attention_backend, cpu_warmup_tokens=0
    )
    return Engine(config)


def _assert_close(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    print(f"min cosine {cosines.min():.7f}")  # shown with -rP
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.7f} per row {np.round(cosines, 6)}"


def test_the_processor_gives_grids_of_several_sizes() -> None:
    grids = [tuple(preprocess(picture)[1]) for picture in images(SIZES)]
    assert len(set(grids)) == len(grids), grids  # every image its own grid, so token counts vary


@pytest.mark.parametrize(("dtype", "backend"), [("float32", "auto"), ("bfloat16", "auto"), ("float32", "sdpa")])
def test_texts_and_images_in_one_step_match_transformers(qwen3_vl, dtype: str, backend: str) -> None:
    path, model = qwen3_vl
    sequences, patches, grids = _mixed_sequences()
    engine = _engine(path, dtype, backend)
    try:
        assert engine.dimension == 64
        rows = engine.embed(_batch(sequences, patches, grids))
    finally:
        engine.close()
    _assert_close(rows, reference_rows(model, sequences, patches, grids), dtype)


def test_text_only_steps_match_transformers(qwen3_vl) -> None:
    """Text alone takes the decoder's path with plain positions (M-RoPE with three equal positions)."""
    path, model = qwen3_vl
    generator = torch.Generator().manual_seed(3)
    sequences = [_words(generator, n) for n in (5, 1, 60, 17)]
    engine = _engine(path, "float32")
    try:
        rows = engine.embed(Batch.pack(sequences))
    finally:
        engine.close()
    _assert_close(rows, reference_rows(model, sequences, [[]] * 4, [[]] * 4), "float32")


def test_a_step_sliced_and_joined_gives_the_same_rows(qwen3_vl) -> None:
    """Slicing a mixed batch by sequences carries each sequence's images along; the parts' rows are the whole's."""
    path, _ = qwen3_vl
    batch = _batch(*_mixed_sequences(seed=1))
    parts = [batch.slice(0, 2), batch.slice(2, 4), batch.slice(4, batch.num_seqs)]
    assert parts[1].image_grid_thw is not None and len(parts[1].image_grid_thw) == 2
    joined = Batch.concat(parts)
    np.testing.assert_array_equal(joined.pixel_values, batch.pixel_values)
    np.testing.assert_array_equal(joined.cu_images, batch.cu_images)
    engine = _engine(path, "float32")
    try:
        whole = engine.embed(batch)
        pieces = np.concatenate([engine.embed(part) for part in parts])
    finally:
        engine.close()
    assert row_cosines(whole, pieces).min() >= 0.999999


def test_images_that_do_not_fill_their_tokens_are_refused(qwen3_vl) -> None:
    path, _ = qwen3_vl
    patches, grid = preprocess(images([(40, 24)])[0])
    engine = _engine(path, "float32")
    try:
        short = [5, VISION_START, IMAGE_TOKEN, VISION_END, 6]  # one placeholder for an image of several
        with pytest.raises(ValueError, match="image tokens for images that make"):
            engine.embed(Batch.pack([short]).with_patch_images(patches, grid[None], [1]))
        with pytest.raises(ValueError, match="takes no fixed-size images"):
            engine.embed(Batch.pack_images(np.zeros((1, 3, 32, 32), np.float32), 17))
    finally:
        engine.close()


def test_a_config_in_transformers_4_layout_loads_the_same(tmp_path, qwen3_vl) -> None:
    """Checkpoints saved before transformers 5 (Qwen3-VL-Embedding's own) keep the text rope under `rope_scaling`
    and its base as `rope_theta`, and the vision tower's without rope entry."""
    import json
    import shutil

    path, _ = qwen3_vl
    old = tmp_path / "old"
    shutil.copytree(path, old)
    config = json.loads((old / "config.json").read_text())
    text = config["text_config"]
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope.pop("rope_theta")
    text["rope_scaling"] = rope
    config["vision_config"].pop("rope_parameters", None)
    (old / "config.json").write_text(json.dumps(config))
    batch = _batch(*_mixed_sequences(seed=4))
    rows = []
    for directory in (path, old):
        engine = _engine(directory, "float32")
        try:
            rows.append(engine.embed(batch))
        finally:
            engine.close()
    np.testing.assert_array_equal(rows[0], rows[1])


def test_a_bare_qwen3vlmodel_checkpoint_loads_the_same(tmp_path, qwen3_vl, minilm_path: Path) -> None:
    """Qwen3VLModel saved alone (no `model.` prefix, no LM head) gives the rows its ForConditionalGeneration does."""
    import shutil

    from qwen3_vl_models import TOKENIZER_FILES, image_processor

    path, model = qwen3_vl
    bare = tmp_path / "bare"
    model.model.save_pretrained(bare)
    image_processor().save_pretrained(bare)
    for name in TOKENIZER_FILES:
        shutil.copy(minilm_path / name, bare / name)
    batch = _batch(*_mixed_sequences(seed=5))
    rows = []
    for directory in (path, bare):
        engine = _engine(directory, "float32")
        try:
            rows.append(engine.embed(batch))
        finally:
            engine.close()
    np.testing.assert_array_equal(rows[0], rows[1])
