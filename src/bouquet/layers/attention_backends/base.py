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
    windows: tuple[tuple[int, int], ...] = ()  # the sliding windows (left, right) some layers attend within
    position_bias: bool = False  # some layer adds a per-head bias to its scores (MPNet)
    softmax_scale: float | None = None  # the model's own, where it is not head_dim ** -0.5 (Gemma3)
    # Every layer has the first's heads, scale and causality; not so in CLIP, whose text tower is causal and whose
    # vision tower is not (and may be wider): a backend that plans one shape for all layers cannot run it.
    uniform: bool = True

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale

    @property
    def sliding_window(self) -> bool:
        return bool(self.windows)


class AttentionBackend(ABC):
    """Variable-length attention over packed sequences.

    `prepare` runs once per forward (index math shared by all layers); `forward` runs per layer.

    CUDA-graph hooks, for backends whose metadata can live in fixed device buffers: `prepare_capture` builds
    a bucket's metadata on such buffers before capture, `prepare_replay` refreshes them (host-side work, e.g.
    FlashInfer's plan()) before each replay. A backend that plans on the host per batch (SDPA's grouping)
    leaves `supports_cuda_graphs` False and the engine stays eager. `graph_backend` says which backend a
    graph records for a batch: a dispatcher (`auto`) names the one it would run.
    """

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    supports_sliding_window: ClassVar[bool] = False
    supports_position_bias: ClassVar[bool] = False
    supports_key_lens: ClassVar[bool] = False  # ForwardContext.key_lens; the engine runs SDPA for such batches
    shape: AttentionShape | None = None

    def bind(self, shape: AttentionShape) -> None:
        """Told once by the engine, before any batch; a model it cannot run is refused here."""
        if not self.can_run(shape):
            raise ValueError(f"attention backend {self.name!r} cannot run {describe_needs(shape)}")
        self.shape = shape

    @classmethod
    def can_run(cls, shape: AttentionShape) -> bool:
        return (cls.supports_sliding_window or not shape.sliding_window) and (
            cls.supports_position_bias or not shape.position_bias
        )

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
        window: tuple[int, int] | None = None,  # (left, right): query i sees keys i - left .. i + right
        bias: torch.Tensor | None = None,  # [H, L, L] float32 added to every sequence's scores, L >= max_seqlen
    ) -> torch.Tensor:  # [T, H, D]
        ...

    def backend_for(self, max_seqlen: int) -> str:
        """The name of the backend a batch of this longest sequence runs on (AutoBackend chooses one)."""
        return self.name

    def graph_backend(self, max_seqlen: int) -> AttentionBackend | None:
        """The backend whose kernels a CUDA graph records for a batch whose longest sequence has `max_seqlen`
        tokens, or None when such a batch cannot be captured (it runs eagerly)."""
        return self if self.supports_cuda_graphs else None

    def prepare_capture(self, ctx: ForwardContext, key: Hashable) -> Any:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in a CUDA graph")

    def prepare_replay(self, ctx: ForwardContext, key: Hashable) -> None:
        raise NotImplementedError(f"attention backend {self.name!r} cannot be captured in a CUDA graph")


def describe_needs(shape: AttentionShape) -> str:
    needs = [need for need, wanted in (("a sliding window", shape.sliding_window),
                                       ("a position bias", shape.position_bias),
                                       ("layers of different shapes", not shape.uniform)) if wanted]  # fmt: skip
    return "attention with " + " and ".join(needs) if needs else "this attention"
