"""Linear layers that compute in their weight's dtype and accept activations of any dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.activation import get_activation

# oneDNN's linear with a fused pointwise epilogue: the activation is applied while the output tile is
# still in cache, which saves a whole pass over the [T, intermediate] tensor on the CPU.
_ONEDNN_EPILOGUES: dict[str, tuple[str, list[object], str]] = {
    "gelu": ("gelu", [], "none"),
    "gelu_new": ("gelu", [], "tanh"),
    "gelu_pytorch_tanh": ("gelu", [], "tanh"),
    "relu": ("relu", [], ""),
}
_HAS_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    # The residual stream stays float32 while weights may be bfloat16: cast the input, not the weight.
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


class LinearActivation(Linear):
    """act(x @ W.T + b), fused into the matrix product on the CPU where oneDNN can."""

    def __init__(self, in_features: int, out_features: int, activation: str, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.activation = get_activation(activation)
        self.epilogue = _ONEDNN_EPILOGUES.get(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.weight.dtype)
        if self.epilogue is not None and _HAS_ONEDNN_LINEAR and x.device.type == "cpu" and not x.requires_grad:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, *self.epilogue)
        return self.activation(F.linear(x, self.weight, self.bias))
