"""A CLIP for bench/images.py, built here because the only real weights on this machine are a text model's: a
random-weight transformers CLIPModel at ViT-B/32's size (vision: hidden 768, 12 layers, 12 heads, patch 32, image
224; text: hidden 512, 12 layers, 8 heads; projection 512), saved with save_pretrained, transformers' default
CLIPImageProcessor (shortest edge 224, bicubic, center crop 224, OpenAI's mean and std) and a CLIP byte-level BPE
tokenizer with no merges (every byte a token; CLIP's real vocabulary is not on this machine). Speed does not depend
on the weights' values; agreement between servers is checked by cosine all the same. With `tiny`, both towers are 2
layers of width 32 (still patch 32 at 224 pixels): the bench's smoke run (tests/test_images_bench.py), whose figures
mean nothing.

Also the bench's images: gradients with noise, of several sizes, encoded as JPEG (what photos are)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

BOS_ID, EOS_ID = 512, 513  # after the 256 byte tokens and their 256 end-of-word forms
SIZES = [(640, 480), (480, 640), (800, 600), (512, 512), (1024, 768), (300, 200)]  # (width, height)
TINY_TOWER = dict(hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2)


def build_clip(path: Path, seed: int = 0, tiny: bool = False) -> Path:
    """Saves the random ViT-B/32 CLIP (or the tiny one), its image processor and tokenizer at `path` (once);
    returns `path`."""
    if (path / "preprocessor_config.json").exists():
        return path
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(seed)
    tower = TINY_TOWER if tiny else {}  # ViT-B/32's sizes are transformers' defaults
    text = dict(tower, eos_token_id=EOS_ID, bos_token_id=BOS_ID, pad_token_id=EOS_ID)
    config = CLIPConfig(text_config=text, vision_config=tower, projection_dim=16 if tiny else 512)
    model = CLIPModel(config).eval()
    model.save_pretrained(path)
    clip_tokenizer().save_pretrained(path)
    CLIPImageProcessor().save_pretrained(path)
    return path


def clip_tokenizer():
    from transformers import CLIPTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())
    vocab = [*chars, *(char + "</w>" for char in chars), "<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(vocab={token: index for index, token in enumerate(vocab)}, merges=[])


def describe(path: Path) -> tuple[str, int]:
    """The saved CLIP's image tower in words, and its tokens an image (patches and the class token)."""
    vision = json.loads((path / "config.json").read_text())["vision_config"]
    tokens = 1 + (vision["image_size"] // vision["patch_size"]) ** 2
    words = (f"{vision['num_hidden_layers']} layers of width {vision['hidden_size']}, patch {vision['patch_size']} "
             f"at {vision['image_size']} pixels")  # fmt: skip
    return words, tokens


def image(width: int, height: int, seed: int) -> Image.Image:
    """A gradient with noise: JPEG cannot shrink it to nothing, as it would a flat colour."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / (width - 1), y * 255 / (height - 1), (x + y + seed * 37) % 256], axis=-1)
    return Image.fromarray(np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8), "RGB")


def jpeg_files(count: int, seed: int = 0) -> list[bytes]:
    """`count` JPEG files (quality 90), cycling through SIZES."""
    files = []
    for index in range(count):
        buffer = io.BytesIO()
        image(*SIZES[index % len(SIZES)], seed + index).save(buffer, format="JPEG", quality=90)
        files.append(buffer.getvalue())
    return files
