"""float32 linears of short steps (a query's few tokens) by a kernel of bouquet's own (kernels/int8_linear_f32.h):
register-blocked AVX-512 FMAs on a weight packed once at load, with the bias, the activation and a post-norm block's
residual add and LayerNorm fused, called through `kernel_call` so that a CPU graph can record them. Steps up to the
row count measured faster than oneDNN's packed linear at the model's shapes (`choose_f32_rows`, cached per machine)
run here, longer ones on oneDNN. The CPU probe's AVX-512 gates it, so `$ONEDNN_MAX_CPU_ISA` and
`$BOUQUET_CPU_FEATURES` emulate a CPU without it."""

from __future__ import annotations

import ctypes
import functools
import json
import logging
from pathlib import Path

import torch

from bouquet.cpu_features import AVX2, AVX512, cpu_features
from bouquet.kernels.build import KernelBuildError, load_kernel
from bouquet.kernels.openmp import on_passing_thread
from bouquet.kernels.recording import kernel_call
from bouquet.layers.kernel_timing import alternated_seconds, onednn_linears
from bouquet.machine_cache import measurement_path, write_measurement

logger = logging.getLogger(__name__)

ACTIVATION_CODES = {"none": 0, "gelu": 1, "gelu_tanh": 2, "relu": 3}  # int8_linear.c's ACT_*
# Row counts the choice is measured at: a query's step and short steps; the kernel's tiles are sized for them.
MEASURED_ROWS = (16, 32, 64, 128)
# Above this many bytes of linear weights the second, packed copy costs more memory than a query's gain is worth.
MAX_WEIGHT_BYTES = 2**30
_TURNS = 7


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_kernel("int8_linear")
    library.bouquet_f32_available.restype = ctypes.c_int
    library.bouquet_f32_available.argtypes = []
    library.bouquet_f32_packed_size.restype = ctypes.c_int64
    library.bouquet_f32_packed_size.argtypes = [ctypes.c_int64, ctypes.c_int64]
    library.bouquet_f32_pack.restype = None
    library.bouquet_f32_pack.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    library.bouquet_f32_linear.restype = ctypes.c_int
    library.bouquet_f32_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # x, rows, K, row stride
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,  # packed weight, N, bias or NULL, activation
        ctypes.c_void_p, ctypes.c_int64,  # out, its row stride
        ctypes.c_void_p, ctypes.c_int64,  # residual or NULL, its row stride
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,  # the norm's weight and bias, eps
    ]  # fmt: skip
    return library


def available() -> bool:
    """Whether the probe grants AVX-512 (read at every call, so that an emulated CPU is honoured), the CPU has it and
    the kernel builds here."""
    return cpu_features().has(*AVX2, *AVX512) and _built_for_this_cpu()


@functools.cache
def _built_for_this_cpu() -> bool:
    try:
        return bool(_library().bouquet_f32_available())
    except KernelBuildError as error:
        logger.warning("float32: the short-step product is unavailable, its kernel did not build: %s", error)
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> the kernel's column blocks of 32 output channels (N padded to a multiple of 32)."""
    assert weight.dtype == torch.float32 and weight.dim() == 2, "a float32 [N, K] weight"
    weight = weight.detach().contiguous()
    n, k = weight.shape
    packed = torch.empty(_library().bouquet_f32_packed_size(n, k), dtype=torch.float32)
    _library().bouquet_f32_pack(weight.data_ptr(), n, k, packed.data_ptr())
    return packed


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as float32 rows of contiguous values (a view where it already is)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.dtype == torch.float32 and rows.stride(-1) == 1 else rows.float().contiguous()


def f32_linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, bias: torch.Tensor | None, activation: str = "none"
) -> torch.Tensor:
    """act(x @ W.T + b): x [..., K] -> [..., N] float32; `bias` float32 [N] or None."""
    rows = _rows(x)
    out = torch.empty(rows.shape[0], out_features)
    failed = kernel_call(
        _library().bouquet_f32_linear,
        rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), ACTIVATION_CODES[activation], out.data_ptr(), out_features,
        None, 0, None, None, 0.0,
    )  # fmt: skip
    if failed:
        raise RuntimeError("the float32 short-step product ran where this build or CPU has no AVX-512")
    return out.view(*x.shape[:-1], out_features)


def f32_linear_add_norm(
    x: torch.Tensor,
    packed: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_bias: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """LayerNorm(residual + x @ W.T + b) in one call: the float32 residual stream [..., N] -> [..., N] float32."""
    rows = _rows(x)
    residual_rows = residual.reshape(-1, out_features)
    assert residual_rows.dtype == torch.float32 and residual_rows.stride(-1) == 1, "a float32 residual stream"
    out = torch.empty(rows.shape[0], out_features)
    failed = kernel_call(
        _library().bouquet_f32_linear,
        rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), packed.data_ptr(), out_features,
        None if bias is None else bias.data_ptr(), ACTIVATION_CODES["none"], out.data_ptr(), out_features,
        residual_rows.data_ptr(), residual_rows.stride(0), norm_weight.data_ptr(), norm_bias.data_ptr(), eps,
    )  # fmt: skip
    if failed:
        raise RuntimeError("the float32 short-step product ran where this build or CPU has no AVX-512")
    return out.view(residual.shape)


def choose_f32_rows(shapes: list[tuple[int, int]], threads: int) -> int:
    """Up to how many rows a step's float32 linears run on this kernel (0: never): timed against oneDNN's linear on
    packed weights at MEASURED_ROWS over the model's (in, out) shapes on `threads` threads, or read from this
    machine's cache of that measurement: the largest measured count up to which the kernel is faster at every
    count."""
    if not available() or not shapes:
        return 0
    path = measurement_path("f32_short", {"shapes": sorted(shapes), "rows": MEASURED_ROWS, "threads": threads})
    seconds = _read_cache(path)
    if seconds is None:
        seconds = on_passing_thread(lambda: measure(shapes, threads))
        write_measurement(path, {"seconds": {str(rows): pair for rows, pair in seconds.items()}})
    table = ", ".join(f"{rows}: {ours * 1e3:.3f} / {theirs * 1e3:.3f}" for rows, (ours, theirs) in seconds.items())
    logger.info("float32 short-step product against oneDNN, ms per set of the model's linears at rows: %s", table)
    up_to = 0
    for rows, (ours, theirs) in sorted(seconds.items()):
        if ours >= theirs:
            break
        up_to = rows
    return up_to


def measure(shapes: list[tuple[int, int]], threads: int) -> dict[int, tuple[float, float]]:
    """Seconds (the kernel, oneDNN) for one call of each shape, summed, per row count: the best of several turns,
    the two alternated so that a busy spell falls on both."""
    torch.set_num_threads(threads)
    weights = [torch.randn(n, k) for k, n in shapes]
    ours = [(pack(w), torch.randn(w.shape[0])) for w in weights]
    theirs = [(torch.ops.mkldnn._reorder_linear_weight(w), torch.randn(w.shape[0])) for w in weights]
    seconds = {}
    for rows in MEASURED_ROWS:
        inputs = [torch.randn(rows, k) for k, _ in shapes]
        works = (functools.partial(_run_ours, inputs, ours, shapes), functools.partial(onednn_linears, inputs, theirs))
        mine, onednn = alternated_seconds(*works, turns=_TURNS, summary=min)
        seconds[rows] = (mine, onednn)
    return seconds


def _run_ours(
    inputs: list[torch.Tensor], ours: list[tuple[torch.Tensor, torch.Tensor]], shapes: list[tuple[int, int]]
) -> None:
    for x, (packed, bias), (_, n) in zip(inputs, ours, shapes, strict=True):
        f32_linear(x, packed, n, bias)


def _read_cache(path: Path) -> dict[int, tuple[float, float]] | None:
    try:
        seconds = json.loads(path.read_text())["seconds"]
        return {int(rows): (float(pair[0]), float(pair[1])) for rows, pair in seconds.items()}
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None
