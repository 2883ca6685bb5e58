"""float32 linears of short steps (a query's few tokens) by a kernel of bouquet's own (kernels/int8_linear_f32.h):
register-blocked FMAs in AVX-512 or AVX2 on a weight packed once at load, with the bias, the activation and a post-norm
block's residual add and LayerNorm fused, called through `kernel_call` so that a CPU graph can record them. Steps up to
the row count measured no slower (within TIE_MARGIN) than oneDNN's packed linear at the model's shapes
(`choose_f32_rows`, cached per machine and ISA) run here, longer ones on oneDNN. The CPU probe picks the ISA (AVX-512
where it grants it, else AVX2 and FMA, else none), so `$ONEDNN_MAX_CPU_ISA` and `$BOUQUET_CPU_FEATURES` run the AVX2
code on an AVX-512 machine. The packed weight's last dimension, its block of output channels, names the ISA whose
kernel runs it."""

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
# Output channels a packed block holds (two vectors), by the ISA whose kernel runs it: the kernel's `block` argument.
BLOCKS = {"avx512": 32, "avx2": 16}
# Row counts the choice is measured at: a query's step and short steps; the kernel's tiles are sized for them.
MEASURED_ROWS = (16, 32, 64, 128)
# Above this many bytes of linear weights the second, packed copy costs more memory than a query's gain is worth.
MAX_WEIGHT_BYTES = 2**30
_TURNS = 7
# How much slower than oneDNN the kernel may measure at a row count and still take it (rows_from).
TIE_MARGIN = 1.05


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_kernel("int8_linear")
    library.bouquet_f32_available.restype = ctypes.c_int
    library.bouquet_f32_available.argtypes = [ctypes.c_int32]  # the layout's block
    library.bouquet_f32_pack.restype = None
    library.bouquet_f32_pack.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,  # weight, N, K, block, packed
    ]  # fmt: skip
    library.bouquet_f32_linear.restype = ctypes.c_int
    library.bouquet_f32_linear.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,  # x, rows, K, row stride
        ctypes.c_void_p, ctypes.c_int32,  # packed weight, its block (the ISA's layout)
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32,  # N, bias or NULL, activation
        ctypes.c_void_p, ctypes.c_int64,  # out, its row stride
        ctypes.c_void_p, ctypes.c_int64,  # residual or NULL, its row stride
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,  # the norm's weight and bias, eps
    ]  # fmt: skip
    return library


def kernel_isa() -> str | None:
    """The ISA whose kernel runs here: "avx512" where the probe grants AVX-512, else "avx2" where it grants AVX2 and
    FMA (the probe read at every call, so that an emulated CPU is honoured), the CPU has it and the kernel builds;
    else None."""
    features = cpu_features()
    isa = "avx512" if features.has(*AVX2, *AVX512) else "avx2" if features.has(*AVX2) else None
    return isa if isa is not None and cpu_runs(isa) else None


def available() -> bool:
    return kernel_isa() is not None


@functools.cache
def cpu_runs(isa: str) -> bool:
    """Whether this CPU has `isa` ("avx512", "avx2") and the kernel built here for it, whatever the probe says."""
    try:
        return bool(_library().bouquet_f32_available(BLOCKS[isa]))
    except KernelBuildError as error:
        logger.warning("float32: the short-step product is unavailable, its kernel did not build: %s", error)
        return False


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> [ceil(N / block), K, block]: the kernel's column blocks of `block` output channels (BLOCKS of
    the ISA that runs here), zero-padded past N."""
    assert weight.dtype == torch.float32 and weight.dim() == 2, "a float32 [N, K] weight"
    isa = kernel_isa()
    assert isa is not None, "the float32 short-step kernel does not run on this CPU"
    weight, block = weight.detach().contiguous(), BLOCKS[isa]
    n, k = weight.shape
    packed = torch.empty(-(-n // block), k, block, dtype=torch.float32)
    _library().bouquet_f32_pack(weight.data_ptr(), n, k, block, packed.data_ptr())
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
        rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), packed.data_ptr(), packed.shape[-1],
        out_features, None if bias is None else bias.data_ptr(), ACTIVATION_CODES[activation], out.data_ptr(),
        out_features, None, 0, None, None, 0.0,
    )  # fmt: skip
    if failed:
        raise RuntimeError(f"the float32 short-step product has no kernel for blocks of {packed.shape[-1]} here")
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
        rows.data_ptr(), rows.shape[0], rows.shape[1], rows.stride(0), packed.data_ptr(), packed.shape[-1],
        out_features, None if bias is None else bias.data_ptr(), ACTIVATION_CODES["none"], out.data_ptr(),
        out_features, residual_rows.data_ptr(), residual_rows.stride(0), norm_weight.data_ptr(), norm_bias.data_ptr(),
        eps,
    )  # fmt: skip
    if failed:
        raise RuntimeError(f"the float32 short-step product has no kernel for blocks of {packed.shape[-1]} here")
    return out.view(residual.shape)


def choose_f32_rows(shapes: list[tuple[int, int]], threads: int) -> int:
    """Up to how many rows a step's float32 linears run on this kernel (0: never): timed against oneDNN's linear on
    packed weights at MEASURED_ROWS over the model's (in, out) shapes on `threads` threads, or read from this
    machine's cache of that measurement (per ISA the kernel runs in), read by `rows_from`."""
    isa = kernel_isa()
    if isa is None or not shapes:
        return 0
    key = {"shapes": sorted(shapes), "rows": MEASURED_ROWS, "threads": threads, "isa": isa}
    path = measurement_path("f32_short", key)
    seconds = _read_cache(path)
    if seconds is None:
        seconds = on_passing_thread(lambda: measure(shapes, threads))
        write_measurement(path, {"seconds": {str(rows): pair for rows, pair in seconds.items()}})
    table = ", ".join(f"{rows}: {ours * 1e3:.3f} / {theirs * 1e3:.3f}" for rows, (ours, theirs) in seconds.items())
    logger.info(
        "float32 short-step product (%s) against oneDNN, ms per set of the model's linears at rows: %s", isa, table
    )
    return rows_from(seconds)


def rows_from(seconds: dict[int, tuple[float, float]]) -> int:
    """The largest measured count up to which the kernel is never more than TIE_MARGIN slower than oneDNN at any
    count (0: none). A tie goes to the kernel: its calls let a CPU graph replay the whole step, while one oneDNN
    linear in a step leaves every layer eager, which costs a lone query far more than a tie's few percent (a
    34-token query 8.2 ms eager against ~4.5 replayed: docs/benchmarks.md, "float32's p99")."""
    up_to = 0
    for rows, (ours, theirs) in sorted(seconds.items()):
        if ours > TIE_MARGIN * theirs:
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
