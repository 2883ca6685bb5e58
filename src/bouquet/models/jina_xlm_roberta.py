"""XLM-RoBERTa with rotary positions: jinaai's "xlm-roberta-flash-implementation" (jina-colbert-v2's encoder), which
transformers ships as `JinaEmbeddingsV3Model`. BERT's post-norm layers and exact-GELU MLP, with no position table:
rotary positions over the whole head (rotate-half form, base `rotary_emb_base`, 20000 for Jina's models), counted
from 0 in each sequence (not from the padding index as in XLM-RoBERTa); token types; biased projections.

Parameter names follow the checkpoint as Jina released it, which is also what transformers' `save_pretrained`
writes (its conversion mapping renames them only in memory): `emb_ln`, `encoder.layers.N.mixer.Wqkv` (q, k and v
fused), `mixer.out_proj`, `norm1`, `mlp.fc1`, `mlp.fc2`, `norm2`, under `roberta.` in a model with a head
(HF_ColBERT's projection `linear.weight` beside it is read by the engine, not here).

jina-embeddings-v3 adds LoRA task adapters to these weights (`parametrizations` in its checkpoint); they are not
implemented, and such a checkpoint is refused by name. transformers' class has no adapters at all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.attention import Attention
from bouquet.layers.linear import Linear, LinearActivation, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.rotary import RotaryEmbedding, rope_theta
from bouquet.layers.weights import drop_ignored, strip_prefixes
from bouquet.model_dir import PoolingMethod

# The classification pooler and a masked LM's head some checkpoints carry; embeddings never use them.
_IGNORED = re.compile(r"pooler\..*|lm_head\..*")
_ADAPTERS = re.compile(r".*(parametrizations|lora_).*")
JINA_ROTARY_BASE = 20000.0  # transformers' JinaEmbeddingsV3Config default, and Jina's released configs'


@dataclass(frozen=True)
class JinaXLMRobertaConfig:
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
    def from_hf(cls, config: dict[str, Any]) -> JinaXLMRobertaConfig:
        """Jina's remote-code config (`position_embedding_type: rotary`, `rotary_emb_base`) or transformers'
        (`rope_parameters`)."""
        if config.get("rotary_emb_interleaved"):
            raise ValueError("interleaved rotary embeddings are not supported; supported: rotate-half")
        fraction = config.get("rotary_emb_fraction", 1.0)
        if fraction != 1.0:
            raise ValueError(f"rotary_emb_fraction {fraction} is not supported; supported: 1.0 (the whole head)")
        return cls(
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            max_positions=config["max_position_embeddings"],
            type_vocab_size=config.get("type_vocab_size", 1),
            layer_norm_eps=config.get("layer_norm_eps", 1e-5),
            hidden_act=config.get("hidden_act", "gelu"),
            rope_theta=rope_theta(config.get("rope_parameters") or {}, config.get("rotary_emb_base", JINA_ROTARY_BASE)),
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


def is_rotary_xlm_roberta(hf_config: dict[str, Any]) -> bool:
    """Jina's remote-code XLM-RoBERTa config says its positions are rotary; transformers' XLM-RoBERTa has none."""
    return hf_config.get("position_embedding_type") == "rotary"


class JinaMixer(nn.Module):
    def __init__(self, config: JinaXLMRobertaConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.Wqkv = QKVLinear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = Linear(config.hidden_size, config.hidden_size)
        self.rotary = rotary
        self.attn = Attention(config.num_heads, config.num_heads, config.head_dim, causal=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        q, k, v = self.Wqkv(hidden).unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)
        q, k = self.rotary(positions, q, k)
        return self.attn(q, k, v)  # [T, D]: out_proj is applied with the residual add and norm1


class JinaMLP(nn.Module):
    def __init__(self, config: JinaXLMRobertaConfig):
        super().__init__()
        self.fc1 = LinearActivation(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)


class JinaLayer(nn.Module):
    def __init__(self, config: JinaXLMRobertaConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.mixer = JinaMixer(config, rotary)
        self.norm1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = JinaMLP(config)
        self.norm2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        # Post-norm, each block's end fused (Linear.add_norm); the residual stream stays float32.
        hidden = self.mixer.out_proj.add_norm(self.mixer(positions, hidden), hidden, self.norm1)
        return self.mlp.fc2.add_norm(self.mlp.fc1(hidden), hidden, self.norm2)


class JinaEmbeddings(nn.Module):
    def __init__(self, config: JinaXLMRobertaConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)


class JinaEncoder(nn.Module):
    def __init__(self, config: JinaXLMRobertaConfig, rotary: RotaryEmbedding):
        super().__init__()
        self.layers = nn.ModuleList(JinaLayer(config, rotary) for _ in range(config.num_layers))


class JinaXLMRobertaModel(nn.Module):
    task = "embed"
    # Without sentence-transformers metadata, sentence-transformers itself mean-pools an encoder.
    default_pooling = PoolingMethod.MEAN

    def __init__(self, config: JinaXLMRobertaConfig):
        super().__init__()
        self.config = config
        self.embeddings = JinaEmbeddings(config)
        self.emb_ln = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        rotary = RotaryEmbedding(config.head_dim, config.max_positions, config.rope_theta)
        self.encoder = JinaEncoder(config, rotary)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> JinaXLMRobertaModel:
        return cls(JinaXLMRobertaConfig.from_hf(hf_config))

    @property
    def max_seq_length(self) -> int:
        """The longest sequence its rotary table holds."""
        return self.config.max_positions

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T] 0-based within each sequence
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
        adapters = sorted(name for name in state if _ADAPTERS.match(name))
        if adapters:
            raise ValueError(
                f"LoRA task adapters ({adapters[0]}, ...: jina-embeddings-v3's) are not supported; a checkpoint "
                "without them (jina-colbert-v2's encoder) is"
            )
        return drop_ignored(strip_prefixes(state, ("roberta.",)), _IGNORED)
