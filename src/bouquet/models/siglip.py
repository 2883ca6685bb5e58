"""SigLIP (transformers' SiglipModel): CLIP's two towers (models/clip.py) trained with a sigmoid loss, with three
differences that matter here. The text tower is bidirectional and pooled at its last position, through its own
`head`; it was trained on texts padded to a fixed length, so they are padded as transformers' tokenizer pads them
with `padding="max_length"`, as SigLIP's docs ask (models/siglip_text.py), to the tokenizer's `model_max_length`.
The vision tower has no class token and no pre-norm, and pools with a multi-head attention "MAP" head: one learned
query (the probe) attends over each image's tokens, then a norm and an MLP with a residual. No projections follow:
each head's output is the shared space.

As in CLIP, each sequence's features are put at its first token, where the engine's CLS pooling reads them, so
one pooling serves both towers. The sigmoid loss's scale and bias never enter an embedding.

Parameter names follow the Hugging Face checkpoint, with q/k/v fused into `qkv_proj`, the patch convolution's
kernel flattened, and the MAP head's packed input projection split into its query's and its keys' and values'.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.context import get_forward_context
from bouquet.layers.linear import Linear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.weights import drop_ignored, fuse, scalar
from bouquet.model_dir import PoolingMethod
from bouquet.models.clip import ClipEncoder, ClipMLP, TowerConfig, TwoTowerModel, to_patches
from bouquet.models.siglip_text import SiglipTextTransformer
from bouquet.text_padding import TextPadding

_IGNORED = re.compile(r"logit_scale|logit_bias|.*\.position_ids")
_PATCH_WEIGHT = "vision_model.embeddings.patch_embedding.weight"
_MAP_PREFIX = "vision_model.head.attention"

# transformers' SiglipTextConfig and SiglipVisionConfig defaults, for configs that leave fields out.
_TOWER_DEFAULTS = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                       layer_norm_eps=1e-6, hidden_act="gelu_pytorch_tanh")  # fmt: skip
_TEXT_DEFAULTS = dict(_TOWER_DEFAULTS, vocab_size=32000, max_position_embeddings=64)
_VISION_DEFAULTS = dict(_TOWER_DEFAULTS, image_size=224, patch_size=16, num_channels=3, vision_use_head=True)


@dataclass(frozen=True)
class SiglipConfig:
    text: TowerConfig
    vision: TowerConfig
    vocab_size: int
    max_positions: int
    projection_size: int
    image_size: int
    patch_size: int
    num_channels: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> SiglipConfig:
        text = {**_TEXT_DEFAULTS, **(config.get("text_config") or {})}
        vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
        if not vision["vision_use_head"]:
            raise ValueError(
                "a SigLIP vision tower without its pooling head (vision_use_head false) gives no embedding"
            )
        projection_size = text.get("projection_size") or text["hidden_size"]
        if projection_size != vision["hidden_size"]:
            raise ValueError(
                f"a SigLIP whose text rows (text_config.projection_size {projection_size}) and image rows "
                f"(vision_config.hidden_size {vision['hidden_size']}) differ in width: its texts and images share "
                "no space to compare them in (transformers' SiglipModel cannot score them either)"
            )
        return cls(
            text=TowerConfig.from_hf(text),
            vision=TowerConfig.from_hf(vision),
            vocab_size=text["vocab_size"],
            max_positions=text["max_position_embeddings"],
            projection_size=projection_size,
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            num_channels=vision["num_channels"],
        )

    @property
    def image_tokens(self) -> int:
        """An image's sequence length: one token per patch."""
        return (self.image_size // self.patch_size) ** 2


class SiglipVisionEmbeddings(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        width = config.vision.hidden_size
        self.patch_size = config.patch_size
        self.patch_embedding = Linear(config.num_channels * config.patch_size**2, width)
        self.position_embedding = nn.Embedding(config.image_tokens, width)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [N * P, D] float32
        patches = self.patch_embedding(to_patches(pixel_values, self.patch_size)).float()  # [N, P, D]
        return patches.flatten(0, 1) + self.position_embedding(positions)


class MapAttention(nn.Module):
    """One query per image over all its tokens: torch's MultiheadAttention as SigLIP's head uses it."""

    def __init__(self, config: TowerConfig):
        super().__init__()
        self.num_heads = config.num_heads
        self.q_proj = Linear(config.hidden_size, config.hidden_size)
        self.kv_proj = Linear(config.hidden_size, 2 * config.hidden_size)
        self.out_proj = Linear(config.hidden_size, config.hidden_size)

    def forward(self, probe: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # probe [1, D], hidden [N, L, D]
        n, length, width = hidden.shape
        q = self.q_proj(probe).view(1, self.num_heads, 1, -1).expand(n, -1, -1, -1)  # [N, H, 1, hd]
        k, v = (
            self.kv_proj(hidden.flatten(0, 1)).view(n, length, 2, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        )  # [N, H, L, hd]
        out = F.scaled_dot_product_attention(q, k, v)  # [N, H, 1, hd]
        return self.out_proj(out.reshape(n, width)).float()  # [N, D]


class SiglipPoolingHead(nn.Module):
    def __init__(self, config: TowerConfig):
        super().__init__()
        self.probe = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        self.attention = MapAttention(config)
        self.layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, L, D] -> [N, D] float32
        pooled = self.attention(self.probe[0], hidden)
        return pooled + self.mlp(self.layernorm(pooled))


class SiglipVisionTransformer(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.image_tokens = config.image_tokens
        self.embeddings = SiglipVisionEmbeddings(config)
        self.encoder = ClipEncoder(config.vision, causal=False)
        self.post_layernorm = LayerNorm(config.vision.hidden_size, eps=config.vision.layer_norm_eps)
        self.head = SiglipPoolingHead(config.vision)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        hidden = self.post_layernorm(self.encoder(self.embeddings(pixel_values, positions)))
        pooled = self.head(hidden.view(len(pixel_values), self.image_tokens, -1))  # [N, D]
        rows = hidden.new_zeros(hidden.shape)
        rows[:: self.image_tokens] = pooled  # each image's first token; the others are never read
        return rows


class SiglipModel(TwoTowerModel):
    task = "embed"
    default_pooling = PoolingMethod.CLS  # each sequence's features are at its first token (module docstring)
    takes_images = True
    pads_texts = True  # the loader sets `text_padding` from the tokenizer (models/siglip_text.py)

    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.config = config
        self.text_model = SiglipTextTransformer(config)
        self.vision_model = SiglipVisionTransformer(config)
        self.text_padding: TextPadding | None = None

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> SiglipModel:
        return cls(SiglipConfig.from_hf(hf_config))

    @property
    def text_length(self) -> int:
        """What texts are padded to: the tokenizer's model_max_length, as `padding="max_length"` pads (within the
        position table, where a longer one could not run; the table's length, the trained one, when it is unset)."""
        limit = self.config.max_positions
        padding = self.text_padding
        return limit if padding is None or padding.max_length is None else min(padding.max_length, limit)

    def image_linears(self) -> list[tuple[nn.Module, int, int]]:
        """The pooling head runs on one row an image, but its keys and values on every token and its query on the
        one probe row."""
        attention = self.vision_model.head.attention
        return [
            *super().image_linears(), (self.vision_model.head, 1, 0), (attention.kv_proj, self.image_tokens, 0),
            (attention.q_proj, 0, 1),
        ]  # fmt: skip

    def text_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        if self.text_padding is None:
            return self.text_model(input_ids, positions)
        ctx = get_forward_context()
        return self.text_model.texts(input_ids, positions, ctx.seq_lens, self.text_padding, self.text_length)

    def image_rows(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        return self.vision_model(pixel_values, positions)

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.logit_scale, self.logit_bias = scalar(state, "logit_scale"), scalar(state, "logit_bias")
        return convert_siglip_checkpoint(state, self.config)


def convert_siglip_checkpoint(state: dict[str, torch.Tensor], config: SiglipConfig) -> dict[str, torch.Tensor]:
    """SigLIP's and SigLIP 2's checkpoints to these modules: q/k/v fused, the patch kernel flattened (SigLIP 2's is
    a Linear already), the MAP head's packed projection split."""
    state = drop_ignored(state, _IGNORED)
    for tower, tower_config in (("text_model", config.text), ("vision_model", config.vision)):
        for i in range(tower_config.num_layers):
            prefix = f"{tower}.encoder.layers.{i}.self_attn"
            for kind in ("weight", "bias"):
                fuse(state, f"{prefix}.qkv_proj.{kind}", [f"{prefix}.{p}_proj.{kind}" for p in "qkv"])
    for name in (_PATCH_WEIGHT, f"{_MAP_PREFIX}.in_proj_weight", f"{_MAP_PREFIX}.in_proj_bias"):
        if name not in state:
            raise ValueError(f"missing weight: {name}")
    state[_PATCH_WEIGHT] = state[_PATCH_WEIGHT].flatten(1)  # [D, C, p, p] -> [D, C * p * p]
    width = config.vision.hidden_size
    for kind in ("weight", "bias"):  # torch packs the query's, keys' and values' projections in one
        packed = state.pop(f"{_MAP_PREFIX}.in_proj_{kind}")
        state[f"{_MAP_PREFIX}.q_proj.{kind}"], state[f"{_MAP_PREFIX}.kv_proj.{kind}"] = packed.split([width, 2 * width])
    return state
