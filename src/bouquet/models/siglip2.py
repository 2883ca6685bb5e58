"""SigLIP 2 (transformers' Siglip2Model, the NaFlex variant): SigLIP's two towers (models/siglip.py) with a vision
tower that takes each image at its own aspect ratio (siglip2_vision.py). The processor resizes an image so that its
patch grid (rows x columns of p x p patches) fits `max_num_patches`, and hands over the flattened patches.

Packed, padding-free: an image is a sequence of its own, one token per patch, of whatever length its grid gives
(Batch.pack_image_sequences); attention stays within each image, and the MAP head's one query attends over each
image's tokens alone. A step may mix texts and images: each tower runs on its own sequences (an attention plan of its
own), and every sequence's row is put at its first token, where the engine's CLS pooling reads it.

Texts as transformers' Siglip2Processor makes them: padded to its `max_length` with the tokenizer's pad token, the
row taken at the last position, a pad for any shorter text (models/siglip_text.py). The loader reads the padding from
the tokenizer's files (`text_padding`); without a pad token, texts run as sent. That length is the processor class's
own, 64 (`processor_text_length`): its call pads and truncates there whatever the tokenizer's `model_max_length` or
the position table's length say, in SigLIP 2's documented call (`padding="max_length", max_length=64`), in a call
naming nothing and in sentence-transformers' (which sets `model_max_length` from its `max_seq_length`), so the engine
cuts texts there too. A table shorter than 64 positions is refused: transformers' forward cannot run its texts.

Parameter names follow the Hugging Face checkpoint, converted as SigLIP's are.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from bouquet.layers.attention import planned_context
from bouquet.layers.context import forward_context, get_forward_context
from bouquet.layers.weights import scalar
from bouquet.model_dir import PoolingMethod
from bouquet.models.siglip import SiglipConfig, convert_siglip_checkpoint
from bouquet.models.siglip2_vision import Siglip2VisionTransformer
from bouquet.models.siglip_text import SiglipTextTransformer
from bouquet.text_padding import TextPadding

# The most patches one image may make: a 2,048 x 2,048 image at patch 16. The processor's max_num_patches (256 by
# default; 1,024 in the largest published settings) is far below it; the bound keeps a request's one image within
# what a step's attention can hold.
MAX_IMAGE_PATCHES = 16384
# transformers' Siglip2Processor.text_kwargs: padding "max_length", truncation, max_length 64 (module docstring).
PROCESSOR_TEXT_LENGTH = 64


def siglip2_config(config: dict[str, Any]) -> SiglipConfig:
    """SigLIP's config read from SigLIP 2's: its square position table of `num_patches` entries is the table of a
    square image of side sqrt(num_patches) patches."""
    vision = dict(config.get("vision_config") or {})
    num_patches = int(vision.pop("num_patches", 256))
    side = math.isqrt(num_patches)
    if side * side != num_patches:
        raise ValueError(f"vision_config.num_patches {num_patches} is not a square: no square position table")
    vision["image_size"] = side * int(vision.get("patch_size", 16))
    siglip = SiglipConfig.from_hf({**config, "vision_config": vision})
    if siglip.max_positions < PROCESSOR_TEXT_LENGTH:
        raise ValueError(
            f"text_config.max_position_embeddings {siglip.max_positions} is fewer than the {PROCESSOR_TEXT_LENGTH} "
            "tokens transformers' Siglip2Processor pads every text to: transformers' own forward cannot run them"
        )
    return siglip


class Siglip2Model(nn.Module):
    task = "embed"
    default_pooling = PoolingMethod.CLS  # each sequence's features are at its first token (module docstring)
    takes_images = True
    variable_images = True  # images of any size, as patches (Batch.image_grid_thw)
    pads_texts = True  # the loader sets `text_padding` from the tokenizer (module docstring)
    processor_text_length = PROCESSOR_TEXT_LENGTH  # every text padded and cut there, whatever the tokenizer says

    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.config = config
        self.text_model = SiglipTextTransformer(config)
        self.vision_model = Siglip2VisionTransformer(config)
        self.text_padding: TextPadding | None = None
        self.logit_scale: float | None = None  # SigLIP's zero-shot logit's, read as the checkpoint is converted
        self.logit_bias: float | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Siglip2Model:
        return cls(siglip2_config(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest text its position table holds."""
        return self.config.max_positions

    @property
    def image_patches(self) -> tuple[int, int, int, bool, int]:
        """(patch values, merge size, placeholder token id, each image a sequence of its own, most patches an
        image): an image's tokens are its patches, one each, in a sequence of zeros that only count them (no
        placeholder)."""
        return (self.config.num_channels * self.config.patch_size**2, 1, -1, True, MAX_IMAGE_PATCHES)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]; for an image, zeros that only count its patches
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # unused: SigLIP 2 has no token types
        pixel_values: torch.Tensor | None = None,  # [P, C * p * p] float32: every image's patches, row by row
        image_grid_thw: torch.Tensor | None = None,  # [N, 3] each image's (1, rows, columns) in patches
        cu_images: torch.Tensor | None = None,  # [B + 1] sequence i's images: cu_images[i]..cu_images[i + 1]
    ) -> torch.Tensor:  # [T, D] float32; each sequence's features at its first token
        ctx = get_forward_context()
        if pixel_values is None or image_grid_thw is None or cu_images is None or not len(image_grid_thw):
            # (a step's slice of a request may hold its texts alone); the step's context is theirs
            if self.text_padding is None:
                return self.text_model(input_ids, positions)
            return self._texts(input_ids, positions, ctx.seq_lens)
        is_image = [count == 1 for count in torch.diff(cu_images).tolist()]
        grids = [(rows, columns) for _, rows, columns in image_grid_thw.tolist()]
        self._check_images(pixel_values, grids, ctx.seq_lens, is_image)
        if all(is_image):  # the step's context is the images' already
            return self.vision_model(pixel_values, grids)
        return self._mixed(input_ids, positions, pixel_values, grids, ctx.seq_lens, is_image)

    def _mixed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pixel_values: torch.Tensor,
        grids: list[tuple[int, int]],
        seq_lens: list[int],
        is_image: list[bool],
    ) -> torch.Tensor:  # [T, D] float32
        """A step of texts and images: each tower on its own sequences, in a forward context of their own."""
        device = input_ids.device
        token_is_image = torch.repeat_interleave(
            torch.tensor(is_image, device=device), torch.tensor(seq_lens, device=device)
        )
        image_rows, text_rows = token_is_image.nonzero().flatten(), (~token_is_image).nonzero().flatten()
        text_lens = [length for length, image in zip(seq_lens, is_image, strict=True) if not image]
        texts = self._texts(input_ids[text_rows], positions[text_rows], text_lens)
        image_lens = [rows * columns for rows, columns in grids]
        with forward_context(planned_context(self.text_model.attention, image_lens, device)):  # both towers' backend
            images = self.vision_model(pixel_values, grids)
        rows = texts.new_empty(len(input_ids), texts.shape[1])
        rows[text_rows], rows[image_rows] = texts, images
        return rows

    def _texts(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """[T, D] float32: each text's row at its first token, the texts padded as the processor pads them (to its
        `max_length`, 64, within the position table)."""
        return self.text_model.texts(input_ids, positions, seq_lens, self.text_padding, self.processor_text_length)

    def _check_images(
        self, pixel_values: torch.Tensor, grids: list[tuple[int, int]], seq_lens: list[int], is_image: list[bool]
    ) -> None:
        """One image a sequence that holds any, as long as its patches; the patches fill the grids."""
        patch_dim = self.image_patches[0]
        patches = sum(rows * columns for rows, columns in grids)
        if tuple(pixel_values.shape) != (patches, patch_dim):
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; the image grids make ({patches}, {patch_dim})"
            )
        image_lens = [length for length, image in zip(seq_lens, is_image, strict=True) if image]
        if image_lens != [rows * columns for rows, columns in grids]:
            raise ValueError("each image must be a sequence of its own, one token per patch")

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.logit_scale, self.logit_bias = scalar(state, "logit_scale"), scalar(state, "logit_bias")
        return convert_siglip_checkpoint(state, self.config)
