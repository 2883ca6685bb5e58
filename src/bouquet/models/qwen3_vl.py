"""Qwen3-VL as an embedder (Qwen3-VL-Embedding): transformers' Qwen3VLModel, whose decoder reads text and images
in one sequence; a sequence's embedding is its last token's final state (last-token pooling), L2-normalised, so
text-only and image (with or without text) inputs share one space.

A sequence holding an image carries the image's placeholder tokens (`image_token_id`, one per 2 x 2 block of
patches, as the processor expands them); the vision tower's merged tokens replace their embeddings in order, and
its deepstack features are added to those positions after the decoder's first layers. Positions are
multimodal (M-RoPE): each token has (time, row, column) positions; a text token's three are its text position, an
image token's are the image's start plus its block's row and column, and the text after an image continues from
the image's start plus the larger of its block rows and columns. The decoder's frequency pairs are interleaved
between the three. Text-only sequences get three equal positions, which is plain RoPE: Qwen3's text path.

The decoder's layers are Qwen3's (models/qwen3.py) with the multimodal rotary embedding; the vision tower is in
qwen3_vl_vision.py. Parameter names follow the Hugging Face checkpoint (Qwen3VLForConditionalGeneration's
`model.visual.*`, `model.language_model.*`, or Qwen3VLModel's without `model.`), with q/k/v and gate/up fused.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.norms import RMSNorm
from bouquet.layers.rotary import apply_rotary
from bouquet.layers.weights import drop_ignored, fuse, strip_prefixes
from bouquet.model_dir import PoolingMethod
from bouquet.models.qwen3 import Qwen3Config, Qwen3DecoderLayer
from bouquet.models.qwen3_vl_vision import VisionConfig, VisionModel

_IGNORED = re.compile(r"lm_head\..*")
_PATCH_WEIGHT = "visual.patch_embed.proj.weight"


@dataclass(frozen=True)
class Qwen3VLConfig:
    text: Qwen3Config
    vision: VisionConfig
    image_token_id: int
    mrope_section: tuple[int, int, int]

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Qwen3VLConfig:
        text = config.get("text_config") or {}
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        text = {**text, "rope_parameters": {k: v for k, v in rope.items() if not k.startswith("mrope")}}
        section = tuple(rope.get("mrope_section", (24, 20, 20)))
        head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
        if len(section) != 3 or sum(section) != head_dim // 2:
            raise ValueError(
                f"mrope_section {list(section)} must be 3 numbers summing to head_dim / 2 ({head_dim // 2})"
            )
        return cls(
            text=Qwen3Config.from_hf(text),
            vision=VisionConfig.from_hf(config.get("vision_config") or {}),
            image_token_id=config.get("image_token_id", 151655),
            mrope_section=(section[0], section[1], section[2]),
        )


class MultimodalRotaryEmbedding(nn.Module):
    """Rotary angles from (time, row, column) positions: frequency pair i follows the row position when
    i % 3 == 1 and i < 3 * section[1], the column when i % 3 == 2 and i < 3 * section[2], else time."""

    def __init__(self, head_dim: int, base: float, section: tuple[int, int, int]):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, head_dim, 2).float() / head_dim)), False)
        pair = torch.arange(head_dim // 2)
        axis = torch.zeros(head_dim // 2, dtype=torch.long)
        axis[(pair % 3 == 1) & (pair < 3 * section[1])] = 1
        axis[(pair % 3 == 2) & (pair < 3 * section[2])] = 2
        self.register_buffer("axis", axis, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [3, T]
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        chosen = positions[self.axis].T.float()  # [T, D/2]: each pair's position
        angles = (chosen * self.inv_freq).unsqueeze(1)
        cos, sin = angles.cos(), angles.sin()
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


class TextModel(nn.Module):
    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        text = config.text
        self.embed_tokens = nn.Embedding(text.vocab_size, text.hidden_size)
        rotary = MultimodalRotaryEmbedding(text.head_dim, text.rope_theta, config.mrope_section)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(text, rotary) for _ in range(text.num_layers))
        self.norm = RMSNorm(text.hidden_size, text.rms_norm_eps)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, D] float32 input embeddings
        positions: torch.Tensor,  # [3, T]
        image_rows: torch.Tensor | None = None,  # [I] the image tokens' rows
        deepstack: Sequence[torch.Tensor] = (),  # per early layer, [I, D] added to the image tokens' states
    ) -> torch.Tensor:  # [T, D] float32
        for index, layer in enumerate(self.layers):
            hidden = layer(positions, hidden)
            if index < len(deepstack):
                hidden = hidden.index_add(0, image_rows, deepstack[index])
        return self.norm(hidden)


class Qwen3VLModel(nn.Module):
    task = "embed"
    default_pooling = PoolingMethod.LAST  # Qwen3-VL-Embedding's: the last token's state, then L2 normalisation
    takes_images = True
    variable_images = True  # images of any size, each its own patch grid, inside token sequences

    def __init__(self, config: Qwen3VLConfig):
        super().__init__()
        self.config = config
        self.visual = VisionModel(config.vision)
        self.language_model = TextModel(config)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Qwen3VLModel:
        return cls(Qwen3VLConfig.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        return self.config.text.max_positions

    @property
    def image_patch_dim(self) -> int:
        return self.config.vision.patch_dim

    @property
    def image_patches(self) -> tuple[int, int, int, bool, int]:
        """(patch values, merge size, placeholder token id, each image a sequence of its own, most patches an
        image): images inside token sequences, bounded by the text's limit."""
        return (self.image_patch_dim, self.config.vision.merge_size, self.config.image_token_id, False, 0)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]: text and each image's placeholder tokens
        positions: torch.Tensor,  # [T] within each sequence
        token_type_ids: torch.Tensor | None = None,  # unused
        pixel_values: torch.Tensor | None = None,  # [P, patch_dim] float32: every image's patches, in token order
        image_grid_thw: torch.Tensor | None = None,  # [N, 3] each image's (frames, rows, columns) in patches
        cu_images: torch.Tensor | None = None,  # unused: image tokens are the placeholder's
    ) -> torch.Tensor:  # [T, D] float32
        hidden = self.language_model.embed_tokens(input_ids).float()
        if pixel_values is None or image_grid_thw is None:
            return self.language_model(hidden, positions.expand(3, -1))
        grid = image_grid_thw.long()
        image_rows = self._check_images(input_ids, pixel_values, grid)
        image_embeds, deepstack = self.visual(pixel_values, grid)
        hidden = hidden.index_copy(0, image_rows, image_embeds)
        merged = grid // torch.tensor(
            [1, self.config.vision.merge_size, self.config.vision.merge_size], device=grid.device
        )
        mrope = multimodal_positions(positions, image_rows, merged)
        return self.language_model(hidden, mrope, image_rows, deepstack)

    def _check_images(self, input_ids: torch.Tensor, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The image tokens' rows, after checking that the images fill them and the patches fill the images."""
        vision = self.config.vision
        if grid.ndim != 2 or grid.shape[1] != 3 or (grid[:, 0] != 1).any() or (grid[:, 1:] % vision.merge_size).any():
            raise ValueError(
                f"image grids must be (1, rows, columns) with rows and columns multiples of {vision.merge_size}"
            )
        if tuple(pixel_values.shape) != (int(grid.prod(1).sum()), vision.patch_dim):
            raise ValueError(
                f"pixel_values of shape {tuple(pixel_values.shape)}; the image grids make "
                f"({int(grid.prod(1).sum())}, {vision.patch_dim}) patches"
            )
        image_rows = torch.nonzero(input_ids == self.config.image_token_id).flatten()
        expected = int(grid.prod(1).sum()) // vision.merge_size**2
        if len(image_rows) != expected:
            raise ValueError(f"{len(image_rows)} image tokens for images that make {expected}")
        return image_rows

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = drop_ignored(strip_prefixes(state, ("model.",)), _IGNORED)
        for i in range(self.config.text.num_layers):
            attn, mlp = f"language_model.layers.{i}.self_attn", f"language_model.layers.{i}.mlp"
            kinds = ("weight", "bias") if self.config.text.attention_bias else ("weight",)
            for kind in kinds:
                fuse(state, f"{attn}.qkv_proj.{kind}", [f"{attn}.{p}_proj.{kind}" for p in "qkv"])
            fuse(state, f"{mlp}.gate_up_proj.weight", [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"])
        if _PATCH_WEIGHT not in state:
            raise ValueError(f"missing weight: model.{_PATCH_WEIGHT}")
        state[_PATCH_WEIGHT] = state[_PATCH_WEIGHT].flatten(1)  # [D, C, T, p, p] -> [D, C * T * p * p]
        return state


def multimodal_positions(
    positions: torch.Tensor,  # [T] each token's offset in its sequence
    image_rows: torch.Tensor,  # [I] the image tokens' rows, in order
    merged_grid: torch.Tensor,  # [N, 3] each image's (frames, rows, columns) in decoder tokens
) -> torch.Tensor:  # [3, T]
    """(time, row, column) positions, as transformers' get_rope_index makes them, for packed sequences. An image
    advances the text position by max(rows, columns) instead of its token count: every later token of its
    sequence is shifted by the difference."""
    num_tokens = len(positions)
    counts = merged_grid.prod(1)  # [N] tokens per image
    ends = image_rows[counts.cumsum(0) - 1] + 1  # [N] the row after each image's last token
    advance = torch.maximum(merged_grid[:, 1], merged_grid[:, 2]) - counts
    shift = torch.zeros(num_tokens + 1, dtype=torch.long, device=positions.device).index_add(0, ends, advance)
    shift = shift[:num_tokens].cumsum(0)
    rows = torch.arange(num_tokens, device=positions.device)
    shift = shift - shift[rows - positions]  # only the images of a token's own sequence shift it
    text = positions + shift
    out = text.expand(3, -1).clone()
    image_of = torch.repeat_interleave(torch.arange(len(counts), device=positions.device), counts)  # [I]
    within = torch.arange(len(image_rows), device=positions.device) - F.pad(counts.cumsum(0), (1, 0))[image_of]
    start = text[image_rows] - within  # the image's first token's text position
    width = merged_grid[image_of, 2]
    out[1, image_rows] = start + within // width
    out[2, image_rows] = start + within % width
    out[0, image_rows] = start
    return out
