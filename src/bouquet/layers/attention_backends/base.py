"""The interface every attention kernel family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from bouquet.layers.context import ForwardContext


class BackendUnavailableError(ImportError):
    """An optional backend's package is missing or cannot run here; the message names the pip package."""


@dataclass(frozen=True)
class AttentionShape:
    """The model's attention, for backends that plan (FlashInfer) or measure before the layers run."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    causal: bool
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


class AttentionBackend(ABC):
    """Variable-length attention over packed sequences.

    `prepare` runs once per forward (index math shared by all layers); `forward` runs per layer.

    CUDA-graph hooks, for backends whose metadata can live in fixed device buffers: `prepare_capture` builds
    a bucket's metadata on such buffers before capture, `prepare_replay` refreshes them (host-side work, e.g.
    FlashInfer's plan()) before each replay. A backend that plans on the host per batch (SDPA's grouping)
    leaves `supports_cuda_graphs` False and the engine stays eager.
    """

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    shape: AttentionShape | None = None

    def bind(self, shape: AttentionShape) -> None:
        """Told once by the engine, before any batch."""
        self.shape = shape

    @abstractmethod
    def prepare(self, ctx: ForwardContext) -> Any: ...

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        ctx: ForwardContext,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        ...

    def prepare_capture(self, ctx: ForwardContext, key: Hashable) -> Any:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in a CUDA graph")

    def prepare_replay(self, ctx: ForwardContext, key: Hashable) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in a CUDA graph")
