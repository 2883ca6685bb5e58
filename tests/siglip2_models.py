"""A tiny random-weight SigLIP 2 (transformers' Siglip2Model, NaFlex) saved by `save_pretrained` with its own image
processor's config (Siglip2ImageProcessorPil: not the processor's defaults) beside the MiniLM tokenizer, and
transformers' own rows for it: its processor's padded patches, pixel_attention_mask and spatial_shapes through
`get_image_features`, texts through `get_text_features`."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import numpy as np
import torch
from family_models import TOKENIZER_FILES, spread_weights
from PIL import Image

PATCH = 8
TABLE_SIDE = 8  # the learned position table is 8 x 8: grids narrower than it are shrunk (antialiased), wider grown
MAX_NUM_PATCHES = 48  # the processor's, not its default 256
WIDTH = 64


def save_siglip2(path: Path, tokenizer_dir: Path, max_num_patches: int = MAX_NUM_PATCHES) -> torch.nn.Module:
    """The model, in eval mode, saved at `path` with its processor config and the tokenizer."""
    from transformers import Siglip2Config, Siglip2Model

    tower = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    config = Siglip2Config(
        text_config=dict(
            tower, vocab_size=30522, max_position_embeddings=64, bos_token_id=101, eos_token_id=102, pad_token_id=0
        ),
        vision_config=dict(tower, patch_size=PATCH, num_patches=TABLE_SIDE**2),
    )
    model = Siglip2Model(config)
    spread_weights(model, seed=0, scale=0.3)
    with torch.no_grad():  # patches of 192 values at std 1 would drown the position embeddings
        model.vision_model.embeddings.patch_embedding.weight.mul_(0.1)
        model.vision_model.head.probe.mul_(3.0)  # a probe far from the keys' scale makes the MAP head's weights peak
    model.save_pretrained(path)
    processor(max_num_patches).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return model.eval()


def processor(max_num_patches: int = MAX_NUM_PATCHES):
    """transformers' default SigLIP 2 image processor where torchvision is absent (here): the Pillow backend."""
    from transformers import Siglip2ImageProcessorPil

    return Siglip2ImageProcessorPil(patch_size=PATCH, max_num_patches=max_num_patches, resample=3,
                                    image_mean=[0.4, 0.5, 0.6], image_std=[0.3, 0.2, 0.25])  # fmt: skip


def image(width: int, height: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A gradient with noise: resizing or patching at the wrong place moves its pixels."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / max(width - 1, 1), y * 255 / max(height - 1, 1), (x + y) % 256], axis=-1)
    pixels = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    if mode == "RGBA":
        alpha = rng.integers(0, 256, (height, width), dtype=np.uint8)
        return Image.fromarray(np.dstack([pixels, alpha]), "RGBA")
    return Image.fromarray(pixels, "RGB")


def png(picture: Image.Image) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def processed(path: Path, images: list[Image.Image]) -> tuple[list[np.ndarray], np.ndarray, dict]:
    """transformers' processor (as saved at `path`) on the images: each image's own patches [P_i, patch_dim]
    (the padding cut off), the grids [N, 3] (1, rows, columns), and the padded inputs it gives the model."""
    from transformers import AutoImageProcessor

    inputs = AutoImageProcessor.from_pretrained(path)(images=images, return_tensors="pt")
    shapes = inputs["spatial_shapes"].numpy()
    patches = [inputs["pixel_values"][i, : rows * columns].numpy() for i, (rows, columns) in enumerate(shapes)]
    grids = np.concatenate([np.ones((len(shapes), 1), np.int32), shapes.astype(np.int32)], axis=1)
    return patches, grids, dict(inputs)


def image_features(model: torch.nn.Module, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return model.get_image_features(**inputs).pooler_output.numpy()


PAD_ID = 0  # the MiniLM tokenizer's [PAD]


def text_features(model: torch.nn.Module, texts: list[list[int]], masked: bool = True) -> np.ndarray:
    """The texts as Siglip2Processor pads them (padding="max_length", 64, with the tokenizer's pad token; an
    attention_mask when the tokenizer gives one), through transformers' forward."""
    length = model.config.text_config.max_position_embeddings
    ids = torch.tensor([[*text, *[PAD_ID] * (length - len(text))] for text in texts])
    lengths = torch.tensor([[len(text)] for text in texts])
    mask = {"attention_mask": (torch.arange(length) < lengths).long()} if masked else {}
    with torch.no_grad():
        return model.get_text_features(input_ids=ids, **mask).pooler_output.numpy()
