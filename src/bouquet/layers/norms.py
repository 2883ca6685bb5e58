"""Normalisation layers that compute in float32 whatever the activations' dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., D] -> float32 [..., D]
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm on a float32 view of the input, so a bfloat16 residual never loses its mean."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), self.normalized_shape, self.weight, self.bias, self.eps)
