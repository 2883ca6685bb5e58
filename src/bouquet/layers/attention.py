"""The attention layer models call: packed q, k, v in; the backend the engine bound runs it over the batch in
the forward context."""

from __future__ import annotations

import torch
from torch import nn

from bouquet.layers.attention_backends.base import AttentionBackend
from bouquet.layers.context import get_forward_context


class Attention(nn.Module):
    backend: AttentionBackend | None = None  # bound by the engine once it has chosen one (`bind_backend`)

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
        assert self.backend is not None, "attention ran before the engine bound a backend"
        out = self.backend.forward(q, k, v, get_forward_context(), self.causal, self.scale)
        return out.flatten(1)


def bind_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every attention layer of `model` runs on `backend` from now on."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
