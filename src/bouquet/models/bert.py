"""BERT-family encoders (all-MiniLM, bge, e5): absolute positions, token types, post-norm, GELU,
bidirectional.

Parameter names follow the Hugging Face checkpoint, except that query, key and value are fused into one
projection (`attention.qkv_proj`) so that each layer runs one matrix product for them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.attention import Attention
from bouquet.layers.heads import ClassifierHead, MaskedLMHead, take_head_weights, take_masked_lm_head
from bouquet.layers.layer_stack import run_layers
from bouquet.layers.linear import Linear, LinearActivation, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.weights import drop_ignored, fuse, strip_prefixes
from bouquet.model_dir import PoolingMethod, num_labels

# The classification pooler and the position-id buffer are in most checkpoints; embeddings never use them.
_IGNORED = re.compile(r"pooler\..*|embeddings\.position_ids|cls\..*")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> BertConfig:
        position_type = config.get("position_embedding_type", "absolute")
        if position_type != "absolute":
            raise ValueError(f"unsupported position_embedding_type {position_type!r}; supported: absolute")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            hidden_act=config.get("hidden_act", "gelu"),
        )


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        summed = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(token_type_ids)
        )
        return self.LayerNorm(summed)  # [T, D] float32


class BertResidualOutput(nn.Module):
    """Projection, residual add and post-norm: HF's `attention.output` and `output` blocks."""

    def __init__(self, in_features: int, hidden_size: int, eps: float):
        super().__init__()
        self.dense = Linear(in_features, hidden_size)
        self.LayerNorm = LayerNorm(hidden_size, eps=eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.dense.add_norm(x, residual, self.LayerNorm)  # float32 residual stream


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv_proj = QKVLinear(config.hidden_size, 3 * config.hidden_size)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, causal=False)
        self.output = BertResidualOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        q, k, v = self.qkv_proj(hidden).unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)
        return self.output(self.attn(q, k, v), residual=hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = LinearActivation(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden)  # [T, I]


class BertLayer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertResidualOutput(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden)
        return self.output(self.intermediate(hidden), residual=hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))


class BertModel(nn.Module):
    task = "embed"
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools an encoder.
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> BertModel:
        return cls(BertConfig.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its position table holds."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # [T]
    ) -> torch.Tensor:  # [T, D] float32
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        return run_layers(self.encoder.layer, self.embeddings(input_ids, positions, token_type_ids))

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = drop_ignored(strip_prefixes(state, ("bert.",)), _IGNORED)
        for i in range(self.config.num_layers):
            prefix = f"encoder.layer.{i}.attention"
            for kind in ("weight", "bias"):
                parts = [f"{prefix}.self.{name}.{kind}" for name in ("query", "key", "value")]
                fuse(state, f"{prefix}.qkv_proj.{kind}", parts)
        return state


# The classification head's tensors, by their checkpoint names, to the module's.
_CLASSIFIER_WEIGHTS = {
    "bert.pooler.dense.weight": "score_head.dense.weight",
    "bert.pooler.dense.bias": "score_head.dense.bias",
    "classifier.weight": "score_head.out.weight",
    "classifier.bias": "score_head.out.bias",
}


class BertForSequenceClassification(BertModel):
    """A cross-encoder (ms-marco-MiniLM, bge-reranker-base): BERT, then its pooler on [CLS] and the classifier."""

    task = "score"
    score_pooling = PoolingMethod.CLS

    def __init__(self, config: BertConfig, labels: int):
        super().__init__(config)
        self.score_head = ClassifierHead(config.hidden_size, labels)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> BertForSequenceClassification:
        return cls(BertConfig.from_hf(hf_config), num_labels(hf_config))

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        head = take_head_weights(state, _CLASSIFIER_WEIGHTS)
        return {**super().convert_checkpoint(state), **head}


# The masked-LM head's tensors, by their checkpoint names, to MaskedLMHead's (the decoder's are read apart).
_MASKED_LM_WEIGHTS = {
    "cls.predictions.transform.dense.weight": "dense.weight",
    "cls.predictions.transform.dense.bias": "dense.bias",
    "cls.predictions.transform.LayerNorm.weight": "norm.weight",
    "cls.predictions.transform.LayerNorm.bias": "norm.bias",
}


class BertForMaskedLM(BertModel):
    """A SPLADE model's masked LM (splade-v3, opensearch-neural-sparse): BERT, then its MLM head on every token,
    which SpladePooling reads (layers/sparse.py). The head's transform takes the encoder's activation."""

    task = "sparse"

    def __init__(self, config: BertConfig, tied: bool):
        super().__init__(config)
        self.lm_head = MaskedLMHead(config.hidden_size, config.vocab_size, config.hidden_act, config.layer_norm_eps)
        self.tied = tied

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> BertForMaskedLM:
        return cls(BertConfig.from_hf(hf_config), bool(hf_config.get("tie_word_embeddings", True)))

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = strip_prefixes(state, ("bert.",))
        tied = state.get("embeddings.word_embeddings.weight") if self.tied else None
        head = take_masked_lm_head(state, _MASKED_LM_WEIGHTS, "cls.predictions.decoder", "cls.predictions.bias", tied)
        return {**super().convert_checkpoint(state), **head}
