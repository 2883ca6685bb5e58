"""FlashAttention varlen over packed sequences: flash-attn-4 (CuTe DSL, Hopper and Blackwell) when
installed, else FlashAttention 2's `flash_attn_varlen_func`, else on CUDA the FlashAttention 2 kernels built
into PyTorch (`aten::_flash_attention_forward`, the op behind SDPA's flash path, which takes cu_seqlens).

The last needs no wheel. That matters on the lent GPU machine: flash-attn-4's CuTe DSL libraries (92 MB for
CUDA 13) and flashinfer-python (101 MB) are each larger than the 64 MiB a device call can carry.

Its only metadata is `cu_seqlens` and `max_seqlen`, so it runs inside a CUDA graph as it is: the graph's
`cu_seqlens` is a static buffer and `max_seqlen` is fixed per bucket (the bucket's token count, an upper
bound). Written against the libraries' published signatures; not yet run on a GPU.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable
from typing import Any, ClassVar

import torch

from bouquet.layers.attention_backends.base import AttentionBackend, BackendUnavailableError
from bouquet.layers.context import ForwardContext

VarlenFunc = Callable[..., Any]


def load_varlen_func() -> tuple[VarlenFunc, str]:
    """The newest FlashAttention varlen forward installed, and which one it is.

    Any failure to import counts as "not installed", not only ImportError: flash-attn-4 pulls in the CuTe DSL
    and the CUDA driver bindings, whose imports may raise RuntimeError or OSError on a machine they do not
    fit. The error names both attempts, so a broken install is told apart from a missing one.
    """
    reasons = []
    try:
        from flash_attn.cute import flash_attn_varlen_func  # flash-attn-4

        return flash_attn_varlen_func, "flash-attn-4 (CuTe DSL)"
    except Exception as error:
        reasons.append(f"flash_attn.cute: {type(error).__name__}: {error}")
    try:
        from flash_attn import flash_attn_varlen_func  # FlashAttention 2

        return flash_attn_varlen_func, "flash-attn 2"
    except Exception as error:
        reasons.append(f"flash_attn: {type(error).__name__}: {error}")
    if torch.cuda.is_available():
        return torch_flash_varlen, "PyTorch's built-in FlashAttention 2"
    reasons.append("PyTorch's built-in FlashAttention: CUDA only")
    raise BackendUnavailableError(
        "attention backend 'flash_attn' needs FlashAttention: pip install flash-attn-4 (Hopper, Blackwell) "
        f"or flash-attn (FlashAttention 2), or a GPU for PyTorch's own; {'; '.join(reasons)}"
    )


# Looked up at call time so that CPU tests can stand in for the CUDA-only kernel.
_torch_flash_forward: Callable[..., tuple[torch.Tensor, ...]] = torch.ops.aten._flash_attention_forward


def torch_flash_varlen(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, Hkv, D]; Hkv divides H (the kernel handles GQA itself)
    v: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor,  # [B + 1] int32 on the device
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
) -> torch.Tensor:  # [T, H, D]
    """FlashAttention 2's varlen call, as flash-attn's keywords, on PyTorch's own kernel. Nothing is read back
    to the host and no dropout generator is touched (dropout 0), so it can be captured in a CUDA graph."""
    left, right = (None if side < 0 else side for side in window_size)
    out, *_ = _torch_flash_forward(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, 0.0, causal, False, scale=softmax_scale,
        window_size_left=left, window_size_right=right,
    )  # fmt: skip
    return out


class FlashAttnBackend(AttentionBackend):
    name: ClassVar[str] = "flash_attn"
    supports_cuda_graphs: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True  # window_size=(left, right), all three implementations

    def __init__(self) -> None:
        self._varlen, self.version = load_varlen_func()
        # flash-attn-4 picks a KV split count itself when num_splits < 1, reading max lengths back from
        # cu_seqlens (.item(): a host sync, which a graph capture forbids). One split, always; FA2 has no such
        # argument.
        accepts_splits = "num_splits" in inspect.signature(self._varlen).parameters
        self._options: dict[str, Any] = {"num_splits": 1} if accepts_splits else {}

    def prepare(self, ctx: ForwardContext) -> None:
        return None  # cu_seqlens and max_seqlen in the context are all it reads

    def prepare_capture(self, ctx: ForwardContext, key: Hashable) -> None:
        return None

    def prepare_replay(self, ctx: ForwardContext, key: Hashable) -> None:
        pass  # the replayed cu_seqlens buffer already holds this batch's offsets

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D] bfloat16 or float16
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        ctx: ForwardContext,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        assert q.dtype in (torch.bfloat16, torch.float16), f"flash_attn needs bfloat16 or float16, got {q.dtype}"
        assert bias is None, "flash_attn adds no position bias (bind refuses such a model)"
        # Both take cu_seqlens as contiguous int32 on the device and max_seqlen as a Python int; neither reads
        # anything back to the host, so the call can be captured. Keywords only: the two versions order the
        # arguments after max_seqlen_k differently.
        out = self._varlen(
            q,
            k,
            v,
            cu_seqlens_q=ctx.cu_seqlens,
            cu_seqlens_k=ctx.cu_seqlens,
            max_seqlen_q=ctx.max_seqlen,
            max_seqlen_k=ctx.max_seqlen,
            softmax_scale=scale,
            causal=causal,
            **({} if window is None else {"window_size": window}),
            **self._options,
        )
        # flash-attn-4 returns (out, lse), lse None unless asked for; FlashAttention 2 returns out alone.
        return out[0] if isinstance(out, tuple) else out
