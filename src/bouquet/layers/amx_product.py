"""int8 x int8 -> int32 products on AMX tiles (kernels/int8_linear_amx.h), one of the int8 linears' products
(layers/int8_products.py measures it beside oneDNN's two and chooses per call size).

The weight is packed once at load into the tiles' block order (16 output channels x 64 inputs a block); a call
reads the activation codes as they are (rows of K bytes) and writes int32 sums, which the dequantizing pass reads
as `torch._int_mm`'s. A linear on this product runs as one kernel call, quantizing, product and dequantizing
(layers/int8_linear.py). Shapes whose inputs are not a multiple of 64 or outputs not a multiple of 16 keep another
product (`fits`)."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from bouquet.cpu_features import cpu_features
from bouquet.kernels.build import KernelBuildError, load_kernel
from bouquet.kernels.recording import kernel_call
from bouquet.layers.int8_product_call import LINEAR_ARGTYPES, PRODUCT_ARGTYPES, int32_product

logger = logging.getLogger(__name__)

AMX_PRODUCT = "amx"
_INPUT_BLOCK, _OUTPUT_BLOCK = 64, 16


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_kernel("int8_linear")
    library.bouquet_amx_available.restype = ctypes.c_int
    library.bouquet_amx_available.argtypes = []
    library.bouquet_amx_pack.restype = None
    library.bouquet_amx_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.bouquet_amx_product.restype = ctypes.c_int
    library.bouquet_amx_product.argtypes = PRODUCT_ARGTYPES
    library.bouquet_amx_linear.restype = ctypes.c_int
    library.bouquet_amx_linear.argtypes = LINEAR_ARGTYPES
    return library


@functools.cache
def amx_available() -> bool:
    """Whether the CPU probe grants AMX-INT8 (so `$ONEDNN_MAX_CPU_ISA` and `$BOUQUET_CPU_FEATURES` emulate a CPU
    without it), the CPU has it, Linux lets this process use the tiles, and the kernel builds here."""
    if not all(cpu_features().has(flag) for flag in ("amx_tile", "amx_int8")):
        return False
    try:
        return bool(_library().bouquet_amx_available())
    except KernelBuildError as error:
        logger.warning("int8: the AMX product is unavailable, its kernel did not build: %s", error)
        return False


def fits(in_features: int, out_features: int) -> bool:
    return in_features % _INPUT_BLOCK == 0 and out_features % _OUTPUT_BLOCK == 0


def pack_for_amx(rows: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weight rows -> their N * K bytes in the tiles' block order."""
    assert rows.dtype == torch.int8 and rows.dim() == 2 and fits(rows.shape[1], rows.shape[0])
    rows = rows.contiguous()
    packed = torch.empty(rows.numel(), dtype=torch.int8)
    _library().bouquet_amx_pack(rows.data_ptr(), rows.shape[0], rows.shape[1], packed.data_ptr())
    return packed


def amx_linear(library_args: tuple[object, ...]) -> None:
    """One int8 linear on AMX, quantizing and dequantizing included (`bouquet_amx_linear`'s arguments, built by
    layers/int8_linear.py, which owns the passes' conventions)."""
    if kernel_call(_library().bouquet_amx_linear, *library_args):
        raise RuntimeError("the AMX int8 product ran where this build has no AMX")


def amx_product(values: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """[T, K] int8 codes (rows contiguous) times the packed weight: [T, N] int32."""
    assert packed.numel() == values.shape[-1] * out_features, "a weight packed for another shape"
    return int32_product(_library().bouquet_amx_product, values, packed, out_features, "AMX")
