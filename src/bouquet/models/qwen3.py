"""Qwen3-family decoders used as embedders (Qwen3-Embedding, pplx-embed) and rerankers (Qwen3-Reranker): RMSNorm,
RoPE, grouped-query attention with per-head q/k norms, SwiGLU; causal, or bidirectional when the config sets
`use_bidirectional_attention`.

Parameter names follow the Hugging Face checkpoint, with q/k/v fused into `qkv_proj` and gate/up into
`gate_up_proj`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.attention import Attention
from bouquet.layers.heads import LinearHead, lm_head_rows, take_head_weights
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.layers.mlp import GatedMLP
from bouquet.layers.norms import RMSNorm
from bouquet.layers.rotary import RotaryEmbedding, config_rope_theta
from bouquet.layers.weights import drop_ignored, fuse, strip_prefixes
from bouquet.model_dir import PoolingMethod, num_labels

_IGNORED = re.compile(r"lm_head\..*")


@dataclass(frozen=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    causal: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Qwen3Config:
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r} for Qwen3; supported: silu")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            num_kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"],
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=config_rope_theta(config, 10000.0),
            attention_bias=config.get("attention_bias", False),
            causal=not config.get("use_bidirectional_attention", False),
        )


class Qwen3Attention(nn.Module):
    # rotary: (positions, q, k) -> (q, k); a RotaryEmbedding, or Qwen3-VL's multimodal one (positions [3, T])
    def __init__(self, config: Qwen3Config, rotary: nn.Module):
        super().__init__()
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(config.num_heads, config.num_kv_heads, config.head_dim, causal=config.causal)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q = self.q_norm(q.unflatten(1, (-1, self.head_dim)))  # [T, H, hd] float32
        k = self.k_norm(k.unflatten(1, (-1, self.head_dim)))  # [T, Hkv, hd] float32
        q, k = self.rotary(positions, q, k)
        compute_dtype = qkv.dtype
        out = self.attn(q.to(compute_dtype), k.to(compute_dtype), v.unflatten(1, (-1, self.head_dim)))
        return self.o_proj(out)


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, rotary: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, rotary)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "silu")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # The residual stream stays float32; sublayer outputs in the compute dtype are promoted on add.
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3Model(nn.Module):
    # Without sentence-transformers metadata: a decoder's last token has seen the whole sequence.
    default_pooling = PoolingMethod.LAST

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_positions, config.rope_theta)
        self.layers = nn.ModuleList(Qwen3DecoderLayer(config, rotary) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Qwen3Model:
        return cls(Qwen3Config.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its rotary table holds."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # unused: decoders have no token types
    ) -> torch.Tensor:  # [T, D] float32
        hidden = self.embed_tokens(input_ids).float()
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = drop_ignored(strip_prefixes(state, ("model.",)), _IGNORED)
        for i in range(self.config.num_layers):
            attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
            kinds = ("weight", "bias") if self.config.attention_bias else ("weight",)
            for kind in kinds:
                fuse(state, f"{attn}.qkv_proj.{kind}", [f"{attn}.{p}_proj.{kind}" for p in "qkv"])
            fuse(state, f"{mlp}.gate_up_proj.weight", [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"])
        return state


class Qwen3ForSequenceClassification(Qwen3Model):
    """A decoder reranker: the last token's state through a bias-free `score` projection. Two checkpoints: a
    converted one (Qwen3-Reranker-seq-cls) with its `score.weight`, and the original Qwen3-Reranker, a causal LM
    whose score is logit("yes") - logit("no") at the last token. For the latter model_dir.py names the tokens
    (`score_token_ids`, from sentence-transformers' LogitScore or vLLM's `classifier_from_token`) and the
    projection is that one row of the LM head, so no vocabulary-wide product is ever computed."""

    task = "score"
    score_pooling = PoolingMethod.LAST

    def __init__(self, config: Qwen3Config, labels: int, score_token_ids: tuple[int, int | None] | None, tied: bool):
        super().__init__(config)
        self.score_head = LinearHead(config.hidden_size, labels)
        self.score_token_ids = score_token_ids
        # The LM head's checkpoint name: tied embeddings (Qwen3-Reranker-0.6B) save no lm_head of their own.
        self.lm_head_name = "model.embed_tokens.weight" if tied else "lm_head.weight"

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Qwen3ForSequenceClassification:
        token_ids = hf_config.get("score_token_ids")
        labels = 1 if token_ids else num_labels(hf_config)
        tied = bool(hf_config.get("tie_word_embeddings", False))
        return cls(Qwen3Config.from_hf(hf_config), labels, tuple(token_ids) if token_ids else None, tied)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.score_token_ids is None:
            head = take_head_weights(state, {"score.weight": "score"})["score"]
        elif self.lm_head_name not in state:
            raise ValueError(f"missing weight: {self.lm_head_name}")
        else:  # one row made of LM-head rows; the LM head is dropped as ignored, or stays as the tied embeddings
            head = lm_head_rows(state[self.lm_head_name], *self.score_token_ids)
        return {**super().convert_checkpoint(state), "score_head.out.weight": head}
