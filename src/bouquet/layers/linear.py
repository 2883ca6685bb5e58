"""A linear layer that computes in its weight's dtype and accepts activations of any dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    # The residual stream stays float32 while weights may be bfloat16: cast the input, not the weight.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
