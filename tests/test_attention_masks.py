"""Sliding windows and per-head position biases in the attention backends, against plain per-sequence SDPA with
the mask written out: cpu_varlen (windows, its C kernel), SDPA (windows and biases, over padded groups)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import packed_context

from bouquet.layers.attention_backends import AttentionShape
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend, has_bf16_dot
from bouquet.layers.attention_backends.sdpa import SdpaBackend

SEQ_LENS = [1, 7, 40, 130, 300, 17]
WINDOWS = {"left 5 right 5": (5, 5), "left 64 right 64": (64, 64), "left 20 only": (20, 0), "left 0": (0, 0)}


def reference(q, k, v, seq_lens, causal, window, bias=None) -> torch.Tensor:
    """Each sequence alone, in float32, its mask from positions: key j visible to query i when
    i - left <= j <= i + right (right 0 when causal)."""
    outs, start = [], 0
    for length in seq_lens:
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows].transpose(0, 1)[None].float() for t in (q, k, v))
        offset = torch.arange(length)[None, :] - torch.arange(length)[:, None]
        left, right = window or (length, length)
        allowed = (offset >= -left) & (offset <= (0 if causal else right))
        mask = torch.zeros(length, length).masked_fill(~allowed, float("-inf"))
        if bias is not None:
            mask = mask + bias[:, :length, :length]
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
        start += length
    return torch.cat(outs)


def _inputs(dtype: torch.dtype, heads: int = 4, kv_heads: int = 2, head_dim: int = 32, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(SEQ_LENS)
    q = torch.randn(total, heads, head_dim, generator=generator) * 2  # peaked attention: a wrong mask shows
    k, v = (torch.randn(total, kv_heads, head_dim, generator=generator) * 2 for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype)


def _run(backend, q, k, v, causal, window, bias=None) -> torch.Tensor:
    shape = AttentionShape(q.shape[1], k.shape[1], q.shape[2], causal, q.dtype, windows=(window,) if window else (),
                           position_bias=bias is not None)  # fmt: skip
    backend.bind(shape)
    ctx = packed_context(backend, SEQ_LENS)
    return backend.forward(q, k, v, ctx, causal, shape.scale, window, bias).float()


@pytest.mark.parametrize("window", WINDOWS.values(), ids=WINDOWS.keys())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backend_name", ["cpu_varlen", "sdpa"])
def test_sliding_window_matches_the_masked_reference(backend_name: str, causal: bool, window) -> None:
    if causal:
        window = (window[0], 0)
    q, k, v = _inputs(torch.float32)
    backend = CpuVarlenBackend() if backend_name == "cpu_varlen" else SdpaBackend()
    got = _run(backend, q, k, v, causal, window)
    torch.testing.assert_close(got, reference(q, k, v, SEQ_LENS, causal, window), atol=2e-5, rtol=1e-4)
    unwindowed = reference(q, k, v, SEQ_LENS, causal, None)
    assert (got - unwindowed).abs().max() > 1e-2  # the window changed the result: the test can fail


@pytest.mark.parametrize("bf16_dot", [False, True] if has_bf16_dot() else [False])
@pytest.mark.parametrize("causal", [False, True])
def test_bfloat16_sliding_window(bf16_dot: bool, causal: bool) -> None:
    window = (24, 0 if causal else 9)
    q, k, v = _inputs(torch.bfloat16, head_dim=64)
    got = _run(CpuVarlenBackend(bf16_dot=bf16_dot), q, k, v, causal, window)
    expected = reference(q, k, v, SEQ_LENS, causal, window)
    assert F.cosine_similarity(got.flatten(1), expected.flatten(1)).min() > 0.999


@pytest.mark.parametrize("window", [None, (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_position_bias_on_sdpa(window, dtype: torch.dtype) -> None:
    q, k, v = _inputs(dtype)
    longest = max(SEQ_LENS)
    offsets = torch.arange(longest)[None, :] - torch.arange(longest)[:, None]
    per_head = torch.randn(4, 2 * longest - 1, generator=torch.Generator().manual_seed(1)) * 3
    bias = per_head[:, offsets + longest - 1]  # [H, L, L], a function of j - i as MPNet's is
    got = _run(SdpaBackend(), q, k, v, False, window, bias)
    expected = reference(q, k, v, SEQ_LENS, False, window, bias)
    bound = 0.99999 if dtype == torch.float32 else 0.999
    assert F.cosine_similarity(got.flatten(1), expected.flatten(1)).min() > bound
    assert (got - reference(q, k, v, SEQ_LENS, False, window)).abs().max() > 1e-2


def test_a_backend_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="cannot run attention with a position bias"):
        CpuVarlenBackend().bind(AttentionShape(4, 2, 32, False, torch.float32, position_bias=True))
    SdpaBackend().bind(AttentionShape(4, 2, 32, False, torch.float32, windows=((8, 8),), position_bias=True))


def test_a_window_wider_than_every_sequence_changes_nothing() -> None:
    q, k, v = _inputs(torch.float32)
    wide = (max(SEQ_LENS), max(SEQ_LENS))
    got = _run(CpuVarlenBackend(), q, k, v, False, wide)
    np.testing.assert_allclose(got.numpy(), _run(CpuVarlenBackend(), q, k, v, False, None).numpy(), atol=1e-6)
