"""Qwen3-VL's vision tower (transformers' Qwen3VLVisionModel): an image of any size is a grid of p x p patches
(two frames of each, the temporal patch, as the processor repeats a still image), embedded by a Linear (the
Conv3d flattened), plus a learned position table resampled bilinearly to the grid, then a bidirectional ViT with
2D rotary positions (rows and columns) whose attention stays within each image. Every 2 x 2 block of patches
(consecutive in the processor's order) is merged into one token of the decoder's width; some blocks' outputs are
merged the same way (the "deepstack" features) and added to the decoder's early layers.

Parameter names follow the Hugging Face checkpoint, with the patch convolution's kernel flattened.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.attention import Attention, planned_context
from bouquet.layers.context import ForwardContext, forward_context
from bouquet.layers.linear import Linear, LinearActivation
from bouquet.layers.norms import LayerNorm
from bouquet.layers.rotary import apply_rotary, rope_theta

_EPS = 1e-6  # transformers' Qwen3-VL vision LayerNorms


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    deepstack_indexes: tuple[int, ...]
    rope_theta: float

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> VisionConfig:
        return cls(
            depth=config.get("depth", 27),
            hidden_size=config.get("hidden_size", 1152),
            num_heads=config.get("num_heads", 16),
            intermediate_size=config.get("intermediate_size", 4304),
            hidden_act=config.get("hidden_act", "gelu_pytorch_tanh"),
            in_channels=config.get("in_channels", 3),
            patch_size=config.get("patch_size", 16),
            temporal_patch_size=config.get("temporal_patch_size", 2),
            merge_size=config.get("spatial_merge_size", 2),
            out_hidden_size=config.get("out_hidden_size", 3584),
            num_position_embeddings=config.get("num_position_embeddings", 2304),
            deepstack_indexes=tuple(config.get("deepstack_visual_indexes", (8, 16, 24))),
            rope_theta=_vision_rope_theta(config),
        )

    @property
    def patch_dim(self) -> int:
        """A patch's values as the processor flattens it: (channel, frame, row, column)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


def _vision_rope_theta(config: dict[str, Any]) -> float:
    rope = dict(config.get("rope_parameters") or {})
    if rope.get("rope_type", "axial") != "axial":
        raise ValueError(f"unsupported vision rope_type {rope['rope_type']!r} for Qwen3-VL; supported: axial")
    return rope_theta({**rope, "rope_type": "default"}, 10000.0, " (vision)")


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv = Linear(config.hidden_size, 3 * config.hidden_size)
        self.proj = Linear(config.hidden_size, config.hidden_size)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, causal=False)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [P, D]
        qkv = self.qkv(hidden)
        q, k, v = qkv.unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.proj(self.attn(q.to(qkv.dtype), k.to(qkv.dtype), v))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(config.hidden_size, eps=_EPS)
        self.norm2 = LayerNorm(config.hidden_size, eps=_EPS)
        self.attn = VisionAttention(config)
        self.mlp = nn.Sequential()
        self.mlp.linear_fc1 = LinearActivation(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.mlp.linear_fc2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # The residual stream stays float32; sublayer outputs in the compute dtype are promoted on add.
        hidden = hidden + self.attn(self.norm1(hidden), cos, sin)
        return hidden + self.mlp(self.norm2(hidden))


class PatchMerger(nn.Module):
    """Each 2 x 2 block of patch states, concatenated, through a two-layer MLP to the decoder's width; normed per
    patch before the concatenation (the final merger) or after it (the deepstack mergers)."""

    def __init__(self, config: VisionConfig, norm_after_merge: bool):
        super().__init__()
        self.merged = config.hidden_size * config.merge_size**2
        self.norm_after_merge = norm_after_merge
        self.norm = LayerNorm(self.merged if norm_after_merge else config.hidden_size, eps=_EPS)
        self.linear_fc1 = LinearActivation(self.merged, self.merged, "gelu")
        self.linear_fc2 = Linear(self.merged, config.out_hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [P, D] -> [P / 4, out] float32
        if self.norm_after_merge:
            hidden = self.norm(hidden.reshape(-1, self.merged))
        else:
            hidden = self.norm(hidden).reshape(-1, self.merged)
        return self.linear_fc2(self.linear_fc1(hidden)).float()


class VisionModel(nn.Module):
    def __init__(self, config: VisionConfig):
        super().__init__()
        self.config = config
        self.patch_embed = nn.Module()
        self.patch_embed.proj = Linear(config.patch_dim, config.hidden_size)
        self.pos_embed = nn.Embedding(config.num_position_embeddings, config.hidden_size)
        self.side = int(config.num_position_embeddings**0.5)
        head_dim = config.hidden_size // config.num_heads
        # Rows and columns each rotate a quarter of the head's frequency pairs' worth (head_dim / 4 frequencies).
        inv_freq = 1.0 / (
            config.rope_theta ** (torch.arange(0, head_dim // 2, 2, dtype=torch.float32) / (head_dim // 2))
        )
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(config.depth))
        self.merger = PatchMerger(config, norm_after_merge=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(config, norm_after_merge=True) for _ in config.deepstack_indexes
        )

    def forward(
        self,
        pixel_values: torch.Tensor,  # [P, patch_dim] float32, images' patches in the processor's order
        grid_thw: torch.Tensor,  # [N, 3] int64 (frames, rows, columns) in patches
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:  # [P / 4, out] and one [P / 4, out] per deepstack layer
        rows, cols = patch_coordinates(grid_thw, self.config.merge_size)
        hidden = self.patch_embed.proj(pixel_values).float() + self.position_embeddings(grid_thw, rows, cols)
        angles = torch.cat([rows[:, None] * self.inv_freq, cols[:, None] * self.inv_freq], dim=1)  # [P, hd / 2]
        cos, sin = angles.cos().unsqueeze(1), angles.sin().unsqueeze(1)
        deepstack = []
        with forward_context(self._context(grid_thw)):
            for index, block in enumerate(self.blocks):
                hidden = block(hidden, cos, sin)
                if index in self.config.deepstack_indexes:
                    merger = self.deepstack_merger_list[self.config.deepstack_indexes.index(index)]
                    deepstack.append(merger(hidden))
        return self.merger(hidden), deepstack

    def position_embeddings(self, grid_thw: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The square learned table resampled to each image's grid as F.interpolate(bilinear, align_corners=True)
        would: four taps per patch."""
        counts = grid_thw.prod(1)
        heights = torch.repeat_interleave(grid_thw[:, 1], counts)
        widths = torch.repeat_interleave(grid_thw[:, 2], counts)
        row_taps, row_weights = _bilinear_taps(rows, heights, self.side)
        col_taps, col_weights = _bilinear_taps(cols, widths, self.side)
        index = (row_taps[:, :, None] * self.side + col_taps[:, None, :]).flatten(1)  # [P, 4]
        weight = (row_weights[:, :, None] * col_weights[:, None, :]).flatten(1)
        table = self.pos_embed.weight.float()
        return (table[index] * weight[:, :, None]).sum(1)

    def _context(self, grid_thw: torch.Tensor) -> ForwardContext:
        """Attention within each frame of each image, on the backend the engine bound to the layers."""
        seq_lens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).tolist()
        return planned_context(self.blocks[0].attn.attn, seq_lens, grid_thw.device)


def patch_coordinates(grid_thw: torch.Tensor, merge: int) -> tuple[torch.Tensor, torch.Tensor]:  # [P] each
    """Each patch's row and column in its image, the patches in the processor's order: merge x merge blocks row by
    row, the patches of a block row by row, every frame alike."""
    counts = grid_thw.prod(1)
    widths = torch.repeat_interleave(grid_thw[:, 2], counts)
    frame = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], counts)
    starts = torch.repeat_interleave(F.pad(counts.cumsum(0)[:-1], (1, 0)), counts)
    within = (torch.arange(int(counts.sum()), device=grid_thw.device) - starts) % frame
    block, inner = within // (merge * merge), within % (merge * merge)
    blocks_wide = widths // merge
    rows = (block // blocks_wide) * merge + inner // merge
    cols = (block % blocks_wide) * merge + inner % merge
    return rows, cols


def _bilinear_taps(index: torch.Tensor, size: torch.Tensor, side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The two table entries an align_corners=True bilinear resampling of `side` entries to `size` reads at
    `index`, and their weights."""
    source = index.float() * (side - 1) / torch.clamp(size - 1, min=1).float()
    floor = torch.floor(source)
    taps = floor.long()[:, None] + torch.arange(2, device=index.device)
    weights = (1 - (source[:, None] - taps.float()).abs()).clamp(min=0)
    return taps.clamp(0, side - 1), weights
