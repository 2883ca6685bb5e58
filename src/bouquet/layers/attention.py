"""The attention layer models call: packed q, k, v in; the backend the engine bound runs it over the batch in
the forward context."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.attention_backends.base import AttentionBackend, AttentionShape
from bouquet.layers.context import ForwardContext, get_forward_context


class Attention(nn.Module):
    """What a model declares of each attention layer: heads, causal or not, an optional sliding window
    (query i sees keys i - left .. i + right, as FlashAttention's window_size), whether it adds a per-head
    position bias, and its scale (head_dim ** -0.5 unless the model says otherwise)."""

    backend: AttentionBackend | None = None  # bound by the engine once it has chosen one (`bind_backend`)

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool,
        sliding_window: tuple[int, int] | None = None,
        position_bias: bool = False,
        scale: float | None = None,
    ):
        super().__init__()
        assert num_heads % num_kv_heads == 0, f"{num_heads} heads not divisible by {num_kv_heads} kv heads"
        assert sliding_window is None or (min(sliding_window) >= 0 and not (causal and sliding_window[1])), (
            f"a sliding window is (left, right) tokens, right 0 when causal; got {sliding_window}"
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.causal = causal
        self.sliding_window = sliding_window
        self.position_bias = position_bias
        self.scale = head_dim**-0.5 if scale is None else scale

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        bias: torch.Tensor | None = None,  # [H, L, L] added to the scores of query i, key j of every sequence
    ) -> torch.Tensor:  # [T, H * D]
        assert self.backend is not None, "attention ran before the engine bound a backend"
        assert (bias is not None) == self.position_bias, "declare position_bias to pass a bias, and pass one"
        ctx = get_forward_context()
        backend = self.backend if ctx.backend is None else ctx.backend
        out = backend.forward(q, k, v, ctx, self.causal, self.scale, self.sliding_window, bias)
        return out.flatten(1)


def attention_shape(model: nn.Module, dtype: torch.dtype) -> AttentionShape:
    """The model's attention as backends are chosen and bound by: the first layer's heads, and whether any
    layer slides a window or adds a position bias."""
    layers = [module for module in model.modules() if isinstance(module, Attention)]
    first = layers[0]
    kinds = {(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.causal, layer.scale) for layer in layers}
    return AttentionShape(
        first.num_heads, first.num_kv_heads, first.head_dim, first.causal, dtype,
        windows=tuple(sorted({layer.sliding_window for layer in layers if layer.sliding_window is not None})),
        position_bias=any(layer.position_bias for layer in layers), softmax_scale=first.scale, uniform=len(kinds) == 1,
    )  # fmt: skip


def planned_context(layer: Attention, seq_lens: list[int], device: torch.device) -> ForwardContext:
    """A forward context of these packed sequences, planned by the backend the engine bound to `layer`: for a part
    of a model that attends within sequences of its own (a vision tower's images, a step's texts beside them)."""
    cu_seqlens = F.pad(torch.tensor(seq_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    ctx = ForwardContext(cu_seqlens.to(device), max(seq_lens), seq_lens)
    assert layer.backend is not None, "attention ran before the engine bound a backend"
    ctx.attn_metadata = layer.backend.prepare(ctx)
    return ctx


def bind_backend(model: nn.Module, backend: AttentionBackend) -> None:
    """Every attention layer of `model` runs on `backend` from now on."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.backend = backend
