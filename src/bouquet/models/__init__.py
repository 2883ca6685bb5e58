"""Model classes by the `architectures` name in a checkpoint's config.json."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from bouquet.models.bert import BertModel
from bouquet.models.gemma3 import Gemma3Model
from bouquet.models.gte import GteModel
from bouquet.models.modernbert import ModernBertModel
from bouquet.models.nomic_bert import NomicBertModel
from bouquet.models.qwen3 import Qwen3Model
from bouquet.models.xlm_roberta import XLMRobertaModel


class EmbeddingModel(Protocol):
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]: ...


_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
    "Qwen3Model": Qwen3Model,
    "Qwen3ForCausalLM": Qwen3Model,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForMaskedLM": XLMRobertaModel,
    "RobertaModel": XLMRobertaModel,
    "RobertaForMaskedLM": XLMRobertaModel,
    "NomicBertModel": NomicBertModel,
    "GteModel": GteModel,
    "ModernBertModel": ModernBertModel,
    "ModernBertForMaskedLM": ModernBertModel,
    "Gemma3TextModel": Gemma3Model,
    "Gemma3ForCausalLM": Gemma3Model,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def create_model(architecture: str, hf_config: dict[str, Any]) -> nn.Module:
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _ARCHITECTURES[architecture].from_hf_config(hf_config)
