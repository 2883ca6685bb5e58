"""The interface every attention kernel family implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from bouquet.engine.context import ForwardContext


class AttentionBackend(ABC):
    """Variable-length attention over packed sequences.

    `prepare` runs once per forward (index math shared by all layers); `forward` runs per layer.
    """

    name: ClassVar[str]

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
