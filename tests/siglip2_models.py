"""A tiny random-weight SigLIP 2 (transformers' Siglip2Model, NaFlex) saved by `save_pretrained` with its own image
processor's config (Siglip2ImageProcessorPil: not the processor's defaults) beside the MiniLM tokenizer, and
transformers' own rows for it: its processor's padded patches, pixel_attention_mask and spatial_shapes through
`get_image_features`, texts through `get_text_features`. Also a real Siglip2Tokenizer (`siglip2_tokenizer`), and a
SigLIP 2 of the released ones' patching saved with its Siglip2Processor (`save_siglip2_processor`)."""

from __future__ import annotations

import io
import json
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


SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]  # Siglip2Tokenizer's, at its ids 0 to 4
CORPUS = [
    "A Photo of a Cat sitting on the Sofa", "two dogs playing in the snow", "The Eiffel Tower at Night",
    "a red Car parked by the river", "PEOPLE walking in a busy street", "an Old map of Paris and London",
]  # fmt: skip


def siglip2_tokenizer():  # transformers' Siglip2Tokenizer
    """Siglip2Tokenizer on a BPE vocabulary trained on CORPUS the way Gemma's is split (spaces as "▁")."""
    from tokenizers import Tokenizer, models, normalizers, trainers
    from transformers import Siglip2Tokenizer

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False)
    bpe.train_from_iterator(CORPUS * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return Siglip2Tokenizer(vocab=model["vocab"], merges=merges)


def save_siglip2_processor(path: Path, positions: int = 64) -> None:
    """A SigLIP 2 patched as the released ones are (patch 16, a 16 x 16 position table, 256 patches an image: what
    Siglip2Processor's call uses whatever its image processor saved), tiny otherwise, saved by `save_pretrained`
    with its Siglip2Processor (Pillow image processor, real Siglip2Tokenizer); `positions` text positions."""
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model, Siglip2Processor

    tokenizer = siglip2_tokenizer()
    tower = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    text = dict(tower, vocab_size=len(tokenizer), max_position_embeddings=positions, bos_token_id=2, eos_token_id=1)
    config = Siglip2Config(
        text_config=dict(text, pad_token_id=0), vision_config=dict(tower, patch_size=16, num_patches=256)
    )
    model = Siglip2Model(config)
    spread_weights(model, seed=0, scale=0.3)
    with torch.no_grad():  # as in save_siglip2, for patches of 768 values
        model.vision_model.embeddings.patch_embedding.weight.mul_(0.05)
        model.vision_model.head.probe.mul_(3.0)
    model.save_pretrained(path)
    images = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256, resample=3, image_mean=[0.4, 0.5, 0.6],
                                      image_std=[0.3, 0.2, 0.25])  # fmt: skip
    Siglip2Processor(image_processor=images, tokenizer=tokenizer).save_pretrained(path)


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
    length = 64  # Siglip2Processor's max_length, whatever the position table's length
    ids = torch.tensor([[*text, *[PAD_ID] * (length - len(text))] for text in texts])
    lengths = torch.tensor([[len(text)] for text in texts])
    mask = {"attention_mask": (torch.arange(length) < lengths).long()} if masked else {}
    with torch.no_grad():
        return model.get_text_features(input_ids=ids, **mask).pooler_output.numpy()
