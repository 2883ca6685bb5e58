"""MPNet encoders (all-mpnet-base-v2, multi-qa-mpnet): BERT's post-norm layers without token types, plus a
relative position bias: every head adds to the score of query i and key j a learned value chosen by the bucket
of j - i, one table shared by all layers.

Position ids start after the padding index as in RoBERTa: transformers' MPNet numbers the non-pad tokens of a
sequence from `padding_idx + 1`, with `padding_idx` fixed at 1 whatever the config's `pad_token_id`, so on
packed sequences a token's position id is its 0-based position plus 2.

Parameter names follow the Hugging Face checkpoint, except that q, k and v are fused into
`attention.qkv_proj`, and the attention's output projection and norm (`attention.attn.o`,
`attention.LayerNorm`) take BERT's names (`attention.output.dense`, `attention.output.LayerNorm`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.attention import Attention
from bouquet.layers.linear import LinearActivation, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.weights import drop_ignored, fuse, strip_prefixes
from bouquet.model_dir import PoolingMethod
from bouquet.models.bert import BertResidualOutput

# The classification pooler, the position-id buffer and the masked-LM head; embeddings never use them.
_IGNORED = re.compile(r"pooler\..*|embeddings\.position_ids|lm_head\..*")
# transformers' MPNet pads with index 1 (not the config's pad_token_id) and numbers tokens from the next one.
_POSITION_OFFSET = 2
# transformers' MPNetEncoder buckets with these constants whatever `relative_attention_num_buckets` says:
# 16 buckets per direction, 8 of them exact distances, the rest log-spaced up to a distance of 128.
_NUM_BUCKETS = 32
_MAX_DISTANCE = 128


@dataclass(frozen=True)
class MPNetConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_positions: int
    relative_buckets: int  # rows in the bias table
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> MPNetConfig:
        buckets = config.get("relative_attention_num_buckets", 32)
        if buckets < _NUM_BUCKETS:
            raise ValueError(f"relative_attention_num_buckets {buckets} < the {_NUM_BUCKETS} buckets MPNet indexes")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            relative_buckets=buckets,
            layer_norm_eps=config.get("layer_norm_eps", 1e-12),
            hidden_act=config.get("hidden_act", "gelu"),
        )


def relative_position_buckets(length: int) -> torch.Tensor:  # [L, L] int64: bucket of query i, key j
    """Keys after the query take the upper half of the buckets; distances under 8 have a bucket each, longer
    ones share log-spaced buckets, the last holding every distance from about 128 on."""
    positions = torch.arange(length)
    distance = positions[:, None] - positions[None, :]  # query i - key j
    half = _NUM_BUCKETS // 2
    exact = half // 2
    direction = (distance < 0).long() * half
    distance = distance.abs()
    # float32 throughout, as transformers computes it, so that no distance lands in a neighbouring bucket.
    scaled = torch.log(distance.float() / exact) / math.log(_MAX_DISTANCE / exact) * (half - exact)
    far = (exact + scaled.long()).clamp(max=half - 1)
    return direction + torch.where(distance < exact, distance, far)


class MPNetEmbeddings(nn.Module):
    def __init__(self, config: MPNetConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_positions, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        summed = self.word_embeddings(input_ids) + self.position_embeddings(positions + _POSITION_OFFSET)
        return self.LayerNorm(summed)  # [T, D] float32


class MPNetAttention(nn.Module):
    def __init__(self, config: MPNetConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv_proj = QKVLinear(config.hidden_size, 3 * config.hidden_size)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, causal=False, position_bias=True)
        self.output = BertResidualOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        q, k, v = self.qkv_proj(hidden).unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)
        return self.output(self.attn(q, k, v, bias=bias), residual=hidden)


class MPNetIntermediate(nn.Module):
    def __init__(self, config: MPNetConfig):
        super().__init__()
        self.dense = LinearActivation(config.hidden_size, config.intermediate_size, config.hidden_act)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.dense(hidden)  # [T, I]


class MPNetLayer(nn.Module):
    def __init__(self, config: MPNetConfig):
        super().__init__()
        self.attention = MPNetAttention(config)
        self.intermediate = MPNetIntermediate(config)
        self.output = BertResidualOutput(config.intermediate_size, config.hidden_size, config.layer_norm_eps)

    def forward(self, hidden: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        hidden = self.attention(hidden, bias)
        return self.output(self.intermediate(hidden), residual=hidden)


class MPNetEncoder(nn.Module):
    def __init__(self, config: MPNetConfig, max_seq_length: int):
        super().__init__()
        self.layer = nn.ModuleList(MPNetLayer(config) for _ in range(config.num_layers))
        self.relative_attention_bias = nn.Embedding(config.relative_buckets, config.num_heads)
        self.max_seq_length = max_seq_length
        self._bias: torch.Tensor | None = None
        self._bias_source: tuple[torch.device, int] | None = None

    def position_bias(self) -> torch.Tensor:  # [H, L, L] float32, L the longest sequence
        """The bias table for the longest sequence: a backend reads its top-left [len, len] per sequence, so the
        model needs no batch metadata and the table's shape never changes (CUDA graphs). Building it costs
        milliseconds, more than a short query's whole forward on the CPU, so it is built once, and again only
        if the bias weights are loaded anew or moved."""
        weight = self.relative_attention_bias.weight
        source = (weight.device, weight._version)
        if self._bias is None or self._bias_source != source:
            buckets = relative_position_buckets(self.max_seq_length).to(weight.device)
            self._bias = F.embedding(buckets, weight).permute(2, 0, 1).contiguous()
            self._bias_source = source
        return self._bias


class MPNetModel(nn.Module):
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools an encoder.
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: MPNetConfig):
        super().__init__()
        self.config = config
        self.embeddings = MPNetEmbeddings(config)
        self.encoder = MPNetEncoder(config, self.max_seq_length)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> MPNetModel:
        return cls(MPNetConfig.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its position table holds: the first two rows are never used."""
        return self.config.max_positions - _POSITION_OFFSET

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] 0-based within each sequence
        token_type_ids: torch.Tensor | None = None,  # unused: MPNet has no token types
    ) -> torch.Tensor:  # [T, D] float32
        hidden = self.embeddings(input_ids, positions)
        bias = self.encoder.position_bias()  # shared by every layer
        for layer in self.encoder.layer:
            hidden = layer(hidden, bias)
        return hidden

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state = drop_ignored(strip_prefixes(state, ("mpnet.",)), _IGNORED)
        for i in range(self.config.num_layers):
            prefix = f"encoder.layer.{i}.attention"
            for kind in ("weight", "bias"):
                fuse(state, f"{prefix}.qkv_proj.{kind}", [f"{prefix}.attn.{name}.{kind}" for name in "qkv"])
                state[f"{prefix}.output.dense.{kind}"] = _pop(state, f"{prefix}.attn.o.{kind}")
                state[f"{prefix}.output.LayerNorm.{kind}"] = _pop(state, f"{prefix}.LayerNorm.{kind}")
        return state


def _pop(state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in state:
        raise ValueError(f"missing weight: {name}")
    return state.pop(name)
