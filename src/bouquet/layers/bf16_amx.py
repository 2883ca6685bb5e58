"""bfloat16 linears on AMX tiles by a kernel of bouquet's own (kernels/int8_linear_bf16.h), where the engine measures
them faster than oneDNN's bfloat16 linear at the model's shapes (`choose_bf16_rows`); the weight is packed once
at load. The CPU probe's `amx_bf16` gates it, so `$ONEDNN_MAX_CPU_ISA` and `$BOUQUET_CPU_FEATURES` emulate a CPU
without it."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from bouquet.cpu_features import cpu_features
from bouquet.kernels.build import KernelBuildError, load_kernel
from bouquet.kernels.recording import kernel_call
from bouquet.layers.kernel_timing import alternated_seconds, onednn_linears

logger = logging.getLogger(__name__)

ACTIVATION_CODES = {"none": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}  # int8_linear.c's ACT_*
_INPUT_BLOCK, _OUTPUT_BLOCK = 32, 16
# Row counts the choice is measured at: a query's step, a short step, a document step's share.
MEASURED_ROWS = (16, 128, 512)


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_kernel("int8_linear")
    library.bouquet_amx_bf16_available.restype = ctypes.c_int
    library.bouquet_amx_bf16_available.argtypes = []
    library.bouquet_amx_bf16_pack.restype = None
    library.bouquet_amx_bf16_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.bouquet_amx_bf16_linear.restype = ctypes.c_int
    library.bouquet_amx_bf16_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # x, float32?, rows, K, stride
        ctypes.c_void_p, ctypes.c_int64,  # packed weight, out_features
        ctypes.c_void_p, ctypes.c_int,  # float32 bias or NULL, activation
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # out, its row stride, bfloat16 scratch for float32 x
    ]  # fmt: skip
    library.bouquet_amx_bf16_linear_add_norm.restype = ctypes.c_int
    library.bouquet_amx_bf16_linear_add_norm.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # as above
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # packed weight, out_features, float32 bias or NULL
        ctypes.c_void_p, ctypes.c_int64,  # float32 residual, its row stride
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,  # the norm's float32 weight and bias, eps
        ctypes.c_void_p, ctypes.c_void_p,  # float32 out, bfloat16 scratch for float32 x
    ]  # fmt: skip
    return library


def available() -> bool:
    """Whether the probe grants AMX-BF16 (read at every call, so that an emulated CPU is honoured), the CPU has it,
    Linux lets this process use the tiles, and the kernel builds here."""
    return all(cpu_features().has(flag) for flag in ("amx_tile", "amx_bf16")) and _tiles_granted()


@functools.cache
def _tiles_granted() -> bool:
    try:
        return bool(_library().bouquet_amx_bf16_available())
    except KernelBuildError as error:
        logger.warning("bfloat16: the AMX product is unavailable, its kernel did not build: %s", error)
        return False


def fits(in_features: int, out_features: int) -> bool:
    return in_features % _INPUT_BLOCK == 0 and out_features % _OUTPUT_BLOCK == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 -> its N * K values in the tiles' block order."""
    assert weight.dtype == torch.bfloat16 and weight.dim() == 2 and fits(weight.shape[1], weight.shape[0])
    weight = weight.detach().contiguous()
    packed = torch.empty(weight.numel(), dtype=torch.bfloat16)
    _library().bouquet_amx_bf16_pack(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
    return packed


def _input_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., K] as rows the kernel reads (bfloat16, or float32 that it converts into the returned scratch)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.dtype not in (torch.bfloat16, torch.float32) or rows.stride(-1) != 1:
        rows = rows.float().contiguous()
    converted = torch.empty(rows.shape, dtype=torch.bfloat16) if rows.dtype == torch.float32 else None
    return rows, converted


def amx_bf16_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, activation: str = "none"
) -> torch.Tensor:
    """act(x @ W.T + b): x [..., K] bfloat16 or float32 (rounded to bfloat16) -> [..., N] bfloat16; `bias`
    float32 or None."""
    rows, converted = _input_rows(x)
    out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
    failed = kernel_call(
        _library().bouquet_amx_bf16_linear,
        rows.data_ptr(), converted is not None, rows.shape[0], rows.shape[1], rows.stride(0), packed.data_ptr(),
        out_features, None if bias is None else bias.data_ptr(), ACTIVATION_CODES[activation], out.data_ptr(),
        out_features, None if converted is None else converted.data_ptr(),
    )  # fmt: skip
    if failed:
        raise RuntimeError("the AMX bfloat16 product ran where this build has no AMX")
    return out.view(*x.shape[:-1], out_features)


def amx_bf16_linear_add_norm(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """LayerNorm(residual + x @ W.T + b) in one call: x as `amx_bf16_linear` takes it, the float32 residual stream
    [..., N] -> [..., N] float32, the sum never rounded to bfloat16; bias and the norm's weight and bias float32."""
    rows, converted = _input_rows(x)
    residual_rows = residual.reshape(-1, out_features)
    assert residual_rows.dtype == torch.float32 and residual_rows.stride(-1) == 1, "a float32 residual stream"
    out = torch.empty(rows.shape[0], out_features)
    failed = kernel_call(
        _library().bouquet_amx_bf16_linear_add_norm,
        rows.data_ptr(), converted is not None, rows.shape[0], rows.shape[1], rows.stride(0), packed.data_ptr(),
        out_features, None if bias is None else bias.data_ptr(), residual_rows.data_ptr(), residual_rows.stride(0),
        norm_weight.data_ptr(), norm_bias.data_ptr(), eps, out.data_ptr(),
        None if converted is None else converted.data_ptr(),
    )  # fmt: skip
    if failed:
        raise RuntimeError("the AMX bfloat16 product ran where this build has no AMX")
    return out.view(residual.shape)


def choose_bf16_rows(shapes: list[tuple[int, int]], threads: int) -> int:
    """Up to how many rows a step's linears run on the AMX kernel (0: never; -1: at every count): timed against
    oneDNN's bfloat16 linear on packed weights at MEASURED_ROWS, over the model's (in, out) shapes, on `threads`
    threads: up to half the first count where oneDNN is faster, every count when it never is."""
    shapes = [shape for shape in shapes if fits(*shape)]
    if not available() or not shapes:
        return 0
    weights = [torch.randn(n, k).to(torch.bfloat16) for k, n in shapes]
    ours = [(pack(w), torch.randn(w.shape[0])) for w in weights]
    theirs = [(torch.ops.mkldnn._reorder_linear_weight(w), w.new_zeros(w.shape[0])) for w in weights]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in MEASURED_ROWS:
            inputs = [torch.randn(rows, k).to(torch.bfloat16) for k, _ in shapes]
            mine, onednn = alternated_seconds(
                functools.partial(_run_ours, inputs, ours, shapes), functools.partial(onednn_linears, inputs, theirs)
            )
            logger.debug("bfloat16 linears at %d rows: AMX %.3f ms, oneDNN %.3f ms", rows, mine * 1e3, onednn * 1e3)
            if mine >= onednn:
                return rows // 2 if rows > MEASURED_ROWS[0] else 0
    finally:
        torch.set_num_threads(previous)
    return -1


def _run_ours(
    inputs: list[torch.Tensor], ours: list[tuple[torch.Tensor, torch.Tensor]], shapes: list[tuple[int, int]]
) -> None:
    for x, (packed, bias), (_, n) in zip(inputs, ours, shapes, strict=True):
        amx_bf16_linear(x, packed, n, bias)
