"""Attention backends by name."""

from __future__ import annotations

from collections.abc import Callable

from bouquet.layers.attention_backends.base import AttentionBackend, AttentionShape, BackendUnavailableError
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.attention_backends.flash_attn import FlashAttnBackend
from bouquet.layers.attention_backends.flashinfer import FlashInferBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend

# flash_attn and flashinfer import their packages only when created: asking for one that is not installed
# raises BackendUnavailableError naming the pip package; cpu_varlen compiles its kernel when created, and
# raises it without a C compiler. "auto" is resolved by the engine (selection.py).
_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {
    SdpaBackend.name: SdpaBackend,
    CpuVarlenBackend.name: CpuVarlenBackend,
    FlashAttnBackend.name: FlashAttnBackend,
    FlashInferBackend.name: FlashInferBackend,
}


def available_backends() -> list[str]:
    return list(_REGISTRY)  # the always-present fallback first


def create_attention_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        names = ", ".join([*available_backends(), "auto"])
        raise ValueError(f"unknown attention backend {name!r}; available: {names}")
    return _REGISTRY[name]()


__all__ = [
    "AttentionBackend",
    "AttentionShape",
    "BackendUnavailableError",
    "available_backends",
    "create_attention_backend",
]
