"""The attention layer models call: packed q, k, v in, the forward context's backend does the rest."""

from __future__ import annotations

import torch
from torch import nn

from bouquet.engine.context import get_forward_context


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, causal: bool):
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"{num_heads} heads not divisible by {num_kv_heads} kv heads"
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.scale = head_dim**-0.5

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
    ) -> torch.Tensor:  # [T, H * D]
        ctx = get_forward_context()
        out = ctx.attn_backend.forward(q, k, v, ctx, self.causal, self.scale)
        return out.flatten(1)
