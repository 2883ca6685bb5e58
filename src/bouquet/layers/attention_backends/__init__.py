"""Attention backends by name."""

from __future__ import annotations

from collections.abc import Callable

from bouquet.layers.attention_backends.base import AttentionBackend
from bouquet.layers.attention_backends.sdpa import SdpaBackend

_REGISTRY: dict[str, Callable[[], AttentionBackend]] = {
    SdpaBackend.name: SdpaBackend,
}


def available_backends() -> list[str]:
    return sorted(_REGISTRY)


def create_attention_backend(name: str) -> AttentionBackend:
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; available: {', '.join(available_backends())}")
    return _REGISTRY[name]()


__all__ = ["AttentionBackend", "available_backends", "create_attention_backend"]
