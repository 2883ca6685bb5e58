"""Model classes by the `architectures` name in a checkpoint's config.json.

A masked LM's checkpoint is also a plain encoder: served for embeddings its head is dropped, and only a directory
whose sentence-transformers files say "sparse" (a SparseEncoder: SPLADE) runs the head, through `_MASKED_LMS`."""

from __future__ import annotations

from typing import Any

from torch import nn

from bouquet.models.bert import BertForMaskedLM, BertForSequenceClassification, BertModel
from bouquet.models.gemma3 import Gemma3Model
from bouquet.models.gte import GteModel
from bouquet.models.mistral import MistralModel
from bouquet.models.modernbert import ModernBertForSequenceClassification, ModernBertModel
from bouquet.models.mpnet import MPNetModel
from bouquet.models.nomic_bert import NomicBertModel
from bouquet.models.qwen2 import Qwen2Model
from bouquet.models.qwen3 import Qwen3ForSequenceClassification, Qwen3Model
from bouquet.models.xlm_roberta import XLMRobertaForMaskedLM, XLMRobertaForSequenceClassification, XLMRobertaModel

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,
    "BertForPreTraining": BertModel,
    "Qwen2Model": Qwen2Model,
    "Qwen2ForCausalLM": Qwen2Model,
    "Qwen3Model": Qwen3Model,
    "Qwen3ForCausalLM": Qwen3Model,
    "Qwen3ForSequenceClassification": Qwen3ForSequenceClassification,
    "XLMRobertaModel": XLMRobertaModel,
    "XLMRobertaForMaskedLM": XLMRobertaModel,
    "RobertaModel": XLMRobertaModel,
    "RobertaForMaskedLM": XLMRobertaModel,
    "BertForSequenceClassification": BertForSequenceClassification,
    "XLMRobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "RobertaForSequenceClassification": XLMRobertaForSequenceClassification,
    "NomicBertModel": NomicBertModel,
    "GteModel": GteModel,
    "MPNetModel": MPNetModel,
    "MPNetForMaskedLM": MPNetModel,
    "MistralModel": MistralModel,
    "MistralForCausalLM": MistralModel,
    "ModernBertModel": ModernBertModel,
    "ModernBertForMaskedLM": ModernBertModel,
    "ModernBertForSequenceClassification": ModernBertForSequenceClassification,
    "Gemma3TextModel": Gemma3Model,
    "Gemma3ForCausalLM": Gemma3Model,
}


# Masked LMs with their head, for the "sparse" task.
_MASKED_LMS: dict[str, type[nn.Module]] = {
    "BertForMaskedLM": BertForMaskedLM,
    "XLMRobertaForMaskedLM": XLMRobertaForMaskedLM,
    "RobertaForMaskedLM": XLMRobertaForMaskedLM,
}


def supported_architectures() -> list[str]:
    return sorted(_ARCHITECTURES)


def create_model(architecture: str, hf_config: dict[str, Any], task: str | None = None) -> nn.Module:
    """The model class for `architecture`; with task "sparse", the masked LM with its head."""
    if task == "sparse":
        if architecture not in _MASKED_LMS:
            raise ValueError(
                f"a SPLADE model needs a masked LM with its head, not {architecture!r}; supported: "
                + ", ".join(sorted(_MASKED_LMS))
            )
        return _MASKED_LMS[architecture].from_hf_config(hf_config)
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _ARCHITECTURES[architecture].from_hf_config(hf_config)
