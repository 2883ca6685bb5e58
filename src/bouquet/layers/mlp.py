"""The gated MLP of the decoder-style families: down(act(gate(x)) * up(x)), with gate and up fused into one
matrix product at load (`gate_up_proj`, gate first)."""

from __future__ import annotations

import torch
from torch import nn

from bouquet.layers.activation import get_activation
from bouquet.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, activation: str):
        super().__init__()
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)
        self.activation = get_activation(activation)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=1)
        return self.down_proj(self.activation(gate) * up)
