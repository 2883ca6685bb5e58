"""RoBERTa and XLM-RoBERTa encoders (bge-m3, multilingual-e5): BERT's layers and weight names, with position
ids that start after the padding index.

Hugging Face numbers the non-pad tokens of a sequence from `padding_idx + 1` (`create_position_ids_from_input_ids`),
so on packed sequences, which hold no padding, a token's position id is its 0-based position plus that offset.
Everything else, from the embeddings' sum to the post-norm layers, is BERT's, and so is the code.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from bouquet.layers.heads import ClassifierHead, MaskedLMHead, take_head_weights, take_masked_lm_head
from bouquet.layers.weights import drop_ignored, strip_prefixes
from bouquet.model_dir import PoolingMethod, num_labels
from bouquet.models.bert import BertConfig, BertModel

# The masked-LM head of `...ForMaskedLM` checkpoints; embeddings never use it.
_IGNORED = re.compile(r"lm_head\..*")


class XLMRobertaModel(BertModel):
    def __init__(self, config: BertConfig, padding_idx: int):
        super().__init__(config)
        self.position_offset = padding_idx + 1

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> XLMRobertaModel:
        return cls(BertConfig.from_hf(hf_config), padding_idx=cls.padding_idx(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its position table holds: the first `padding_idx + 1` rows are never used."""
        return self.config.max_positions - self.position_offset

    @staticmethod
    def padding_idx(hf_config: dict[str, Any]) -> int:
        """transformers' RoBERTa and XLM-RoBERTa configurations default to padding index 1."""
        padding_idx = hf_config.get("pad_token_id")
        return 1 if padding_idx is None else int(padding_idx)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] 0-based within each sequence
        token_type_ids: torch.Tensor | None = None,  # [T]
    ) -> torch.Tensor:  # [T, D] float32
        return super().forward(input_ids, positions + self.position_offset, token_type_ids)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = drop_ignored(strip_prefixes(state, ("roberta.",)), _IGNORED)
        return super().convert_checkpoint(state)


# The classification head's tensors, by their checkpoint names, to the module's.
_CLASSIFIER_WEIGHTS = {
    "classifier.dense.weight": "score_head.dense.weight",
    "classifier.dense.bias": "score_head.dense.bias",
    "classifier.out_proj.weight": "score_head.out.weight",
    "classifier.out_proj.bias": "score_head.out.bias",
}


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """A cross-encoder (bge-reranker-v2-m3, ms-marco on RoBERTa): its classification head on the first token."""

    task = "score"
    score_pooling = PoolingMethod.CLS

    def __init__(self, config: BertConfig, padding_idx: int, labels: int):
        super().__init__(config, padding_idx)
        self.score_head = ClassifierHead(config.hidden_size, labels)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> XLMRobertaForSequenceClassification:
        return cls(BertConfig.from_hf(hf_config), cls.padding_idx(hf_config), num_labels(hf_config))

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        head = take_head_weights(state, _CLASSIFIER_WEIGHTS)
        return {**super().convert_checkpoint(state), **head}


# The masked-LM head's tensors, by their checkpoint names, to MaskedLMHead's (the decoder's are read apart).
_MASKED_LM_WEIGHTS = {
    "lm_head.dense.weight": "dense.weight",
    "lm_head.dense.bias": "dense.bias",
    "lm_head.layer_norm.weight": "norm.weight",
    "lm_head.layer_norm.bias": "norm.bias",
}


class XLMRobertaForMaskedLM(XLMRobertaModel):
    """A SPLADE model on RoBERTa or XLM-RoBERTa: the encoder, then its LM head on every token, which SpladePooling
    reads (layers/sparse.py). transformers' RoBERTa head applies exact GELU whatever the encoder's activation."""

    task = "sparse"

    def __init__(self, config: BertConfig, padding_idx: int, tied: bool):
        super().__init__(config, padding_idx)
        self.lm_head = MaskedLMHead(config.hidden_size, config.vocab_size, "gelu", config.layer_norm_eps)
        self.tied = tied

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> XLMRobertaForMaskedLM:
        tied = bool(hf_config.get("tie_word_embeddings", True))
        return cls(BertConfig.from_hf(hf_config), cls.padding_idx(hf_config), tied)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = strip_prefixes(state, ("roberta.",))
        tied = state.get("embeddings.word_embeddings.weight") if self.tied else None
        head = take_masked_lm_head(state, _MASKED_LM_WEIGHTS, "lm_head.decoder", "lm_head.bias", tied)
        return {**super().convert_checkpoint(state), **head}
