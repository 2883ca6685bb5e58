"""One call of bouquet's own int8 product kernels (AMX tiles, layers/amx_product.py; AVX-512 VNNI,
layers/vnni_product.py), which share a contract: [T, K] int8 codes with contiguous rows, times a weight packed for
that kernel, into new [T, N] int32 sums, through `kernel_call` so that a CPU graph records it; and their C
signatures, the same for both (`bouquet_*_product`, `bouquet_*_linear`)."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from bouquet.kernels.recording import kernel_call

PRODUCT_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # a, rows, inputs, a's row stride
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,  # packed, outputs, c, c's row stride
]  # fmt: skip
LINEAR_ARGTYPES = [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # x, rows, inputs, x's row stride
    ctypes.c_void_p, ctypes.c_int64,  # the rotation's signs (or None), its block
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # scratch: codes, row scales, row zero points
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,  # packed weight, outputs, out
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32,  # channel scales, sums, bias, activation
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,  # residual, its stride, norm
]  # fmt: skip


def int32_product(
    entry: Callable[..., int], values: torch.Tensor, packed: torch.Tensor, out_features: int, name: str
) -> torch.Tensor:
    """`entry`'s sums of `values` (int8 [T, K]) and `packed`: [T, out_features] int32. The kernels answer nonzero
    where their build or CPU lacks the instructions: a RuntimeError naming `name`."""
    assert values.dtype == torch.int8 and values.dim() == 2 and values.stride(1) == 1
    rows, inputs = values.shape
    out = torch.empty(rows, out_features, dtype=torch.int32)
    failed = kernel_call(
        entry,
        values.data_ptr(), rows, inputs, values.stride(0),
        packed.data_ptr(), out_features, out.data_ptr(), out_features,
    )  # fmt: skip
    if failed:
        raise RuntimeError(f"the {name} int8 product ran where this build has no {name}")
    return out
