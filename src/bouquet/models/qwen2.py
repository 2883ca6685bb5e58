"""Qwen2-family decoders used as embedders (gte-Qwen2, stella): RMSNorm, RoPE, grouped-query attention with
biased q/k/v projections, SwiGLU; causal, with a sliding window on the layers the config names.

transformers' Qwen2 slides a window only where `use_sliding_window` is set, and then on the layers
`layer_types` marks "sliding_attention" (by default those from `max_window_layers` on). Its mask lets query i
see key j when i - window < j <= i: the window counts the query itself, so it reaches `window - 1` keys back.

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
from bouquet.layers.linear import Linear, QKVLinear
from bouquet.layers.mlp import GatedMLP
from bouquet.layers.norms import RMSNorm
from bouquet.layers.rotary import RotaryEmbedding, config_rope_theta
from bouquet.layers.weights import drop_ignored, fuse, strip_prefixes
from bouquet.model_dir import PoolingMethod

_IGNORED = re.compile(r"lm_head\..*")


@dataclass(frozen=True)
class Qwen2Config:
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
    attention_bias: bool  # on q, k and v; the output projection never has one
    windows: tuple[int | None, ...]  # per layer: tokens a query sees, itself included; None: all before it

    @classmethod
    def from_hf(cls, config: dict[str, Any], attention_bias: bool, windows: tuple[int | None, ...]) -> Qwen2Config:
        """The sizes every Llama-like config spells the same way; attention bias and windows are the family's."""
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config['hidden_act']!r}; supported: silu")
        if any(window is not None and window < 1 for window in windows):
            raise ValueError(f"sliding_window must be at least 1; got {windows}")
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
            attention_bias=attention_bias,
            windows=windows,
        )


def qwen2_windows(config: dict[str, Any]) -> tuple[int | None, ...]:
    """Each layer's window as transformers' Qwen2Config assigns it."""
    window = config.get("sliding_window") if config.get("use_sliding_window", False) else None
    num_layers = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "sliding_attention" if window is not None and i >= config.get("max_window_layers", 28) else "full_attention"
        for i in range(num_layers)
    ]
    return tuple(window if kind == "sliding_attention" else None for kind in layer_types[:num_layers])


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config, rotary: RotaryEmbedding, window: int | None):
        super().__init__()
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.head_dim = config.head_dim
        self.qkv_proj = QKVLinear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = Attention(
            config.num_heads, config.num_kv_heads, config.head_dim, causal=True,
            sliding_window=None if window is None else (window - 1, 0),
        )  # fmt: skip

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=1)
        q, k = self.rotary(positions, q.unflatten(1, (-1, self.head_dim)), k.unflatten(1, (-1, self.head_dim)))
        return self.o_proj(self.attn(q, k, v.unflatten(1, (-1, self.head_dim))))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2Config, rotary: RotaryEmbedding, window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, rotary, window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, "silu")

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # The residual stream stays float32; sublayer outputs in the compute dtype are promoted on add.
        hidden = hidden + self.self_attn(positions, self.input_layernorm(hidden))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen2Model(nn.Module):
    # Without sentence-transformers metadata: a causal decoder's last token is the only one that has seen the
    # whole sequence.
    default_pooling = PoolingMethod.LAST

    def __init__(self, config: Qwen2Config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        rotary = RotaryEmbedding(config.head_dim, config.max_positions, config.rope_theta)
        self.layers = nn.ModuleList(Qwen2DecoderLayer(config, rotary, window) for window in config.windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> Qwen2Model:
        # transformers' Qwen2 always biases q, k and v.
        return cls(Qwen2Config.from_hf(hf_config, attention_bias=True, windows=qwen2_windows(hf_config)))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its rotary table holds."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] 0-based within each sequence
        token_type_ids: torch.Tensor | None = None,  # unused: decoders have no token types
    ) -> torch.Tensor:  # [T, D] float32
        hidden = self.embed_tokens(input_ids).float()
        for layer in self.layers:
            hidden = layer(positions, hidden)
        return self.norm(hidden)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = drop_ignored(strip_prefixes(state, ("model.",)), _IGNORED)
        kinds = ("weight", "bias") if self.config.attention_bias else ("weight",)
        for i in range(self.config.num_layers):
            attn, mlp = f"layers.{i}.self_attn", f"layers.{i}.mlp"
            for kind in kinds:
                fuse(state, f"{attn}.qkv_proj.{kind}", [f"{attn}.{p}_proj.{kind}" for p in "qkv"])
            fuse(state, f"{mlp}.gate_up_proj.weight", [f"{mlp}.gate_proj.weight", f"{mlp}.up_proj.weight"])
        return state
