"""GTE encoders (gte-base-en-v1.5, gte-multilingual-base as transformers' `GteModel`): rotary positions over the
whole head (rotate-half form), post-norm layers, a gated MLP (act(gate) * up) with biased q/k/v, output and
down projections; token types where `type_vocab_size` is not 0, no position table.

Parameter names follow the checkpoint as Alibaba released it, which is also what transformers' `save_pretrained`
writes (its conversion mapping renames them only in memory): `encoder.layer.N.attention.qkv_proj` (q, k and v
fused), `attention.o_proj`, `attn_ln`, `mlp.up_gate_proj` (up, then gate), `mlp.down_proj`, `mlp_ln`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.activation import get_activation
from bouquet.layers.attention import Attention
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.rotary import RotaryEmbedding, config_rope_theta
from bouquet.layers.weights import drop_ignored, strip_prefixes
from bouquet.model_dir import PoolingMethod

# The classification pooler some checkpoints carry; embeddings never use it.
_IGNORED = re.compile(r"pooler\..*")


@dataclass(frozen=True)
class GteConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str
    rope_theta: float

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> GteConfig:
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 1),
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            hidden_act=config.get("hidden_act", "gelu"),
            rope_theta=config_rope_theta(config, 160000.0),  # transformers' GTE defaults to a base of 160000
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class GteAttention(nn.Module):
    def __init__(self, config: GteConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = Linear(config.hidden_size, config.hidden_size)
        self.rotary = rotary
        self.attn = Attention(config.num_heads, config.num_heads, config.head_dim, causal=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)  # [T, H, hd] each
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v))


class GteMLP(nn.Module):
    def __init__(self, config: GteConfig):
        super().__init__()
        self.up_gate_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)
        self.activation = get_activation(config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        up, gate = self.up_gate_proj(hidden).chunk(2, dim=1)
        return self.down_proj(self.activation(gate) * up)


class GteLayer(nn.Module):
    def __init__(self, config: GteConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.attention = GteAttention(config, rotary)
        self.attn_ln = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = GteMLP(config)
        self.mlp_ln = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Post-norm; the residual stream stays float32 (sublayer outputs are promoted on add).
        hidden = self.attn_ln(hidden + self.attention(positions, hidden))
        return self.mlp_ln(hidden + self.mlp(hidden))


class GteEmbeddings(nn.Module):
    def __init__(self, config: GteConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        # gte-base-en-v1.5 sets type_vocab_size to 0 and ships no token-type table.
        self.token_type_embeddings = (
            nn.Embedding(config.type_vocab_size, config.hidden_size) if config.type_vocab_size else None
        )
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids)
        if self.token_type_embeddings is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
            embeddings = embeddings + self.token_type_embeddings(types)
        return self.LayerNorm(embeddings)  # [T, D] float32


class GteEncoder(nn.Module):
    def __init__(self, config: GteConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.layer = nn.ModuleList(GteLayer(config, rotary) for _ in range(config.num_layers))


class GteModel(nn.Module):
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools an encoder.
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: GteConfig):
        super().__init__()
        self.config = config
        self.embeddings = GteEmbeddings(config)
        rotary = RotaryEmbedding(config.head_dim, config.max_positions, config.rope_theta)
        self.encoder = GteEncoder(config, rotary)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> GteModel:
        return cls(GteConfig.from_hf(hf_config))

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
        hidden = self.embeddings(input_ids, token_type_ids)
        for layer in self.encoder.layer:
            hidden = layer(positions, hidden)
        return hidden

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # `new.` wraps the released checkpoints' task models; transformers strips it for GTE too.
        return drop_ignored(strip_prefixes(state, ("new.",)), _IGNORED)
