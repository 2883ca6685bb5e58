"""Model classes by the `architectures` name in a checkpoint's config.json."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from bouquet.models.bert import BertModel
from bouquet.models.qwen3 import Qwen3Model


class EmbeddingModel(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


_ARCHITECTURES: dict[str, type[BertModel] | type[Qwen3Model]] = {
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
    "Qwen3Model": Qwen3Model,
    "Qwen3ForCausalLM": Qwen3Model,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def create_model(architecture: str, hf_config: dict[str, Any]) -> BertModel | Qwen3Model:
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _ARCHITECTURES[architecture].from_hf_config(hf_config)
