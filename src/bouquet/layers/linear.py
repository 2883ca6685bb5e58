"""Linear layers that compute in their weight's dtype and accept activations of any dtype.

On the CPU each weight is reordered once, at load, into oneDNN's blocked layout (`prepack_cpu_linears`), and the
engine then frees the plain copy (`drop_plain_weights`).
Without that, every call reorders the weight again: a small batch (one query) pays mostly for the reorder,
and a large float32 batch runs through MKL's sgemm, about 25% slower here than oneDNN on the packed weight
(docs/benchmarks.md has the measurements). oneDNN runs bfloat16 only on CPUs with AVX-512 BW/VL/DQ or
AVX-NE-CONVERT (torch refuses to reorder otherwise): elsewhere bfloat16 weights stay unpacked, through ATen's
plain product.
In float32, steps of up to a measured number of rows (a query's) run on layers/f32_short.py's kernel instead, on a
second packed copy of the weight, which has none of oneDNN's cost per call and fuses the block's end.
With `--dtype int8` every Linear but the heads' (and, on CPUs without VNNI, the QKV projections) is quantized at
load (`quantize_cpu_linears`) and runs layers/int8_linear.py's products instead; its float weight is dropped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.cpu_features import cpu_features
from bouquet.kernels.recording import op_call
from bouquet.layers import bf16_amx, f32_short
from bouquet.layers.activation import get_activation
from bouquet.layers.bf16_amx import amx_bf16_linear, amx_bf16_linear_add_norm
from bouquet.layers.f32_short import f32_linear, f32_linear_add_norm
from bouquet.layers.int8_linear import (
    ACTIVATIONS,
    Int8Weight,
    WeightRange,
    fuses_add_norm,
    int8_linear,
    int8_linear_add_norm,
    narrowest,
    quantize_weight,
    weight_range,
    with_products,
)
from bouquet.layers.int8_products import Int8Plan, choose_int8_plan

# oneDNN's linear with a fused pointwise epilogue: the activation is applied while the output tile is
# still in cache, which saves a whole pass over the [T, intermediate] tensor on the CPU.
_ONEDNN_EPILOGUES: dict[str, tuple[str, list[object], str]] = {
    "gelu": ("gelu", [], "none"),
    "gelu_new": ("gelu", [], "tanh"),
    "gelu_pytorch_tanh": ("gelu", [], "tanh"),
    "relu": ("relu", [], ""),
}
_NO_EPILOGUE: tuple[str, list[object], str] = ("none", [], "")
_HAS_ONEDNN_LINEAR = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class Linear(nn.Linear):
    """x @ W.T + b in the weight's dtype; the residual stream may stay float32 while weights are bfloat16."""

    # oneDNN-blocked copy of `weight` (CPU only), kept beside it rather than in the state dict.
    packed_weight: torch.Tensor | None = None
    # The weight in int8 (`--dtype int8`); the float weight is then an empty placeholder.
    int8: Int8Weight | None = None
    # The norm `add_norm` last saw and whether the int8 kernel can apply it.
    _fused_norm: tuple[nn.Module, bool] | None = None
    # bfloat16 on AMX tiles (layers/bf16_amx.py): the packed weight, the bias in float32, and up to how many rows a
    # call runs there (-1: every count; oneDNN's copy is then dropped).
    amx_bf16: torch.Tensor | None = None
    amx_bias: torch.Tensor | None = None
    amx_bf16_rows: int = 0
    # float32 short steps (layers/f32_short.py): the weight packed for its kernel, and up to how many rows it runs.
    f32_packed: torch.Tensor | None = None
    f32_rows: int = 0
    # The norm `add_norm` last saw and its weight and bias for the fused kernels (None where they cannot apply it).
    _kernel_norm: tuple[nn.Module, tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def prepack(self) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def quantize_int8(self, codes: WeightRange, plan: Int8Plan) -> None:
        weight = quantize_weight(self.weight, self.bias, codes)
        self.int8 = with_products(weight, plan.small, plan.large, plan.from_rows)
        self.packed_weight = None
        self.weight = nn.Parameter(self.weight.new_empty(0, dtype=torch.float32), requires_grad=False)

    def use_amx_bf16(self, up_to_rows: int) -> None:
        """Runs calls of up to `up_to_rows` rows (-1: all) on bf16_amx.py's kernel; needs the plain weight."""
        self.amx_bf16 = bf16_amx.pack(self.weight)
        self.amx_bias = None if self.bias is None else self.bias.detach().float()
        self.amx_bf16_rows = up_to_rows
        if up_to_rows == -1:  # oneDNN never runs this linear: neither copy of the weight is needed
            self.packed_weight = None
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    def use_f32_short(self, up_to_rows: int) -> None:
        """Runs float32 calls of up to `up_to_rows` rows on f32_short.py's kernel; needs the plain weight."""
        self.f32_packed = f32_short.pack(self.weight)
        self.f32_rows = up_to_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            return int8_linear(x, self.int8)
        return self._linear(x, _NO_EPILOGUE)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        """norm(residual + self(x)): a post-norm block's end, fused into the dequantizing pass in int8."""
        if self.int8 is not None:
            if self._fused_norm is None or self._fused_norm[0] is not norm:  # checked once, not on every call
                self._fused_norm = (norm, fuses_add_norm(norm))
            if self._fused_norm[1]:
                return int8_linear_add_norm(x, self.int8, residual, norm)
        stream = residual.dtype == torch.float32 and residual.stride(-1) == 1  # the kernels' residual
        fused = self.f32_packed is not None or self.amx_bf16 is not None
        weights = self._norm_weights(norm) if stream and fused else None
        if weights is not None and self.f32_packed is not None and self._runs_f32_short(x):
            return f32_linear_add_norm(x, self.f32_packed, self.out_features, self.bias, residual, *weights, norm.eps)
        if weights is not None and self.amx_bf16 is not None and self._runs_on_amx_bf16(x):
            return amx_bf16_linear_add_norm(
                x, self.amx_bf16, self.out_features, self.amx_bias, residual, *weights, norm.eps
            )
        return norm(residual + self(x))

    def _norm_weights(self, norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The norm's weight and bias in float32 for the fused kernels, made once; None where the norm is
        not a LayerNorm over the last dimension with both."""
        if self._kernel_norm is None or self._kernel_norm[0] is not norm:
            fits_kernel = (
                isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1 and norm.weight is not None
                and norm.bias is not None and norm.normalized_shape[0] == self.out_features
            )  # fmt: skip
            weights = None
            if fits_kernel:
                assert isinstance(norm, nn.LayerNorm)
                weights = (norm.weight.detach().float().contiguous(), norm.bias.detach().float().contiguous())
            self._kernel_norm = (norm, weights)
        return self._kernel_norm[1]

    def _linear(self, x: torch.Tensor, epilogue: tuple[str, list[object], str]) -> torch.Tensor:
        if self.f32_packed is not None and self._runs_f32_short(x):
            return f32_linear(x, self.f32_packed, self.out_features, self.bias, _activation_of(epilogue))
        if self.amx_bf16 is not None and self._runs_on_amx_bf16(x):
            return amx_bf16_linear(x, self.amx_bf16, self.out_features, self.amx_bias, _activation_of(epilogue))
        x = x.to(self.weight.dtype)
        if self.packed_weight is not None and x.device.type == "cpu" and not x.requires_grad:
            # A call a CPU graph replays: the QKV projections that int8 keeps in float32 without VNNI.
            return op_call(torch.ops.mkldnn._linear_pointwise, x.contiguous(), self.packed_weight, self.bias, *epilogue)
        if epilogue is not _NO_EPILOGUE and onednn_runs(self.weight) and not x.requires_grad:
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.weight, self.bias, *epilogue)
        return F.linear(x, self.weight, self.bias)

    def _runs_on_amx_bf16(self, x: torch.Tensor) -> bool:
        if x.device.type != "cpu" or x.requires_grad:
            return False
        return self.amx_bf16_rows == -1 or x.numel() // x.shape[-1] <= self.amx_bf16_rows

    def _runs_f32_short(self, x: torch.Tensor) -> bool:
        if x.device.type != "cpu" or x.requires_grad or x.dtype != torch.float32:
            return False
        return x.numel() // x.shape[-1] <= self.f32_rows


def _activation_of(epilogue: tuple[str, list[object], str]) -> str:
    """oneDNN's epilogue as bf16_amx.py names the activation."""
    name, _, algorithm = epilogue
    return ("gelu_tanh" if algorithm == "tanh" else "gelu") if name == "gelu" else name


class LinearActivation(Linear):
    """act(x @ W.T + b), fused into the matrix product on the CPU where oneDNN can."""

    def __init__(self, in_features: int, out_features: int, activation: str, bias: bool = True):
        super().__init__(in_features, out_features, bias=bias)
        self.activation = get_activation(activation)
        self.activation_name = activation
        self.epilogue = _ONEDNN_EPILOGUES.get(activation)

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> torch.Tensor:
        return norm(residual + self(x))  # the fused kernels add no activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.int8 is not None:
            if self.activation_name in ACTIVATIONS:  # fused into the dequantizing pass
                return int8_linear(x, self.int8, self.activation_name)
            return self.activation(int8_linear(x, self.int8))
        if self.epilogue is not None and (self.packed_weight is not None or onednn_runs(self.weight)):
            return self._linear(x, self.epilogue)
        return self.activation(self._linear(x, _NO_EPILOGUE))


class QKVLinear(Linear):
    """A layer's fused query, key and value projection. The linear int8 hurts most (it reads the normalised residual
    stream, whose outlier channels set each token's scale): where the weights are narrowed (CPUs without VNNI:
    int8_linear.WeightRange) it stays in float32, which keeps MiniLM's recall@10 within the quality gate there
    (0.981, against 0.978 with it in int8 too: docs/benchmarks.md, "int8 on the CPU")."""


def onednn_runs(weight: torch.Tensor) -> bool:
    """Whether oneDNN's linear takes this CPU weight: float32 wherever torch has oneDNN, bfloat16 only on CPUs
    whose features allow it (cpu_features.py)."""
    if not _HAS_ONEDNN_LINEAR or weight.device.type != "cpu":
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_features().packed_bf16)


def prepack_cpu_linears(model: nn.Module) -> None:
    """Reorders every Linear's weight for oneDNN once; a no-op where oneDNN does not take the weight's dtype."""
    for module in model.modules():
        if isinstance(module, Linear) and onednn_runs(module.weight):
            module.prepack()


def drop_plain_weights(model: nn.Module) -> int:
    """Frees the plain copy of every prepacked weight, as the CPU forward reads only the packed one: keeping both
    doubled the linears' memory. The empty placeholder keeps the dtype, which the forward reads. Returns the
    bytes freed."""
    freed = 0
    for module in model.modules():
        if isinstance(module, Linear) and module.packed_weight is not None and module.weight.numel():
            freed += module.weight.numel() * module.weight.element_size()
            module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
    return freed


def quantize_cpu_linears(model: nn.Module, heads: nn.Module, threads: int = 1) -> tuple[int, int, Int8Plan]:
    """Quantizes every Linear of `model` to int8 but those `heads` also holds (a SPLADE masked-LM head runs on
    every token but scores the vocabulary: heads stay float32) and, where the weights are narrowed, the QKV
    projections, for the int8 products measured fastest at their shapes on `threads` (an engine worker's share).
    Returns (quantized, kept in float32, the products' plan)."""
    in_heads = {id(module) for module in heads.modules()}
    linears = [m for m in model.modules() if isinstance(m, Linear) and id(m) not in in_heads]
    plan = choose_int8_plan(sorted({(m.in_features, m.out_features) for m in linears}), threads)
    codes = narrowest([weight_range(product) for product in plan.products])
    kept = [m for m in linears if not codes.full and isinstance(m, QKVLinear)]
    for linear in linears:
        if linear not in kept:
            linear.quantize_int8(codes, plan)
    return len(linears) - len(kept), len(kept), plan


def use_amx_bf16_linears(model: nn.Module, threads: int = 1) -> int:
    """Moves every bfloat16 Linear whose shape fits onto bf16_amx.py's kernel, for the rows measured faster there
    than oneDNN at the model's shapes on `threads` threads (an engine worker's share). Returns up to how many rows
    (-1: every count; 0: none moved)."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.weight.dtype == torch.bfloat16]
    linears = [
        m for m in linears if m.weight.numel() and m.int8 is None and bf16_amx.fits(m.in_features, m.out_features)
    ]
    up_to_rows = bf16_amx.choose_bf16_rows(sorted({(m.in_features, m.out_features) for m in linears}), threads)
    if up_to_rows:
        for linear in linears:
            linear.use_amx_bf16(up_to_rows)
    return up_to_rows


def use_f32_short_linears(model: nn.Module, threads: int = 1) -> int:
    """Gives every float32 Linear of `model` a packed copy for f32_short.py's kernel, for the rows measured faster
    there than oneDNN at the model's shapes on `threads` threads (an engine worker's share), unless the copies would
    take more than f32_short.MAX_WEIGHT_BYTES. Returns up to how many rows (0: none moved)."""
    linears = [m for m in model.modules() if isinstance(m, Linear) and m.int8 is None and m.weight.numel()]
    linears = [m for m in linears if m.weight.dtype == torch.float32 and m.weight.device.type == "cpu"]
    if sum(m.weight.numel() * 4 for m in linears) > f32_short.MAX_WEIGHT_BYTES:
        return 0
    up_to_rows = f32_short.choose_f32_rows(sorted({(m.in_features, m.out_features) for m in linears}), threads)
    if up_to_rows:
        for linear in linears:
            linear.use_f32_short(up_to_rows)
    return up_to_rows
