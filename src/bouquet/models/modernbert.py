"""ModernBERT encoders (gte-modernbert, nomic-modernbert): pre-norm layers with LayerNorms that have no bias
unless `norm_bias`, a GeGLU MLP (act(input) * gate), rotary positions, and global layers between local ones
that see only a window of neighbours; the local layers rotate with their own base. Bidirectional.

Parameter names follow the checkpoint (`embeddings.tok_embeddings`, `embeddings.norm`, `layers.N.attn_norm`,
`attn.Wqkv` with q, k and v already fused, `attn.Wo`, `mlp_norm`, `mlp.Wi` with input and gate fused, `mlp.Wo`,
`final_norm`). The first layer has no `attn_norm`: the embedding norm precedes it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.activation import get_activation
from bouquet.layers.attention import Attention
from bouquet.layers.heads import NormedClassifierHead, take_head_weights
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.rotary import RotaryEmbedding, rope_theta
from bouquet.layers.weights import drop_ignored, strip_prefixes
from bouquet.model_dir import PoolingMethod, num_labels

# ModernBertForMaskedLM's prediction head and decoder; embeddings never use them.
_IGNORED = re.compile(r"head\..*|decoder\..*")
_DEFAULT_THETA = {"full_attention": 160000.0, "sliding_attention": 10000.0}
_LEGACY_THETA_KEYS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}


@dataclass(frozen=True)
class ModernBertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    norm_eps: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    global_rope_theta: float
    local_rope_theta: float
    local_layers: tuple[bool, ...]  # per layer: True where it attends within the window only
    window: int  # tokens seen on each side by a local layer

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModernBertConfig:
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            norm_eps=config.get("norm_eps", 1e-5),
            norm_bias=config.get("norm_bias", False),
            attention_bias=config.get("attention_bias", False),
            mlp_bias=config.get("mlp_bias", False),
            hidden_act=config.get("hidden_activation", "gelu"),
            global_rope_theta=_rope_theta(config, "full_attention"),
            local_rope_theta=_rope_theta(config, "sliding_attention"),
            local_layers=_local_layers(config),
            # `local_attention` is the whole window: transformers masks keys further than half of it from the
            # query, either side (|i - j| <= local_attention // 2), as ModernBERT was trained.
            window=config.get("local_attention", 128) // 2,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def _local_layers(config: dict[str, Any]) -> tuple[bool, ...]:
    # transformers 5 writes `layer_types`; released checkpoints carry a global layer every n, from layer 0.
    if config.get("layer_types"):
        return tuple(kind == "sliding_attention" for kind in config["layer_types"])
    every = config.get("global_attn_every_n_layers", 3)
    return tuple(i % every != 0 for i in range(config["num_hidden_layers"]))


def _rope_theta(config: dict[str, Any], layer_type: str) -> float:
    # transformers 5 writes `rope_parameters` per layer type; released checkpoints carry `global_rope_theta` and
    # `local_rope_theta`.
    rope = (config.get("rope_parameters") or {}).get(layer_type) or {}
    legacy = config.get(_LEGACY_THETA_KEYS[layer_type]) or _DEFAULT_THETA[layer_type]
    return rope_theta(rope, legacy, f" for {layer_type}")


class ModernBertAttention(nn.Module):
    def __init__(self, config: ModernBertConfig, rotary: RotaryEmbedding, local: bool):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.Wqkv = QKVLinear(config.hidden_size, 3 * config.hidden_size, bias=config.attention_bias)
        self.Wo = Linear(config.hidden_size, config.hidden_size, bias=config.attention_bias)
        self.rotary = rotary
        window = (config.window, config.window) if local else None
        self.attn = Attention(config.num_heads, config.num_heads, config.head_dim, causal=False, sliding_window=window)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        qkv = self.Wqkv(hidden)
        q, k, v = qkv.unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)  # [T, H, hd] each
        q, k = self.rotary(positions, q, k)
        return self.Wo(self.attn(q, k, v))


class ModernBertMLP(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.Wi = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.Wo = Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.activation = get_activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The activated half comes first in Wi's output, the gate second.
        up, gate = self.Wi(hidden).chunk(2, dim=1)
        return self.Wo(self.activation(up) * gate)


class ModernBertLayer(nn.Module):
    def __init__(self, config: ModernBertConfig, rotary: RotaryEmbedding, index: int):
        super().__init__()
        # Layer 0 reads the embedding norm's output directly: it has no norm of its own before attention.
        self.attn_norm = _layer_norm(config) if index else nn.Identity()
        self.attn = ModernBertAttention(config, rotary, local=config.local_layers[index])
        self.mlp_norm = _layer_norm(config)
        self.mlp = ModernBertMLP(config)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Pre-norm; the residual stream stays float32 (sublayer outputs are promoted on add).
        hidden = hidden + self.attn(positions, self.attn_norm(hidden))
        return hidden + self.mlp(self.mlp_norm(hidden))


class ModernBertEmbeddings(nn.Module):
    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norm = _layer_norm(config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.norm(self.tok_embeddings(input_ids))  # [T, D] float32


def _layer_norm(config: ModernBertConfig) -> LayerNorm:
    return LayerNorm(config.hidden_size, eps=config.norm_eps, bias=config.norm_bias)


class ModernBertModel(nn.Module):
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools an encoder.
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: ModernBertConfig):
        super().__init__()
        self.config = config
        self.embeddings = ModernBertEmbeddings(config)
        rotary = {
            True: RotaryEmbedding(config.head_dim, config.max_positions, config.local_rope_theta),
            False: RotaryEmbedding(config.head_dim, config.max_positions, config.global_rope_theta),
        }
        self.layers = nn.ModuleList(
            ModernBertLayer(config, rotary[config.local_layers[i]], i) for i in range(config.num_layers)
        )
        self.final_norm = _layer_norm(config)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> ModernBertModel:
        return cls(ModernBertConfig.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its rotary tables hold."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # unused: ModernBERT has no token types
    ) -> torch.Tensor:  # [T, D] float32
        hidden = self.embeddings(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.final_norm(hidden)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # `model.` wraps the encoder in ModernBertForMaskedLM (ModernBERT-base as released).
        return drop_ignored(strip_prefixes(state, ("model.",)), _IGNORED)


# `classifier_pooling` to the rows the head reads: the first token, or the mean of the sequence's tokens.
_CLASSIFIER_POOLING = {"cls": PoolingMethod.CLS, "mean": PoolingMethod.MEAN}
# The classification head's tensors, by their checkpoint names, to the module's; biases only where configured.
_CLASSIFIER_WEIGHTS = {
    "head.dense.weight": "score_head.dense.weight",
    "head.dense.bias": "score_head.dense.bias",
    "head.norm.weight": "score_head.norm.weight",
    "head.norm.bias": "score_head.norm.bias",
    "classifier.weight": "score_head.out.weight",
    "classifier.bias": "score_head.out.bias",
}


class ModernBertForSequenceClassification(ModernBertModel):
    """A cross-encoder (gte-reranker-modernbert): the encoder, its first token or mean (`classifier_pooling`),
    then dense, activation and norm (`head`) and the classifier."""

    task = "score"

    def __init__(self, config: ModernBertConfig, head: NormedClassifierHead, pooling: PoolingMethod):
        super().__init__(config)
        self.score_head = head
        self.score_pooling = pooling

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> ModernBertForSequenceClassification:
        config = ModernBertConfig.from_hf(hf_config)
        pooling = hf_config.get("classifier_pooling", "cls")
        if pooling not in _CLASSIFIER_POOLING:
            raise ValueError(f"unsupported classifier_pooling {pooling!r}; supported: {', '.join(_CLASSIFIER_POOLING)}")
        head = NormedClassifierHead(
            config.hidden_size, num_labels(hf_config), hf_config.get("classifier_activation", "gelu"), config.norm_eps,
            dense_bias=hf_config.get("classifier_bias", False), norm_bias=config.norm_bias,
        )  # fmt: skip
        return cls(config, head, _CLASSIFIER_POOLING[pooling])

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        present = {name: module for name, module in _CLASSIFIER_WEIGHTS.items() if not name.endswith(".bias")}
        present |= {name: module for name, module in _CLASSIFIER_WEIGHTS.items() if name in state}
        head = take_head_weights(state, present)
        return {**super().convert_checkpoint(state), **head}
