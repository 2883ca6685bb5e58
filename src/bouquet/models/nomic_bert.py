"""NomicBERT encoders (nomic-embed-text-v1, v1.5): BERT's post-norm layout with rotary positions over the
whole head (rotate-half form), a SwiGLU MLP and no biases in any projection; token types, no position table.

Parameter names follow the checkpoint as nomic released it, which is also what transformers' `save_pretrained`
writes (its conversion mapping renames them only in memory): `emb_ln`, `encoder.layers.N.attn.Wqkv` (q, k and
v already fused), `attn.out_proj`, `mlp.fc11` (up), `mlp.fc12` (gate), `mlp.fc2` (down), `norm1`, `norm2`.
Only fc12 and fc11 are fused, into `mlp.gate_up_proj`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.activation import get_activation
from bouquet.layers.attention import Attention
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.rotary import RotaryEmbedding, config_rope_theta
from bouquet.layers.weights import fuse
from bouquet.model_dir import PoolingMethod


@dataclass(frozen=True)
class NomicBertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    rope_theta: float

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> NomicBertConfig:
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 2),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            hidden_act=config.get("hidden_act", "silu"),
            rope_theta=config_rope_theta(config, 1000.0),  # transformers' NomicBERT defaults to a base of 1000
        )


class NomicBertAttention(nn.Module):
    def __init__(self, config: NomicBertConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        width = config.num_heads * config.head_dim
        self.Wqkv = QKVLinear(config.hidden_size, 3 * width, bias=False)
        self.out_proj = Linear(width, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = Attention(config.num_heads, config.num_heads, config.head_dim, causal=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        qkv = self.Wqkv(hidden)
        q, k, v = qkv.unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)  # [T, H, hd] each
        q, k = self.rotary(positions, q, k)
        return self.out_proj(self.attn(q, k, v))


class NomicBertMLP(nn.Module):
    def __init__(self, config: NomicBertConfig):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.activation = get_activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden).chunk(2, dim=1)
        return self.fc2(self.activation(gate) * up)


class NomicBertLayer(nn.Module):
    def __init__(self, config: NomicBertConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.attn = NomicBertAttention(config, rotary)
        self.norm1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = NomicBertMLP(config)
        self.norm2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Post-norm; the residual stream stays float32 (sublayer outputs are promoted on add).
        hidden = self.norm1(hidden + self.attn(positions, hidden))
        return self.norm2(hidden + self.mlp(hidden))


class NomicBertEmbeddings(nn.Module):
    def __init__(self, config: NomicBertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)


class NomicBertEncoder(nn.Module):
    def __init__(self, config: NomicBertConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.layers = nn.ModuleList(NomicBertLayer(config, rotary) for _ in range(config.num_layers))


class NomicBertModel(nn.Module):
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools an encoder (and nomic's
    # released models mean-pool too).
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: NomicBertConfig):
        super().__init__()
        self.config = config
        self.embeddings = NomicBertEmbeddings(config)
        self.emb_ln = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        rotary = RotaryEmbedding(config.head_dim, config.max_positions, config.rope_theta)
        self.encoder = NomicBertEncoder(config, rotary)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> NomicBertModel:
        return cls(NomicBertConfig.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its rotary table holds."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # [T]
    ) -> torch.Tensor:  # [T, D] float32
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.embeddings.word_embeddings(input_ids) + self.embeddings.token_type_embeddings(token_type_ids)
        hidden = self.emb_ln(embeddings)
        for layer in self.encoder.layers:
            hidden = layer(positions, hidden)
        return hidden

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        for i in range(self.config.num_layers):
            mlp = f"encoder.layers.{i}.mlp"
            fuse(state, f"{mlp}.gate_up_proj.weight", [f"{mlp}.fc12.weight", f"{mlp}.fc11.weight"])
        return state
