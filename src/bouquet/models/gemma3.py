"""Gemma3 text decoders as embedders (EmbeddingGemma, and plain Gemma3 text models): embeddings scaled by
sqrt(hidden), RMSNorms of the (1 + weight) form around both sublayers, grouped-query attention with q/k norms
and `query_pre_attn_scalar` as its scale, a GELU-tanh gated MLP, and sliding-window layers between full ones,
each kind with its own rotary base; causal, or bidirectional when the config sets `use_bidirectional_attention`
(EmbeddingGemma).

Parameter names follow the Hugging Face checkpoint, with q/k/v fused into `qkv_proj` and gate/up into
`gate_up_proj`. Every norm weight is stored as 1 + weight at load, so that the shared RMSNorm computes Gemma's
form (the sum in float32, as transformers computes it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.attention import Attention
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.layers.mlp import GatedMLP
from bouquet.layers.norms import RMSNorm
from bouquet.layers.rotary import RotaryEmbedding, rope_theta
from bouquet.layers.weights import drop_ignored, fuse, strip_prefixes
from bouquet.model_dir import PoolingMethod

# Gemma3ForCausalLM's LM head (tied to the embeddings, when saved at all).
_IGNORED = re.compile(r"lm_head\..*")
_NORM_WEIGHT = re.compile(r".*norm\.weight")
_DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}
_LEGACY_THETA_KEYS = {"full_attention": "rope_theta", "sliding_attention": "rope_local_base_freq"}


@dataclass(frozen=True)
class Gemma3Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    rms_norm_eps: float
    hidden_act: str
    attention_bias: bool
    scale: float
    global_rope_theta: float
    local_rope_theta: float
    sliding_layers: tuple[bool, ...]  # per layer: True where it attends within the window only
    window: tuple[int, int]  # (left, right) tokens a sliding layer's query sees
    causal: bool

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Gemma3Config:
        if config.get("attn_logit_softcapping") is not None:
            raise ValueError(
                f"unsupported attn_logit_softcapping {config['attn_logit_softcapping']!r} for Gemma3: "
                "no attention backend soft-caps scores; supported: null"
            )
        causal = not config.get("use_bidirectional_attention", False)
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
            hidden_act=config.get("hidden_activation") or config.get("hidden_act", "gelu_pytorch_tanh"),
            attention_bias=config.get("attention_bias", False),
            scale=config.get("query_pre_attn_scalar", 256) ** -0.5,
            global_rope_theta=_rope_theta(config, "full_attention"),
            local_rope_theta=_rope_theta(config, "sliding_attention"),
            sliding_layers=_sliding_layers(config),
            window=_window(config, causal),
            causal=causal,
        )


def _sliding_layers(config: dict[str, Any]) -> tuple[bool, ...]:
    # transformers 5 writes `layer_types`; older configs give a pattern: every n-th layer (from 1) is full.
    if config.get("layer_types"):
        return tuple(kind == "sliding_attention" for kind in config["layer_types"])
    every = config.get("sliding_window_pattern", 6)
    return tuple((i + 1) % every != 0 for i in range(config["num_hidden_layers"]))


def _window(config: dict[str, Any], causal: bool) -> tuple[int, int]:
    # As transformers masks (config.json's value): causal, the query and the `sliding_window` - 1 keys before
    # it; bidirectional, `sliding_window // 2` keys either side (its config keeps that half plus one, and the
    # mask admits distances below it).
    sliding_window = config.get("sliding_window") or 0
    if any(_sliding_layers(config)) and sliding_window < 1:
        raise ValueError(f"sliding_window {config.get('sliding_window')!r} must be positive with sliding layers")
    return (sliding_window - 1, 0) if causal else (sliding_window // 2, sliding_window // 2)


def _rope_theta(config: dict[str, Any], layer_type: str) -> float:
    # transformers 5 writes `rope_parameters` per layer type; released checkpoints carry `rope_theta` (full
    # layers), `rope_local_base_freq` (sliding layers) and `rope_scaling` (full layers).
    rope = (config.get("rope_parameters") or {}).get(layer_type) or {}
    if layer_type == "full_attention":
        rope = {**(config.get("rope_scaling") or {}), **rope}
    legacy = config.get(_LEGACY_THETA_KEYS[layer_type]) or _DEFAULT_THETA[layer_type]
    return rope_theta(rope, legacy, f" for {layer_type}")


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3Config, rotary: RotaryEmbedding, sliding: bool):
        super().__init__()
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=config.attention_bias)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.rotary = rotary
        self.attn = Attention(
            config.num_heads, config.num_kv_heads, config.head_dim, causal=config.causal,
            sliding_window=config.window if sliding else None, scale=config.scale,
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        qkv = self.qkv_proj(hidden)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q = self.q_norm(q.unflatten(1, (-1, self.head_dim)))  # [T, H, hd] float32
        k = self.k_norm(k.unflatten(1, (-1, self.head_dim)))  # [T, Hkv, hd] float32
        q, k = self.rotary(positions, q, k)
        compute_dtype = qkv.dtype
        out = self.attn(q.to(compute_dtype), k.to(compute_dtype), v.unflatten(1, (-1, self.head_dim)))
        return self.o_proj(out)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: Gemma3Config, rotary: RotaryEmbedding, sliding: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Gemma3Attention(config, rotary, sliding)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Each sublayer's output is normed again before the float32 residual add.
        attn = self.self_attn(positions, self.input_layernorm(hidden))
        hidden = hidden + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class Gemma3Model(nn.Module):
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools, and EmbeddingGemma (the
    # Gemma3 embedder) is trained with mean pooling.
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # transformers scales in the embedding weights' dtype; they stay float32 here, as in a float32 reference.
        self.embed_scale = config.hidden_size**0.5
        rotary = {
            True: RotaryEmbedding(config.head_dim, config.max_positions, config.local_rope_theta),
            False: RotaryEmbedding(config.head_dim, config.max_positions, config.global_rope_theta),
        }
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, rotary[sliding], sliding) for sliding in config.sliding_layers
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Gemma3Model:
        return cls(Gemma3Config.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its rotary tables hold."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # unused: decoders have no token types
    ) -> torch.Tensor:  # [T, D] float32
        hidden = self.embed_tokens(input_ids).float() * self.embed_scale
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # `model.` wraps the decoder in Gemma3ForCausalLM.
        state = drop_ignored(strip_prefixes(state, ("model.",)), _IGNORED)
        for name in [name for name in state if _NORM_WEIGHT.fullmatch(name)]:
            state[name] = state[name].float() + 1.0
        for i in range(self.config.num_layers):
            attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
            kinds = ("weight", "bias") if self.config.attention_bias else ("weight",)
            for kind in kinds:
                fuse(state, f"{attn}.qkv_proj.{kind}", [f"{attn}.{p}_proj.{kind}" for p in "qkv"])
            fuse(state, f"{mlp}.gate_up_proj.weight", [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"])
        return state
