"""Building blocks against their plain torch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bouquet.layers.linear import LinearActivation


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu", "silu"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_fused_linear_activation_matches_unfused(activation: str, dtype: torch.dtype, tolerance: float) -> None:
    torch.manual_seed(0)
    layer = LinearActivation(64, 256, activation).to(dtype)
    x = torch.randn(37, 64)  # float32 input, as the residual stream hands it over
    with torch.inference_mode():
        out = layer(x)
    reference_act = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}
    act = reference_act.get(activation, F.relu if activation == "relu" else F.silu)
    expected = act(F.linear(x, layer.weight.float(), layer.bias.float()))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
