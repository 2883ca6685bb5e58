"""Variable-length attention on the CPU with bouquet's own C kernel (kernels/varlen_attention.c).

Packed sequences go in as they are: no padding, no grouping by length, no gathers, and q, k and v may be
strided views of the fused QKV projection. On real documents (head_dim 32, one thread) its attention is 1.56x
as fast as SDPA's grouped calls in float32 and 2.4x in bfloat16 with AVX512-BF16 dot products; 1.2x and 2.2x
one SDPA call per sequence (docs/benchmarks.md, "cpu_varlen"). The kernel is compiled on first use
(kernels/build.py); without a C compiler this backend is unavailable and `auto` falls back to SDPA.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
from typing import ClassVar

import torch

from bouquet.cpu_features import cpu_features
from bouquet.kernels.build import KernelBuildError, load_kernel
from bouquet.kernels.recording import kernel_call
from bouquet.layers.attention_backends.base import AttentionBackend, AttentionShape, BackendUnavailableError
from bouquet.layers.context import ForwardContext

DTYPES = (torch.float32, torch.bfloat16)
ISA_LEVELS = {"avx512": 4, "avx2": 2, "baseline": 0}  # the kernel's `isa` argument
HEAD_DIM_MULTIPLE = 16  # one vector of float32 lanes


def supports(shape: AttentionShape) -> bool:
    return shape.dtype in DTYPES and shape.head_dim % HEAD_DIM_MULTIPLE == 0 and not shape.position_bias


@functools.cache
def _library() -> ctypes.CDLL:
    return load_kernel("varlen_attention")


@functools.cache
def _kernel() -> ctypes._CFuncPtr:
    function = _library().bouquet_varlen_attention
    function.restype = ctypes.c_int
    function.argtypes = [
        *[ctypes.c_void_p] * 5,  # q, k, v, out, cu_seqlens
        *[ctypes.c_int32] * 4,  # num_seqs, num_heads, num_kv_heads, head_dim
        *[ctypes.c_int64] * 4,  # token strides of q, k, v, out
        ctypes.c_float,  # scale
        ctypes.c_int32,  # causal
        ctypes.c_int32,  # bfloat16 (else float32)
        ctypes.c_int32,  # bfloat16 by dot products where the CPU has them (AVX512-BF16)
        *[ctypes.c_int64] * 2,  # sliding window: keys before and after each query (-1: unbounded)
        ctypes.c_int32,  # the widest vector code to use: ISA_LEVELS' value, capped by the kernel at the CPU's
    ]
    return function


def has_bf16_dot() -> bool:
    """Whether this CPU runs bfloat16 attention by dot products (AVX512-BF16), not widened to float32: the
    CPU has it and the feature probe allows it."""
    return bool(_library().bouquet_has_bf16_dot()) and cpu_features().has("avx512_bf16") and kernel_isa() == "avx512"


def kernel_isa(isa: str | None = None) -> str:
    """The vector code the kernel runs for `isa` (default: the probe's), capped at what the CPU has."""
    level = _library().bouquet_attention_isa(ISA_LEVELS[isa or cpu_features().isa])
    return next(name for name, value in ISA_LEVELS.items() if value == level)


class CpuVarlenBackend(AttentionBackend):
    """`bf16_dot`: bfloat16 inputs take the dot-product path where the CPU has AVX512-BF16 (QK^T and PV about
    twice as fast; the probabilities are rounded to bfloat16 for PV, as in ATen's bfloat16 attention). False
    widens everything to float32 first, the path CPUs without it take. `isa`: the widest vector code to run
    ("avx512", "avx2", "baseline"; default the CPU probe's, cpu_features.py), so a test forces AVX2's here."""

    name: ClassVar[str] = "cpu_varlen"
    # A windowed layer costs window-sized work: each query tile reads only the keys its rows may see.
    supports_sliding_window: ClassVar[bool] = True

    def __init__(self, bf16_dot: bool = True, isa: str | None = None) -> None:
        try:
            self._attention = _kernel()
        except KernelBuildError as error:
            raise BackendUnavailableError(f"cpu_varlen needs its C kernel: {error}") from error
        self.isa = kernel_isa(isa)
        self.bf16_dot = bf16_dot and has_bf16_dot() and self.isa == "avx512"

    def bind(self, shape: AttentionShape) -> None:
        if not self.can_run(shape):
            super().bind(shape)  # refuses, naming what the model needs
        if not supports(shape):
            raise ValueError(
                f"cpu_varlen needs float32 or bfloat16 and head_dim a multiple of {HEAD_DIM_MULTIPLE}, got "
                f"{shape.dtype} and head_dim {shape.head_dim}; use sdpa"
            )
        super().bind(shape)

    def prepare(self, ctx: ForwardContext) -> tuple[torch.Tensor, int]:
        """cu_seqlens as the kernel reads it (int32, contiguous), checked against seq_lens, and the tokens it
        covers. The kernel trusts it for every row it reads."""
        if ctx.cu_seqlens.device.type != "cpu":
            raise ValueError("cpu_varlen runs on the CPU only")
        cu_seqlens = ctx.cu_seqlens.to(torch.int32).contiguous()
        if cu_seqlens.tolist() != [0, *itertools.accumulate(ctx.seq_lens)] or min(ctx.seq_lens, default=0) < 0:
            raise ValueError(f"cu_seqlens {cu_seqlens.tolist()} do not match seq_lens {ctx.seq_lens}")
        return cu_seqlens, sum(ctx.seq_lens)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        ctx: ForwardContext,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        if bias is not None:
            raise ValueError("cpu_varlen adds no position bias; use sdpa (auto does)")
        cu_seqlens, covered = ctx.attn_metadata
        num_tokens, num_heads, head_dim = q.shape
        q, k, v = (_token_strided(t, q.dtype) for t in (q, k, v))
        kv_heads = k.shape[1]
        fits = num_tokens == covered == k.shape[0] and k.shape == v.shape and k.shape[2] == head_dim
        if not fits or kv_heads == 0 or num_heads % kv_heads:
            raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit the batch's "
                             f"{covered} tokens")  # fmt: skip
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        failed = kernel_call(
            self._attention, q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(), cu_seqlens.data_ptr(),
            len(cu_seqlens) - 1, num_heads, kv_heads, head_dim,
            q.stride(0), k.stride(0), v.stride(0), out.stride(0),
            scale, int(causal), int(q.dtype == torch.bfloat16), int(self.bf16_dot), *(window or (-1, -1)),
            ISA_LEVELS[self.isa],
        )  # fmt: skip
        if failed:
            raise MemoryError("cpu_varlen: the kernel could not allocate its scratch buffers")
        return out


def _token_strided(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` as the kernel reads it: on the CPU, in `dtype`, each token's [heads, head_dim] values contiguous (a
    token stride of its own is fine, so views of the fused QKV projection pass without a copy)."""
    if t.dtype != dtype or t.dtype not in DTYPES or t.device.type != "cpu":
        raise ValueError(f"cpu_varlen needs CPU float32 or bfloat16 q, k, v of one dtype, got {t.dtype} on {t.device}")
    head_dim = t.shape[2]
    if head_dim % HEAD_DIM_MULTIPLE:
        raise ValueError(f"cpu_varlen needs head_dim a multiple of {HEAD_DIM_MULTIPLE}, got {head_dim}")
    if t.stride(2) != 1 or t.stride(1) != head_dim:
        t = t.contiguous()
    return t
