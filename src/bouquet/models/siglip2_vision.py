"""SigLIP 2's vision tower (transformers' Siglip2VisionModel, NaFlex) on packed images, each a sequence of its own
of one token per patch: the patches embedded by a Linear, plus the learned square position table resized to the
image's grid (bilinear with antialiasing, as F.interpolate), a bidirectional ViT (SigLIP's layers) whose attention
stays within each image (the forward context says so), then SigLIP's MAP head with a softmax per image.

Parameter names follow the Hugging Face checkpoint.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from bouquet.layers.linear import Linear
from bouquet.layers.norms import LayerNorm
from bouquet.models.clip import ClipEncoder
from bouquet.models.siglip import MapAttention, SiglipConfig, SiglipPoolingHead


def antialias_weights(size: int, side: int, device: torch.device) -> torch.Tensor:  # [size, side] float32
    """The weights F.interpolate(mode="bilinear", align_corners=False, antialias=True) gives the `side` entries of
    one axis for each of `size` outputs: a triangle as wide as the scale when shrinking, each row summing to 1."""
    scale = torch.tensor(side / size, dtype=torch.float32)
    center = (torch.arange(size, device=device, dtype=torch.float32) + 0.5) * scale - 0.5
    source = torch.arange(side, device=device, dtype=torch.float32)
    weights = (1 - (source - center[:, None]).abs() / scale.clamp(min=1)).clamp(min=0)
    return weights / weights.sum(-1, keepdim=True)


class Siglip2VisionEmbeddings(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        width = config.vision.hidden_size
        self.side = config.image_size // config.patch_size
        self.patch_embedding = Linear(config.num_channels * config.patch_size**2, width)
        self.position_embedding = nn.Embedding(self.side**2, width)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:  # [P, D] float32
        patches = self.patch_embedding(pixel_values).float()
        return patches + torch.cat([self.positions(rows, columns) for rows, columns in grids])

    def positions(self, rows: int, columns: int) -> torch.Tensor:  # [rows * columns, D] float32, row by row
        """The position table resized to a rows x columns grid, one axis at a time (resizing is separable)."""
        table = self.position_embedding.weight.float().view(self.side, self.side, -1)
        device = table.device
        resized = torch.einsum("ri,ijd->rjd", antialias_weights(rows, self.side, device), table)
        resized = torch.einsum("cj,rjd->rcd", antialias_weights(columns, self.side, device), resized)
        return resized.flatten(0, 1)


class PackedMapAttention(MapAttention):
    """SigLIP's MAP attention over packed images: the probe's one query per head against each image's own tokens,
    a softmax per image (its largest score subtracted), in float32."""

    def forward(  # type: ignore[override]
        self,
        probe: torch.Tensor,  # [1, D]
        hidden: torch.Tensor,  # [P, D] every image's tokens
        image_of: torch.Tensor,  # [P] int64 each token's image
        num_images: int,
    ) -> torch.Tensor:  # [N, D] float32
        width = hidden.shape[1]
        query = self.q_proj(probe).float().view(self.num_heads, -1)  # [H, hd]
        key, value = self.kv_proj(hidden).float().view(len(hidden), 2, self.num_heads, -1).unbind(1)  # [P, H, hd]
        scores = (key * query).sum(-1) / math.sqrt(query.shape[1])  # [P, H]
        index = image_of[:, None].expand_as(scores)
        peak = scores.new_full((num_images, self.num_heads), -torch.inf).scatter_reduce(0, index, scores, "amax")
        weights = (scores - peak[image_of]).exp()
        total = scores.new_zeros(num_images, self.num_heads).index_add(0, image_of, weights)
        summed = value.new_zeros(num_images, self.num_heads, value.shape[2]).index_add(
            0, image_of, weights[..., None] * value
        )
        return self.out_proj((summed / total[..., None]).view(num_images, width)).float()


class PackedPoolingHead(SiglipPoolingHead):
    def __init__(self, config: SiglipConfig):
        super().__init__(config.vision)
        self.attention = PackedMapAttention(config.vision)

    def forward(self, hidden: torch.Tensor, image_of: torch.Tensor, num_images: int) -> torch.Tensor:  # [N, D]
        pooled = self.attention(self.probe[0], hidden, image_of, num_images)
        return pooled + self.mlp(self.layernorm(pooled))


class Siglip2VisionTransformer(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.embeddings = Siglip2VisionEmbeddings(config)
        self.encoder = ClipEncoder(config.vision, causal=False)
        self.post_layernorm = LayerNorm(config.vision.hidden_size, eps=config.vision.layer_norm_eps)
        self.head = PackedPoolingHead(config)

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int]]) -> torch.Tensor:  # [P, D] float32
        """Each image's pooled row at its first patch (the others are never read); the forward context is the
        images' (one sequence each)."""
        hidden = self.post_layernorm(self.encoder(self.embeddings(pixel_values, grids)))
        counts = torch.tensor([rows * columns for rows, columns in grids], device=hidden.device)
        image_of = torch.repeat_interleave(torch.arange(len(grids), device=hidden.device), counts)
        pooled = self.head(hidden, image_of, len(grids))
        rows = hidden.new_zeros(hidden.shape)
        rows[torch.cumsum(counts, 0) - counts] = pooled
        return rows
