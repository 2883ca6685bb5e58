"""CLIP (transformers' CLIPModel) against transformers' own `get_text_features` and `get_image_features`, on a tiny
random-weight model saved by `save_pretrained` beside the MiniLM tokenizer.

Texts of several lengths are packed in one step, some with the EOS token inside or missing, so that pooling at the
wrong token (the last, say) or a missing causal mask moves the rows far from the reference; several images are one
step of their own."""

from __future__ import annotations

import json
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
from bouquet.replica.client import embed_request

BOUNDS = {"float32": 0.99999, "bfloat16": 0.999}
CLS, SEP = 101, 102  # the MiniLM tokenizer's; SEP is the tiny model's EOS
IMAGE_SIZE, PATCH = 32, 8
IMAGE_TOKENS = 1 + (IMAGE_SIZE // PATCH) ** 2


def _clip(eos_token_id: int):
    from transformers import CLIPConfig, CLIPModel

    tower = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = CLIPConfig(
        text_config=dict(tower, vocab_size=30522, max_position_embeddings=77, eos_token_id=eos_token_id,
                         bos_token_id=CLS, pad_token_id=0),
        vision_config=dict(tower, image_size=IMAGE_SIZE, patch_size=PATCH),
        projection_dim=48,
    )  # fmt: skip
    return CLIPModel(config)


def _save(model: torch.nn.Module, path: Path, tokenizer_dir: Path) -> torch.nn.Module:
    spread_weights(model, seed=0, scale=0.3)
    with torch.no_grad():  # patches of 192 pixels at std 1 would drown the position embeddings
        model.vision_model.embeddings.patch_embedding.weight.mul_(0.1)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


@pytest.fixture(scope="module")
def clip(tmp_path_factory, minilm_path: Path):
    path = tmp_path_factory.mktemp("clip") / "hf"
    return path, _save(_clip(eos_token_id=SEP), path, minilm_path)


def _texts(seed: int = 0) -> list[list[int]]:
    """Tokenizer-shaped texts of several lengths, then one with words after its EOS and one without an EOS."""
    generator = torch.Generator().manual_seed(seed)

    def words(n: int) -> list[int]:
        return torch.randint(1000, 30000, (n,), generator=generator).tolist()

    texts = [[CLS, *words(n), SEP] for n in (3, 40, 0, 75, 11)]
    return [*texts, [CLS, *words(6), SEP, *words(9)], [CLS, *words(12)]]


def _images(count: int, seed: int = 0) -> np.ndarray:  # [N, 3, S, S] float32
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator).numpy()


def _engine(path: Path, dtype: str, attention_backend: str = "auto") -> Engine:
    config = EngineConfig(
        model_path=path, device="cpu", dtype=dtype, attention_backend=attention_backend, cpu_warmup_tokens=0
    )
    return Engine(config)


def _text_reference(model: torch.nn.Module, texts: list[list[int]]) -> np.ndarray:
    """One text at a time: no padding in the reference."""
    with torch.no_grad():
        rows = [model.get_text_features(input_ids=torch.tensor([ids])).pooler_output[0] for ids in texts]
    return torch.stack(rows).numpy()


def _image_reference(model: torch.nn.Module, images: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model.get_image_features(pixel_values=torch.from_numpy(images)).pooler_output.numpy()


def _assert_close(rows: np.ndarray, expected: np.ndarray, dtype: str) -> None:
    cosines = row_cosines(rows, expected)
    print(f"min cosine {cosines.min():.7f}")  # shown with -rP
    assert cosines.min() >= BOUNDS[dtype], f"min cosine {cosines.min():.7f} per row {np.round(cosines, 6)}"


@pytest.mark.parametrize(
    ("dtype", "backend"), [("float32", "auto"), ("bfloat16", "auto"), ("float32", "sdpa"), ("float32", "cpu_varlen")]
)
def test_text_and_image_features_match_transformers(clip, dtype: str, backend: str) -> None:
    """Every CPU attention backend takes causality per layer: the text tower's causal, the vision tower's not."""
    path, model = clip
    texts, images = _texts(), _images(4)
    engine = _engine(path, dtype, backend)
    try:
        assert engine.dimension == 48 and engine.max_seq_length == 77
        text_rows = engine.embed(Batch.pack(texts))
        image_rows = engine.embed(Batch.pack_images(images, IMAGE_TOKENS))
    finally:
        engine.close()
    _assert_close(text_rows, _text_reference(model, texts), dtype)
    _assert_close(image_rows, _image_reference(model, images), dtype)


def test_texts_are_served_unpadded_as_padding_changes_no_row(clip) -> None:
    """Unlike SigLIP's, CLIP's text tower reads its EOS token under a causal mask: texts padded to 77 with an
    attention mask (its processor with padding="max_length") give transformers' unpadded rows, and bouquet pads
    none (the loader sets no text padding)."""
    path, model = clip
    texts = _texts()
    ids = torch.tensor([[*text, *[0] * (77 - len(text))] for text in texts])
    mask = (torch.arange(77) < torch.tensor([[len(text)] for text in texts])).long()
    with torch.no_grad():
        padded = model.get_text_features(input_ids=ids, attention_mask=mask).pooler_output.numpy()
    _assert_close(padded, _text_reference(model, texts), "float32")
    engine = _engine(path, "float32")
    try:
        assert getattr(engine.runner.model, "text_padding", None) is None
        _assert_close(engine.embed(Batch.pack(texts)), padded, "float32")
    finally:
        engine.close()


def test_legacy_eos_id_pools_at_the_highest_token_id(tmp_path, clip) -> None:
    """Configs saved before transformers fixed CLIP's eos_token_id (2) pool at the first highest id instead."""
    path, model = clip
    shutil.copytree(path, tmp_path / "legacy")
    config_file = tmp_path / "legacy" / "config.json"
    config = json.loads(config_file.read_text())
    config["text_config"]["eos_token_id"] = 2
    config_file.write_text(json.dumps(config))
    texts = [*_texts(seed=1), [CLS, 29000, 5, 29000, 7]]  # a tie: the first of the two
    engine = _engine(tmp_path / "legacy", "float32")
    try:
        rows = engine.embed(Batch.pack(texts))
    finally:
        engine.close()
    model.text_model.eos_token_id = 2
    try:
        expected = _text_reference(model, texts)
    finally:
        model.text_model.eos_token_id = SEP
    _assert_close(rows, expected, "float32")


def test_an_image_of_another_size_is_refused(clip) -> None:
    engine = _engine(clip[0], "float32")
    try:
        with pytest.raises(ValueError, match=r"takes \(3, 32, 32\)"):
            engine.embed(Batch.pack_images(np.zeros((1, 3, 64, 64), np.float32), 1 + 8 * 8))
        with pytest.raises(ValueError, match="the batch has 65"):
            engine.embed(Batch.pack_images(np.zeros((1, 3, 32, 32), np.float32), 65))
    finally:
        engine.close()


def test_a_text_model_refuses_images(minilm_path: Path) -> None:
    engine = _engine(minilm_path, "float32")
    try:
        with pytest.raises(ValueError, match="takes no images"):
            engine.embed(Batch.pack_images(_images(1), IMAGE_TOKENS))
    finally:
        engine.close()


def test_image_batches_slice_and_concatenate_with_texts() -> None:
    images = _images(3)
    batch = Batch.pack_images(images, IMAGE_TOKENS)
    assert batch.num_tokens == 3 * IMAGE_TOKENS and batch.num_seqs == 3 and batch.all_images
    parts = [batch.slice(0, 1), batch.slice(1, 3)]
    np.testing.assert_array_equal(parts[1].pixel_values, images[1:])
    joined = Batch.concat(parts)
    np.testing.assert_array_equal(joined.pixel_values, images)
    np.testing.assert_array_equal(joined.cu_seqlens, batch.cu_seqlens)
    mixed = Batch.concat([parts[0], Batch.pack([[1, 2, 3]]), parts[1]])  # a step; never a request
    assert mixed.fixed_images and not mixed.all_images and mixed.cu_images.tolist() == [0, 1, 1, 2, 3]
    np.testing.assert_array_equal(mixed.slice(1, 3).pixel_values, images[1:2])
    with pytest.raises(ValueError, match="not a request"):
        embed_request(mixed)


def test_a_backend_that_plans_one_shape_for_every_layer_is_not_chosen(clip) -> None:
    """FlashInfer plans heads and causality once for all layers: CLIP's causal text tower and bidirectional vision
    tower need a backend that takes them per layer."""
    from bouquet.layers.attention import attention_shape
    from bouquet.layers.attention_backends.flashinfer import FlashInferBackend

    engine = _engine(clip[0], "float32")
    try:
        shape = attention_shape(engine.model, torch.float32)
    finally:
        engine.close()
    assert not shape.uniform
    assert not FlashInferBackend.can_run(shape)
