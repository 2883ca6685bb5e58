"""Model classes by the `architectures` name in a checkpoint's config.json.

A masked LM's checkpoint is also a plain encoder: served for embeddings its head is dropped, and only a directory
whose sentence-transformers files say "sparse" (a SparseEncoder: SPLADE) runs the head, through `_MASKED_LMS`."""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

# "module:Class" under bouquet.models, imported when a checkpoint names it: a replica serves one model, and
# importing the other families' modules (and the layers only they use) at start-up is time it never uses.
_ARCHITECTURES: dict[str, str] = {
    "BertModel": "bert:BertModel",
    "BertForMaskedLM": "bert:BertModel",
    "BertForPreTraining": "bert:BertModel",
    "Qwen2Model": "qwen2:Qwen2Model",
    "Qwen2ForCausalLM": "qwen2:Qwen2Model",
    "Qwen3Model": "qwen3:Qwen3Model",
    "Qwen3ForCausalLM": "qwen3:Qwen3Model",
    "Qwen3ForSequenceClassification": "qwen3:Qwen3ForSequenceClassification",
    "XLMRobertaModel": "xlm_roberta:XLMRobertaModel",
    "XLMRobertaForMaskedLM": "xlm_roberta:XLMRobertaModel",
    "RobertaModel": "xlm_roberta:XLMRobertaModel",
    "JinaEmbeddingsV3Model": "jina_xlm_roberta:JinaXLMRobertaModel",
    "RobertaForMaskedLM": "xlm_roberta:XLMRobertaModel",
    "BertForSequenceClassification": "bert:BertForSequenceClassification",
    "XLMRobertaForSequenceClassification": "xlm_roberta:XLMRobertaForSequenceClassification",
    "RobertaForSequenceClassification": "xlm_roberta:XLMRobertaForSequenceClassification",
    "NomicBertModel": "nomic_bert:NomicBertModel",
    "GteModel": "gte:GteModel",
    "MPNetModel": "mpnet:MPNetModel",
    "MPNetForMaskedLM": "mpnet:MPNetModel",
    "MistralModel": "mistral:MistralModel",
    "MistralForCausalLM": "mistral:MistralModel",
    "ModernBertModel": "modernbert:ModernBertModel",
    "ModernBertForMaskedLM": "modernbert:ModernBertModel",
    "ModernBertForSequenceClassification": "modernbert:ModernBertForSequenceClassification",
    "Gemma3TextModel": "gemma3:Gemma3Model",
    "Gemma3ForCausalLM": "gemma3:Gemma3Model",
    "CLIPModel": "clip:ClipModel",
    "SiglipModel": "siglip:SiglipModel",
    "Siglip2Model": "siglip2:Siglip2Model",
    "Qwen3VLModel": "qwen3_vl:Qwen3VLModel",
    "Qwen3VLForConditionalGeneration": "qwen3_vl:Qwen3VLModel",
}


# Masked LMs with their head, for the "sparse" task.
_MASKED_LMS: dict[str, str] = {
    "BertForMaskedLM": "bert:BertForMaskedLM",
    "XLMRobertaForMaskedLM": "xlm_roberta:XLMRobertaForMaskedLM",
    "RobertaForMaskedLM": "xlm_roberta:XLMRobertaForMaskedLM",
}


def _model_class(path: str) -> type[nn.Module]:
    module, _, name = path.partition(":")
    model_class: type[nn.Module] = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    return model_class


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
        return _model_class(_MASKED_LMS[architecture]).from_hf_config(hf_config)
    if architecture == "XLMRobertaModel" and hf_config.get("position_embedding_type") == "rotary":
        architecture = "JinaEmbeddingsV3Model"  # Jina's remote-code XLM-RoBERTa (jina-colbert-v2's encoder)
    if architecture not in _ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; supported: {', '.join(supported_architectures())}")
    return _model_class(_ARCHITECTURES[architecture]).from_hf_config(hf_config)
