"""Rotary position embedding (the rotate-half form Qwen and Llama use) over packed tokens."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def rope_theta(rope: dict[str, Any], fallback: float, where: str = "") -> float:
    """The rotary base of a config's rope entry (transformers 5's `rope_parameters`, or a released config's
    `rope_scaling`), else `fallback` (the family's own key or default). Only the default rope is implemented:
    any scaled type is refused by name rather than served wrong."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"unsupported rope_type {rope_type!r}{where}; supported: default")
    return float(rope.get("rope_theta", fallback))


def config_rope_theta(config: dict[str, Any], default: float) -> float:
    """One base for every layer: the rope entry's, else `rope_theta`, else the family's `default`."""
    return rope_theta(
        config.get("rope_parameters") or config.get("rope_scaling") or {}, config.get("rope_theta", default)
    )


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_positions: int, base: float):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)  # [P, D/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x ([T, H, D]) rotated in float32 by angles whose cos and sin are [T, 1, D / 2] (rotate-half form)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated.to(x.dtype)
