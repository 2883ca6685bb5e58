"""int8 x int8 -> int32 products by AVX-512 VNNI (kernels/int8_linear_vnni.h), one of the int8 linears' products
(layers/int8_products.py measures it beside oneDNN's and chooses per call size): a query's few rows split by
column groups between threads, a document step's rows split by rows, in chunks whose dequantizing, residual and
LayerNorm run while the chunk is in cache.

The weight is packed once at load into column blocks of 32 output channels, four inputs a lane, shifted to unsigned
bytes (what `vpdpbusd` multiplies the signed activation codes by); the kernel takes the shift off, so its int32 sums
are the other products' exactly. A linear on this product runs as one kernel call, quantizing, product and
dequantizing each column group while it is in cache (layers/int8_linear.py). Any shape: a weight whose inputs or
outputs are not a multiple of the blocks is zero-padded in its packed copy.

The CPU probe gates it (AVX-512 and AVX512-VNNI), so `$ONEDNN_MAX_CPU_ISA` and `$BOUQUET_CPU_FEATURES` emulate a
CPU without it. On CPUs without VNNI the int8 weights are narrowed for oneDNN's `vpmaddubsw` and this product is
never offered."""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from bouquet.cpu_features import AVX2, AVX512, cpu_features
from bouquet.kernels.build import KernelBuildError, load_kernel
from bouquet.kernels.recording import kernel_call
from bouquet.layers.int8_product_call import LINEAR_ARGTYPES, PRODUCT_ARGTYPES, int32_product

logger = logging.getLogger(__name__)

VNNI_PRODUCT = "vnni"


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_kernel("int8_linear")
    library.bouquet_vnni_available.restype = ctypes.c_int
    library.bouquet_vnni_available.argtypes = []
    library.bouquet_vnni_packed_size.restype = ctypes.c_int64
    library.bouquet_vnni_packed_size.argtypes = [ctypes.c_int64, ctypes.c_int64]
    library.bouquet_vnni_pack.restype = None
    library.bouquet_vnni_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.bouquet_vnni_product.restype = ctypes.c_int
    library.bouquet_vnni_product.argtypes = PRODUCT_ARGTYPES
    library.bouquet_vnni_linear.restype = ctypes.c_int
    library.bouquet_vnni_linear.argtypes = LINEAR_ARGTYPES
    return library


def vnni_available() -> bool:
    """Whether the CPU probe grants AVX-512 and AVX512-VNNI (read at every call, so that an emulated CPU is
    honoured), the CPU has them and the kernel builds here."""
    return cpu_features().has(*AVX2, *AVX512, "avx512_vnni") and _built_for_this_cpu()


@functools.cache
def _built_for_this_cpu() -> bool:
    try:
        return bool(_library().bouquet_vnni_available())
    except KernelBuildError as error:
        logger.warning("int8: the VNNI product is unavailable, its kernel did not build: %s", error)
        return False


def pack_for_vnni(rows: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 weight rows (|w| <= 127) -> the kernel's column blocks, as unsigned bytes."""
    assert rows.dtype == torch.int8 and rows.dim() == 2, "an int8 [N, K] weight"
    assert int(rows.min()) >= -127, "|w| <= 127: -128 has no unsigned code after the shift"
    rows = rows.contiguous()
    n, k = rows.shape
    packed = torch.empty(_library().bouquet_vnni_packed_size(n, k), dtype=torch.uint8)
    _library().bouquet_vnni_pack(rows.data_ptr(), n, k, packed.data_ptr())
    return packed


def vnni_linear(library_args: tuple[object, ...]) -> None:
    """One int8 linear on the VNNI product, quantizing and dequantizing included (`bouquet_vnni_linear`'s
    arguments, built by layers/int8_linear.py, which owns the passes' conventions)."""
    if kernel_call(_library().bouquet_vnni_linear, *library_args):
        raise RuntimeError("the VNNI int8 product ran where this build has no VNNI")


def vnni_product(values: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """[T, K] int8 codes (rows contiguous) times the packed weight: [T, N] int32."""
    packed_size = _library().bouquet_vnni_packed_size(out_features, values.shape[-1])
    assert packed.numel() == packed_size, "a weight packed for another shape"
    return int32_product(_library().bouquet_vnni_product, values, packed, out_features, "VNNI")
