"""Building blocks against their plain torch definitions."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bouquet.layers.linear import Linear, LinearActivation, prepack_cpu_linears


@pytest.mark.parametrize("activation", ["gelu", "gelu_pytorch_tanh", "relu", "silu"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("prepacked", [False, True])
def test_fused_linear_activation_matches_unfused(
    activation: str, dtype: torch.dtype, tolerance: float, prepacked: bool
) -> None:
    from bouquet.cpu_features import cpu_features

    if prepacked and dtype == torch.bfloat16 and not cpu_features().packed_bf16:
        pytest.skip(f"oneDNN packs no bfloat16 here (needs avx512bw, avx512vl, avx512dq): {cpu_features().describe()}")
    torch.manual_seed(0)
    layer = LinearActivation(64, 256, activation).to(dtype)
    if prepacked:
        prepack_cpu_linears(layer)
        assert layer.packed_weight is not None
    x = torch.randn(37, 64)  # float32 input, as the residual stream hands it over
    with torch.inference_mode():
        out = layer(x)
    reference_act = {"gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}
    act = reference_act.get(activation, F.relu if activation == "relu" else F.silu)
    expected = act(F.linear(x, layer.weight.float(), layer.bias.float()))
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 11, 300])
def test_prepacked_linear_matches_plain(dtype: torch.dtype, num_tokens: int) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 160).to(dtype)
    x = torch.randn(num_tokens, 96)
    with torch.inference_mode():
        plain = layer(x)
        prepack_cpu_linears(layer)
        packed = layer(x)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(packed, plain, atol=tolerance, rtol=tolerance)
