"""int8 linears on the CPU (`--dtype int8`): weights quantized at load, activations per token at every call.

y = dequantize(int8(x) @ int8(W).T) + b: weights symmetric per output channel (scale = the channel's largest
magnitude / limit), activations asymmetric per row (per token: a scale and an integer zero point), the product
accumulated exactly in int32 (`torch._int_mm`, oneDNN's matmul on a prepacked weight, or bouquet's own AMX or
AVX-512 VNNI kernel where the CPU has them: layers/int8_products.py times them), then the zero point taken off
with each channel's weight sum, scaled back to float32 by the row's and the channel's scales, with the bias and the
layer's activation applied in the same pass (kernels/int8_linear.c). No calibration data: a row's scale comes from the
row itself, so one outlier token costs no other token its precision. Asymmetric rows, rather than symmetric ones,
took MiniLM's worst query from 0.986 to 0.995 cosine to float32 (docs/benchmarks.md).

Each linear's input space is rotated first (`InputRotation`): x @ W.T = (x R) @ (W R).T for an orthogonal R, so
the weight is stored as W R and every activation row is multiplied by R while it is quantized. R is random signs
then a Hadamard transform of blocks of up to 128 channels: it spreads the few outlier channels that a normalised
residual stream carries (14x the median channel's largest value in MiniLM) over the whole block, so they no longer
set every token's scale, and it does the same for the weights' outliers. No data is needed (QuaRot's idea, for
8-bit here); the transform costs a few vector operations a value inside the quantizing pass.

The weights' range is measured, not assumed (`weight_range`): CPUs without VNNI multiply int8 with `vpmaddubsw`,
which adds the u8 x s8 products of two adjacent inputs (k = 2j, 2j + 1) in 16 bits, saturating at 32,767, so
full-range weights can overflow (oneDNN shifts s8 activations to u8, up to 255). ONNX Runtime's `reduce_range`
gives every weight 7 bits (|w| <= 63: 2 x 255 x 63 < 32,767); the bound only needs each adjacent pair's magnitudes
to sum to 128 or less (255 x 128 = 32,640), so there each channel's scale is set by its largest pair sum rather
than its largest weight: a channel's weights keep up to 8 bits, and on MiniLM (rotated) their squared rounding error
is 0.49x 7-bit weights' (8-bit: 0.25x), which took its recall@10 from 0.977 to 0.981 there (docs/benchmarks.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import threading
from dataclasses import dataclass

import torch
from torch import nn

from bouquet.cpu_features import cpu_features
from bouquet.kernels.build import load_kernel
from bouquet.kernels.openmp import on_passing_thread
from bouquet.kernels.recording import kernel_call, op_call
from bouquet.layers.amx_product import AMX_PRODUCT, amx_linear, amx_product, pack_for_amx
from bouquet.layers.amx_product import fits as amx_fits
from bouquet.layers.vnni_product import VNNI_PRODUCT, pack_for_vnni, vnni_linear, vnni_product

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WeightRange:
    """The int8 codes a product computes exactly on this CPU: |w| <= `limit`, and, where the product adds two
    inputs' products in 16 bits, |w[2j]| + |w[2j + 1]| <= `pair_sum`."""

    limit: int
    pair_sum: int | None = None

    @property
    def full(self) -> bool:
        return self == FULL_RANGE

    def describe(self) -> str:
        if self.pair_sum is None:
            return f"|w| <= {self.limit}"
        return f"|w| <= {self.limit}, adjacent pairs' |w| summed <= {self.pair_sum}"


FULL_RANGE = WeightRange(127)
PAIRED_RANGE = WeightRange(127, 128)  # 255 x 128 < 32,767: vpmaddubsw's pair sum cannot saturate
REDUCED_RANGE = WeightRange(63)  # 2 x 255 x 63 < 32,767 however the product pairs its inputs
# The kernel's activation codes, by the names LinearActivation fuses.
ACTIVATIONS = {"none": 0, "gelu": 1, "gelu_new": 2, "gelu_pytorch_tanh": 2, "relu": 3}
# The int8 products: `torch._int_mm` (oneDNN's s8 x s8 -> s32 GEMM on the plain weight), oneDNN's matmul
# primitive on its own prepacked layout (`onednn::qlinear_pointwise`), AMX_PRODUCT (layers/amx_product.py) and
# VNNI_PRODUCT (layers/vnni_product.py).
# layers/int8_products.py times them.
INT_MM_PRODUCT, ONEDNN_PRODUCT = "int_mm", "onednn"


# The largest Hadamard block: wider blocks measured no better on MiniLM's recall (docs/benchmarks.md).
MAX_ROTATION_BLOCK = 128
_ROTATION_SEED = 20261203


@dataclass(frozen=True)
class InputRotation:
    """R = diag(signs) @ blockdiag(H_block / sqrt(block)), an orthogonal [K, K] matrix, held as its parts."""

    signs: torch.Tensor  # [K] float32, each +1 or -1
    block: int  # a power of two dividing K

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x @ R for [..., K] float32 x, in torch (the weight's side, once at load; the kernel does the rows')."""
        blocks = (x * self.signs).reshape(*x.shape[:-1], -1, self.block)
        return (blocks @ _hadamard(self.block)).reshape(x.shape)


@functools.cache
def input_rotation(in_features: int) -> InputRotation:
    """The rotation of a K-wide input: the same for every linear of that width (the signs from a fixed seed, so
    that a model quantizes the same way in every process)."""
    block = 1
    while in_features % (block * 2) == 0 and block * 2 <= MAX_ROTATION_BLOCK:
        block *= 2
    generator = torch.Generator().manual_seed(_ROTATION_SEED + in_features)
    signs = torch.randint(0, 2, (in_features,), generator=generator).float() * 2 - 1
    return InputRotation(signs, block)


@functools.cache
def _hadamard(size: int) -> torch.Tensor:
    """The normalised [size, size] Hadamard matrix (Sylvester's), size a power of two."""
    matrix = torch.ones(1, 1)
    while matrix.shape[0] < size:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix / size**0.5


@dataclass(frozen=True)
class Int8Weight:
    """A linear's weight in int8, in the layout of each product its calls use: `transposed` [in, out] for
    `torch._int_mm` (a view of the [out, in] rows), `packed` for oneDNN's matmul, `amx` and `vnni` for bouquet's
    kernels; with one
    float32 scale per output channel and each channel's int8 weights summed (what an activation row's zero point
    contributes to its products). Calls of fewer than `from_rows` rows run `small`, the others `large`."""

    transposed: torch.Tensor  # [K, N] int8, or [0, 0] where `torch._int_mm` is not used
    scales: torch.Tensor  # [N] float32
    sums: torch.Tensor  # [N] int32
    bias: torch.Tensor  # [N] float32 (zeros where the layer has none)
    in_features: int
    packed: torch.Tensor | None = None  # oneDNN's prepacked weight (opaque)
    amx: torch.Tensor | None = None  # the AMX kernel's blocks
    vnni: torch.Tensor | None = None  # the VNNI kernel's column blocks
    small: str = INT_MM_PRODUCT
    large: str = INT_MM_PRODUCT
    from_rows: int = 0
    rotation: InputRotation | None = None  # the weight holds W R: activation rows must be rotated by R too

    @functools.cached_property
    def pointers(self) -> tuple[int, int, int, int | None, int]:
        """What the kernels read of this weight on every call: its scales', sums' and bias's addresses, and its
        rotation's signs and block (None, 0 without one), looked up once (a query makes 24 calls)."""
        signs, block = (None, 0) if self.rotation is None else (self.rotation.signs.data_ptr(), self.rotation.block)
        return self.scales.data_ptr(), self.sums.data_ptr(), self.bias.data_ptr(), signs, block


def quantize_weight(
    weight: torch.Tensor, bias: torch.Tensor | None, weight_range: WeightRange = FULL_RANGE, rotate: bool = True
) -> Int8Weight:
    """Per-output-channel symmetric quantization of a [out, in] weight into `weight_range`, its input space rotated
    first unless `rotate` is False; an all-zero channel keeps scale 0."""
    weight = weight.detach().float()
    rotation = input_rotation(weight.shape[1]) if rotate else None
    if rotation is not None:
        weight = rotation.apply(weight)
    scales = weight.abs().amax(dim=1) / weight_range.limit
    if weight_range.pair_sum is not None:
        scales = torch.maximum(scales, _pair_sums(weight).amax(dim=1) / weight_range.pair_sum)
    inverse = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    rows = (weight * inverse[:, None]).round_().clamp_(-weight_range.limit, weight_range.limit)
    if weight_range.pair_sum is not None:
        _fit_pairs(rows, weight_range.pair_sum)
    rows = rows.to(torch.int8)
    bias = torch.zeros(weight.shape[0]) if bias is None else bias.detach().float().contiguous()
    sums = rows.sum(dim=1, dtype=torch.int32)
    return Int8Weight(rows.t(), scales.contiguous(), sums, bias, weight.shape[1], rotation=rotation)


def _pair_sums(rows: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, K // 2]: |w[2j]| + |w[2j + 1]| (an odd K's last input has no partner to overflow with)."""
    even = rows.shape[1] // 2 * 2
    return rows[:, :even].abs().view(rows.shape[0], -1, 2).sum(dim=2)


def _fit_pairs(rows: torch.Tensor, pair_sum: int) -> None:
    """Rounding can carry a pair whose scaled sum was at the bound one over it: its larger magnitude gives it back."""
    over = _pair_sums(rows) > pair_sum
    if not over.any():
        return
    even = rows.shape[1] // 2 * 2
    pairs = rows[:, :even].view(rows.shape[0], -1, 2)  # a view: edits land in `rows`
    larger = pairs.abs().argmax(dim=2, keepdim=True)
    excess = (_pair_sums(rows) - pair_sum).clamp(min=0)
    chosen = pairs.gather(2, larger)
    pairs.scatter_(2, larger, chosen - chosen.sign() * excess[..., None])


def onednn_product_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def with_products(weight: Int8Weight, small: str, large: str, from_rows: int = 0) -> Int8Weight:
    """The weight (as `quantize_weight` gives it) with the layouts its calls need: `small` below `from_rows` rows,
    `large` from there. A shape the AMX kernel cannot take runs `torch._int_mm` where the AMX product was asked."""
    if not amx_fits(weight.in_features, weight.scales.numel()):
        small, large = (INT_MM_PRODUCT if name == AMX_PRODUCT else name for name in (small, large))
    used = {large} if from_rows <= 0 or small == large else {small, large}  # from_rows 0: every call is large
    rows = weight.transposed.t()
    return dataclasses.replace(
        weight,
        transposed=weight.transposed if INT_MM_PRODUCT in used else torch.empty(0, 0, dtype=torch.int8),
        packed=torch.ops.onednn.qlinear_prepack(rows.contiguous(), None) if ONEDNN_PRODUCT in used else None,
        amx=pack_for_amx(rows) if AMX_PRODUCT in used else None,
        vnni=pack_for_vnni(rows) if VNNI_PRODUCT in used else None,
        small=small if small in used else large,
        large=large if large in used else small,
        from_rows=max(from_rows, 0),
    )


def int8_product(values: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """[T, K] int8 codes times the int8 weight: [T, N] int32 (`torch._int_mm`, bouquet's kernels), or float32 holding
    the same integers (oneDNN's matmul, asked for unit scales and a float32 output: it has no int32 output)."""
    product = weight.small if values.shape[0] < weight.from_rows else weight.large
    if product == AMX_PRODUCT:
        assert weight.amx is not None
        return amx_product(values, weight.amx, weight.scales.numel())
    if product == VNNI_PRODUCT:
        assert weight.vnni is not None
        return vnni_product(values, weight.vnni, weight.scales.numel())
    # oneDNN's products are torch ops: called as kernel calls writing into an output allocated here, so that a CPU
    # graph (engine/cpu_graphs.py) replays them with the C kernels around them.
    if product == INT_MM_PRODUCT:
        out = torch.empty(values.shape[0], weight.scales.numel(), dtype=torch.int32)
        kernel_call(_int_mm_into, values, weight.transposed, out)
        return out
    return op_call(_onednn_matmul, values, weight.packed, weight.scales.numel())  # (no output argument)


def _int_mm_into(values: torch.Tensor, transposed: torch.Tensor, out: torch.Tensor) -> int:
    torch._int_mm(values, transposed, out=out)
    return 0


def _onednn_matmul(values: torch.Tensor, packed: torch.Tensor | None, channels: int) -> torch.Tensor:
    """oneDNN's matmul, asked for unit scales and a float32 output holding the int32 sums."""
    unit_scales, zero_points = _unit_quantization(channels)
    return torch.ops.onednn.qlinear_pointwise(
        values, 1.0, 0, packed, unit_scales, zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )


@functools.cache
def _unit_quantization(channels: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ones(channels), torch.zeros(channels, dtype=torch.int64)


@functools.cache
def _library() -> ctypes.CDLL:
    library = load_kernel("int8_linear")
    library.bouquet_quantize_rows.restype = None
    library.bouquet_quantize_rows.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 4, ctypes.c_int64,
    ]  # fmt: skip
    library.bouquet_dequantize.restype = None
    library.bouquet_dequantize.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 5, ctypes.c_int32, ctypes.c_int32,
    ]  # fmt: skip
    library.bouquet_passes_allow_avx512.argtypes = [ctypes.c_int32]
    library.bouquet_passes_allow_avx512.restype = None
    library.bouquet_passes_avx512.restype = ctypes.c_int
    library.bouquet_passes_allow_avx512(int(cpu_features().has("avx512f")))  # the probe decides, as for the products
    library.bouquet_dequantize_add_norm.restype = None
    library.bouquet_dequantize_add_norm.argtypes = [
        ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, *[ctypes.c_void_p] * 5, ctypes.c_int32, ctypes.c_void_p,
        ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float,
    ]  # fmt: skip
    return library


@dataclass(frozen=True)
class Int8Rows:
    """Activations in int8, row r ~ scales[r] * (values[r] - zeros[r])."""

    values: torch.Tensor  # [T, K] int8
    scales: torch.Tensor  # [T] float32
    zeros: torch.Tensor  # [T] int32


def quantize_rows(x: torch.Tensor, rotation: InputRotation | None = None, out: Int8Rows | None = None) -> Int8Rows:
    """[T, K] float32 (rows may be strided) -> int8 rows of x (or of x @ R, given the rotation), each row with its
    own scale and zero point; into `out` where given."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1, "rows of contiguous float32"
    num_rows, cols = x.shape
    assert rotation is None or rotation.signs.numel() == cols, "a rotation of another width"
    rows = _new_rows(num_rows, cols) if out is None else out
    assert rows.values.shape == (num_rows, cols), "rows of another shape"
    signs, block = (None, 0) if rotation is None else (rotation.signs.data_ptr(), rotation.block)
    _quantize_into(x, rows, signs, block)
    return rows


def _quantize_into(x: torch.Tensor, rows: Int8Rows, signs: int | None, block: int) -> None:
    num_rows, cols = x.shape
    kernel_call(
        _library().bouquet_quantize_rows,
        x.data_ptr(), num_rows, cols, x.stride(0), rows.values.data_ptr(), rows.scales.data_ptr(),
        rows.zeros.data_ptr(), signs, block,
    )  # fmt: skip


def _new_rows(num_rows: int, cols: int) -> Int8Rows:
    return Int8Rows(
        torch.empty(num_rows, cols, dtype=torch.int8), torch.empty(num_rows), torch.empty(num_rows, dtype=torch.int32)
    )


# Calls of up to this many rows (a query's, a short step's) quantize into buffers each thread keeps per shape, which
# never leave the linear that fills them: three allocations fewer a call. Bounded: at most one per bucketed row
# count up to here and input width, 100 KB each at 1,536 wide.
_KEPT_ROWS = 64
_kept = threading.local()


def _scratch_rows(num_rows: int, cols: int) -> Int8Rows:
    if num_rows > _KEPT_ROWS:
        return _new_rows(num_rows, cols)
    kept: dict[tuple[int, int], Int8Rows] = _kept.__dict__.setdefault("rows", {})
    rows = kept.get((num_rows, cols))
    if rows is None:
        rows = kept[(num_rows, cols)] = _new_rows(num_rows, cols)
    return rows


def _float_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] as [T, K] float32 rows, each contiguous (the rows may be strided)."""
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.dtype == torch.float32 and flat.stride(-1) == 1 else flat.float().contiguous()


def _quantized_input(x: torch.Tensor, weight: Int8Weight) -> Int8Rows:
    """x [..., K] as int8 rows for this weight (rotated as it is), in this thread's scratch where small."""
    flat = _float_rows(x)
    rows = _scratch_rows(flat.shape[0], flat.shape[1])
    _, _, _, signs, block = weight.pointers
    _quantize_into(flat, rows, signs, block)
    return rows


def dequantize(products: torch.Tensor, rows: Int8Rows, weight: Int8Weight, activation: str) -> torch.Tensor:
    """[T, N] int32 (or float32 holding integers) -> [T, N] float32 in the same memory: act(scale[t] *
    w_scale[n] * (product - zero[t] * w_sum[n]) + bias[n])."""
    assert products.dtype in (torch.int32, torch.float32) and products.is_contiguous()
    num_rows, cols = products.shape
    scales, sums, bias, _, _ = weight.pointers
    kernel_call(
        _library().bouquet_dequantize,
        products.data_ptr(), num_rows, cols, rows.scales.data_ptr(), rows.zeros.data_ptr(), scales, sums, bias,
        ACTIVATIONS[activation], products.dtype == torch.float32,
    )  # fmt: skip
    return products.view(torch.float32)


def _own_kernel(weight: Int8Weight, rows: int) -> str | None:
    """The product of bouquet's own (the whole linear in one kernel call) a call of this many rows runs, if any."""
    product = weight.small if rows < weight.from_rows else weight.large
    return product if product in (AMX_PRODUCT, VNNI_PRODUCT) else None


def _one_call(
    kernel: str,
    flat: torch.Tensor,
    weight: Int8Weight,
    activation: str,
    residual: torch.Tensor | None,
    norm: nn.LayerNorm | None,
) -> torch.Tensor:
    """The whole linear in one kernel call (quantizing, bouquet's AMX or VNNI product, dequantizing): [T, K] ->
    [T, N]."""
    num_rows, cols = flat.shape
    scratch = _scratch_rows(num_rows, cols)
    out = torch.empty(num_rows, weight.scales.numel())
    scales, sums, bias, signs, block = weight.pointers
    fused = (None, 0, None, None, 0.0) if residual is None or norm is None else (
        residual.data_ptr(), residual.stride(0), norm.weight.data_ptr(), norm.bias.data_ptr(), norm.eps
    )  # fmt: skip
    packed = weight.amx if kernel == AMX_PRODUCT else weight.vnni
    (amx_linear if kernel == AMX_PRODUCT else vnni_linear)((
        flat.data_ptr(), num_rows, cols, flat.stride(0), signs, block,
        scratch.values.data_ptr(), scratch.scales.data_ptr(), scratch.zeros.data_ptr(),
        packed.data_ptr() if packed is not None else None, out.shape[1], out.data_ptr(),
        scales, sums, bias, ACTIVATIONS[activation], *fused,
    ))  # fmt: skip
    return out


def int8_linear(x: torch.Tensor, weight: Int8Weight, activation: str = "none") -> torch.Tensor:
    """act(x @ W.T + b) with int8 products: x [..., K] float32 -> [..., N] float32."""
    kernel = _own_kernel(weight, x.numel() // x.shape[-1])
    if kernel is not None:
        return _one_call(kernel, _float_rows(x), weight, activation, None, None).view(*x.shape[:-1], -1)
    rows = _quantized_input(x, weight)
    products = int8_product(rows.values, weight)
    return dequantize(products, rows, weight, activation).view(*x.shape[:-1], -1)


def int8_linear_add_norm(
    x: torch.Tensor, weight: Int8Weight, residual: torch.Tensor, norm: nn.LayerNorm
) -> torch.Tensor:
    """norm(residual + x @ W.T + b) with int8 products, the add and the LayerNorm done in the dequantizing pass:
    x [..., K], residual [..., N] float32 -> [..., N] float32."""
    shape = residual.shape
    residual_rows = residual.reshape(-1, shape[-1])
    if residual_rows.dtype != torch.float32 or residual_rows.stride(-1) != 1:
        residual_rows = residual_rows.float().contiguous()
    kernel = _own_kernel(weight, residual_rows.shape[0])
    if kernel is not None:
        return _one_call(kernel, _float_rows(x), weight, "none", residual_rows, norm).view(shape)
    rows = _quantized_input(x, weight)
    products = int8_product(rows.values, weight)
    assert products.is_contiguous() and products.shape == residual_rows.shape
    scales, sums, bias, _, _ = weight.pointers
    kernel_call(
        _library().bouquet_dequantize_add_norm,
        products.data_ptr(), products.shape[0], products.shape[1], rows.scales.data_ptr(), rows.zeros.data_ptr(),
        scales, sums, bias, products.dtype == torch.float32, residual_rows.data_ptr(), residual_rows.stride(0),
        norm.weight.data_ptr(), norm.bias.data_ptr(), norm.eps,
    )  # fmt: skip
    return products.view(torch.float32).view(shape)


def fuses_add_norm(norm: nn.Module) -> bool:
    """Whether `int8_linear_add_norm` can stand for this norm: a float32 LayerNorm over the last dimension, with
    its weight and bias."""
    return (
        isinstance(norm, nn.LayerNorm)
        and len(norm.normalized_shape) == 1
        and norm.weight is not None
        and norm.bias is not None
        and norm.weight.dtype == norm.bias.dtype == torch.float32
        and norm.weight.is_contiguous()
        and norm.bias.is_contiguous()
    )


@functools.cache
def weight_range(product: str = INT_MM_PRODUCT) -> WeightRange:
    """The widest WeightRange this int8 product computes exactly on this CPU (see the module docstring), measured
    once per process and product on worst-case operands."""
    found = on_passing_thread(lambda: _measure_weight_range(product))
    if not found.full:
        _say_narrowed(found)
    return found


@functools.cache  # once per process, however many products share the range
def _say_narrowed(found: WeightRange) -> None:
    logger.warning(
        "int8: this CPU's int8 products saturate at full-range weights (no VNNI): weights kept to %s", found.describe()
    )


def narrowest(ranges: list[WeightRange]) -> WeightRange:
    """The range every one of these products computes exactly in (they are nested: full, paired, reduced)."""
    return min(ranges, key=lambda r: (r.limit, 2 * r.limit if r.pair_sum is None else r.pair_sum))


def _measure_weight_range(product: str) -> WeightRange:
    torch.set_num_threads(1)
    for candidate, pattern in ((FULL_RANGE, [127]), (PAIRED_RANGE, [127, 1, 1, 127])):
        # [127, 1, 1, 127]: every pair (2j, 2j + 1) at the bound, while pairs taken one input off would reach 254
        if _exact_at(product, torch.tensor(pattern, dtype=torch.int8)):
            return candidate
    return REDUCED_RANGE


def _exact_at(product: str, pattern: torch.Tensor) -> bool:
    """Whether the product is exact on rows of activations at their extremes against weights repeating `pattern`,
    every other channel negated (each pair of products at its largest magnitude, both signs)."""
    depth, width = 64, 32
    x = torch.full((4, depth), 127, dtype=torch.int8)
    x[1::2] = -128
    w = pattern.repeat(width, depth // pattern.numel())
    w[1::2] = -w[1::2]
    weight = Int8Weight(w.t(), torch.ones(width), w.sum(dim=1, dtype=torch.int32), torch.zeros(width), depth)
    weight = with_products(weight, product, product)
    return torch.equal(int8_product(x, weight).to(torch.int64), x.long() @ w.long().t())
