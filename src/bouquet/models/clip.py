"""CLIP (transformers' CLIPModel): a text tower and a vision tower, each a pre-norm transformer with learned
absolute positions, projected into one space so that a text's and an image's rows compare.

Text: causal attention; a sequence's features are the state of its EOS token, found as transformers finds it
(the first `eos_token_id`; under configs from before that id was fixed, `eos_token_id == 2`, the highest token id),
after the final norm, through `text_projection`.
Vision: an image of the model's size is one sequence of 1 + (H / p)(W / p) tokens: the class embedding, then its
patches row by row (the patch convolution, of stride p, is a Linear on each flattened patch); bidirectional; the
class token's state after `post_layernorm`, through `visual_projection`.

Both towers put each sequence's projected features at its first token, where the engine's CLS pooling reads them:
the class token is first already, and the text tower moves its EOS token's state there. Which token a text is
pooled at is a rule of this model, not one of sentence-transformers' pooling modes, so the model applies it.
A step may hold texts and images (`cu_images` says which sequences are images): each tower then runs on its own
sequences, in a forward context of their own, and the rows go back to the step's order (`TwoTowerModel`).

Parameter names follow the Hugging Face checkpoint, with q/k/v fused into `qkv_proj` and the patch convolution's
kernel flattened.
"""

from __future__ import annotations

import abc
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bouquet.layers.attention import Attention, planned_context
from bouquet.layers.context import forward_context, get_forward_context
from bouquet.layers.linear import Linear, LinearActivation, QKVLinear
from bouquet.layers.norms import LayerNorm
from bouquet.layers.weights import drop_ignored, fuse, scalar
from bouquet.model_dir import PoolingMethod

# The contrastive temperature and the position-id buffers of older checkpoints; embeddings never use them.
_IGNORED = re.compile(r"logit_scale|.*\.position_ids")
_PATCH_WEIGHT = "vision_model.embeddings.patch_embedding.weight"
_LEGACY_EOS_TOKEN_ID = 2  # configs saved before transformers fixed CLIP's eos_token_id


@dataclass(frozen=True)
class TowerConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> TowerConfig:
        return cls(
            hidden_size=config["hidden_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=config["num_attention_heads"],
            intermediate_size=config["intermediate_size"],
            layer_norm_eps=config.get("layer_norm_eps", 1e-5),
            hidden_act=config.get("hidden_act", "quick_gelu"),
        )


# transformers' CLIPTextConfig and CLIPVisionConfig defaults (ViT-B/32), for configs that leave fields out.
_TEXT_DEFAULTS = dict(vocab_size=49408, hidden_size=512, num_hidden_layers=12, num_attention_heads=8,
                      intermediate_size=2048, max_position_embeddings=77, eos_token_id=49407)  # fmt: skip
_VISION_DEFAULTS = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                        image_size=224, patch_size=32, num_channels=3)  # fmt: skip


@dataclass(frozen=True)
class ClipConfig:
    text: TowerConfig
    vision: TowerConfig
    vocab_size: int
    max_positions: int
    eos_token_id: int
    image_size: int
    patch_size: int
    num_channels: int
    projection_dim: int

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ClipConfig:
        # Older checkpoints save only the fields that differ from transformers' defaults.
        text = {**_TEXT_DEFAULTS, **(config.get("text_config") or {})}
        vision = {**_VISION_DEFAULTS, **(config.get("vision_config") or {})}
        return cls(
            text=TowerConfig.from_hf(text),
            vision=TowerConfig.from_hf(vision),
            vocab_size=text["vocab_size"],
            max_positions=text["max_position_embeddings"],
            eos_token_id=text["eos_token_id"],
            image_size=vision["image_size"],
            patch_size=vision["patch_size"],
            num_channels=vision["num_channels"],
            projection_dim=config.get("projection_dim", 512),
        )

    @property
    def image_tokens(self) -> int:
        """An image's sequence length: the class token and one token per patch."""
        return 1 + (self.image_size // self.patch_size) ** 2


class ClipAttention(nn.Module):
    def __init__(self, config: TowerConfig, causal: bool):
        super().__init__()
        self.num_heads = config.num_heads
        self.head_dim = config.hidden_size // config.num_heads
        self.qkv_proj = QKVLinear(config.hidden_size, 3 * config.hidden_size)
        self.out_proj = Linear(config.hidden_size, config.hidden_size)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, causal=causal)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # hidden: [T, D]
        q, k, v = self.qkv_proj(hidden).unflatten(1, (3 * self.num_heads, self.head_dim)).chunk(3, dim=1)
        return self.out_proj(self.attn(q, k, v))


class ClipMLP(nn.Module):
    def __init__(self, config: TowerConfig):
        super().__init__()
        self.fc1 = LinearActivation(config.hidden_size, config.intermediate_size, config.hidden_act)
        self.fc2 = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(hidden))


class ClipEncoderLayer(nn.Module):
    def __init__(self, config: TowerConfig, causal: bool):
        super().__init__()
        self.layer_norm1 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = ClipAttention(config, causal)
        self.layer_norm2 = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = ClipMLP(config)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # The residual stream stays float32; sublayer outputs in the compute dtype are promoted on add.
        hidden = hidden + self.self_attn(self.layer_norm1(hidden))
        return hidden + self.mlp(self.layer_norm2(hidden))


class ClipEncoder(nn.Module):
    def __init__(self, config: TowerConfig, causal: bool):
        super().__init__()
        self.layers = nn.ModuleList(ClipEncoderLayer(config, causal) for _ in range(config.num_layers))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class ClipTextEmbeddings(nn.Module):
    def __init__(self, vocab_size: int, max_positions: int, width: int):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(max_positions, width)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        return self.token_embedding(input_ids) + self.position_embedding(positions)


class ClipTextTransformer(nn.Module):
    def __init__(self, config: ClipConfig):
        super().__init__()
        self.embeddings = ClipTextEmbeddings(config.vocab_size, config.max_positions, config.text.hidden_size)
        self.encoder = ClipEncoder(config.text, causal=True)
        self.final_layer_norm = LayerNorm(config.text.hidden_size, eps=config.text.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        return self.final_layer_norm(self.encoder(self.embeddings(input_ids, positions)))


class ClipVisionEmbeddings(nn.Module):
    def __init__(self, config: ClipConfig):
        super().__init__()
        width = config.vision.hidden_size
        self.patch_size = config.patch_size
        self.class_embedding = nn.Parameter(torch.zeros(width))
        self.patch_embedding = Linear(config.num_channels * config.patch_size**2, width, bias=False)
        self.position_embedding = nn.Embedding(config.image_tokens, width)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [N * (1 + P), D]
        patches = self.patch_embedding(to_patches(pixel_values, self.patch_size)).float()  # [N, P, D]
        classes = self.class_embedding.expand(len(patches), 1, -1)
        tokens = torch.cat([classes, patches], dim=1).flatten(0, 1)
        return tokens + self.position_embedding(positions)


def to_patches(pixel_values: torch.Tensor, patch: int) -> torch.Tensor:
    """[N, C, H, W] -> [N, (H / patch)(W / patch), C * patch * patch]: patches row by row, each flattened in the
    order of a convolution kernel's (channel, row, column), so the convolution is a product with its kernel."""
    n, c, h, w = pixel_values.shape
    grid = pixel_values.reshape(n, c, h // patch, patch, w // patch, patch)
    return grid.permute(0, 2, 4, 1, 3, 5).reshape(n, (h // patch) * (w // patch), c * patch * patch)


class ClipVisionTransformer(nn.Module):
    def __init__(self, config: ClipConfig):
        super().__init__()
        eps = config.vision.layer_norm_eps
        self.embeddings = ClipVisionEmbeddings(config)
        self.pre_layrnorm = LayerNorm(config.vision.hidden_size, eps=eps)  # transformers' spelling
        self.encoder = ClipEncoder(config.vision, causal=False)
        self.post_layernorm = LayerNorm(config.vision.hidden_size, eps=eps)

    def forward(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        hidden = self.encoder(self.pre_layrnorm(self.embeddings(pixel_values, positions)))
        # Every token is normed, so that each image's row is at its first token as the text tower's is;
        # only the class tokens' rows are read.
        return self.post_layernorm(hidden)


def pooled_token_rows(input_ids: torch.Tensor, positions: torch.Tensor, eos_token_id: int) -> torch.Tensor:  # [T]
    """For each token, the row whose state it should carry: a sequence's first token takes its EOS token's row,
    as transformers' CLIPTextTransformer picks it per sequence (the first EOS, the first token when there is none;
    under the legacy id, the first highest id); every other token keeps its own. Sequences start where positions
    are 0 (pad tokens each start one of their own). Shapes never depend on the values, so a CUDA graph holds it."""
    num_tokens = len(input_ids)
    rows = torch.arange(num_tokens, device=input_ids.device)
    starts = positions == 0
    seq_ids = torch.cumsum(starts, 0) - 1  # [T] each token's sequence
    keys = input_ids.long() if eos_token_id == _LEGACY_EOS_TOKEN_ID else (input_ids == eos_token_id).long()
    best = torch.full_like(keys, torch.iinfo(torch.long).min).scatter_reduce(0, seq_ids, keys, "amax")
    candidates = torch.where(keys == best[seq_ids], rows, num_tokens)
    first = torch.full_like(rows, num_tokens).scatter_reduce(0, seq_ids, candidates, "amin")
    return torch.where(starts, first[seq_ids], rows)


class TwoTowerModel(nn.Module, metaclass=abc.ABCMeta):
    """What the engine reads of a text-and-image model (CLIP's, SigLIP's): its text limit and its image layout; and
    its forward, a step of texts, of images, or of both, each tower on its own sequences. A model gives its rows by
    `text_rows` and `image_rows`, each sequence's at its first token."""

    config: Any  # ClipConfig or SiglipConfig: max_positions, image_tokens, num_channels, image_size
    vision_model: nn.Module
    # Its zero-shot logit, exp(logit_scale) x cosine + logit_bias, as trained: read from the checkpoint as it is
    # converted (None: it has none; CLIP has no bias)
    logit_scale: float | None = None
    logit_bias: float | None = None

    def image_linears(self) -> list[tuple[nn.Module, int, int]]:
        """The modules that only run on image steps, each with its rows for k images (k x per image + extra), so
        that the engine builds their primitives at those counts: the tower on every token, its patch embedding on
        the patches (engine/memory.py's `image_warmup`)."""
        patches = (self.config.image_size // self.config.patch_size) ** 2
        return [(self.vision_model, self.image_tokens, 0), (self.vision_model.embeddings.patch_embedding, patches, 0)]

    @property
    def max_seq_length(self) -> int:
        """The longest text its position table holds."""
        return self.config.max_positions

    @property
    def image_tokens(self) -> int:
        return self.config.image_tokens

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return (self.config.num_channels, self.config.image_size, self.config.image_size)

    @abc.abstractmethod
    def text_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        """Texts, the forward context's sequences."""

    @abc.abstractmethod
    def image_rows(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D] float32
        """Images, the forward context's sequences, one each."""

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]; for an image, zeros that only count its tokens
        positions: torch.Tensor,  # [T]
        token_type_ids: torch.Tensor | None = None,  # unused: no token types
        pixel_values: torch.Tensor | None = None,  # [N, C, H, W] float32: the step's images, one a sequence
        cu_images: torch.Tensor | None = None,  # [B + 1] sequence i's images: cu_images[i]..cu_images[i + 1]
    ) -> torch.Tensor:  # [T, D] float32; each sequence's features at its first token
        seq_lens = get_forward_context().seq_lens
        if pixel_values is None or not len(pixel_values):
            return self.text_rows(input_ids, positions)
        if len(pixel_values) == len(seq_lens):  # every sequence an image (0 or 1 a sequence): no device read
            self._check_images(pixel_values, seq_lens)
            return self.image_rows(pixel_values, positions)
        assert cu_images is not None, "texts beside images come with cu_images (Batch)"
        is_image = (torch.diff(cu_images) > 0).tolist()  # the towers' shapes: read on a mixed step alone
        return self._mixed(input_ids, positions, pixel_values, seq_lens, is_image)

    def _mixed(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        pixel_values: torch.Tensor,
        seq_lens: list[int],
        is_image: list[bool],
    ) -> torch.Tensor:  # [T, D] float32
        """A step of texts and images: each tower on its own sequences, in a forward context of their own (planned
        by the backend bound to every layer), the rows put back at their tokens."""
        image_lens = [length for length, image in zip(seq_lens, is_image, strict=True) if image]
        text_lens = [length for length, image in zip(seq_lens, is_image, strict=True) if not image]
        self._check_images(pixel_values, image_lens)
        token_is_image = torch.repeat_interleave(torch.tensor(is_image), torch.tensor(seq_lens))
        device = input_ids.device
        image_tokens, text_tokens = (rows.nonzero().flatten().to(device) for rows in (token_is_image, ~token_is_image))
        attention = next(module for module in self.modules() if isinstance(module, Attention))
        with forward_context(planned_context(attention, text_lens, device)):
            texts = self.text_rows(input_ids[text_tokens], positions[text_tokens])
        with forward_context(planned_context(attention, image_lens, device)):
            images = self.image_rows(pixel_values, positions[image_tokens])
        rows = texts.new_empty(len(input_ids), texts.shape[1])
        rows[text_tokens], rows[image_tokens] = texts, images
        return rows

    def _check_images(self, pixel_values: torch.Tensor, image_lens: list[int]) -> None:
        config = self.config
        check_images(pixel_values, image_lens, config.num_channels, config.image_size, self.image_tokens)


class ClipModel(TwoTowerModel):
    task = "embed"
    # Each sequence's features are at its first token (see the module's docstring).
    default_pooling = PoolingMethod.CLS
    takes_images = True

    def __init__(self, config: ClipConfig):
        super().__init__()
        self.config = config
        self.text_model = ClipTextTransformer(config)
        self.vision_model = ClipVisionTransformer(config)
        self.text_projection = Linear(config.text.hidden_size, config.projection_dim, bias=False)
        self.visual_projection = Linear(config.vision.hidden_size, config.projection_dim, bias=False)

    @classmethod
    def from_hf_config(cls, hf_config: dict[str, Any]) -> ClipModel:
        return cls(ClipConfig.from_hf(hf_config))

    def image_linears(self) -> list[tuple[nn.Module, int, int]]:
        return [*super().image_linears(), (self.visual_projection, self.image_tokens, 0)]

    def text_rows(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, projection_dim]
        hidden = self.text_model(input_ids, positions)
        hidden = hidden[pooled_token_rows(input_ids, positions, self.config.eos_token_id)]
        return self.text_projection(hidden).float()

    def image_rows(self, pixel_values: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, projection_dim]
        return self.visual_projection(self.vision_model(pixel_values, positions)).float()

    def convert_checkpoint(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.logit_scale = scalar(state, "logit_scale")
        state = drop_ignored(state, _IGNORED)
        for tower, config in (("text_model", self.config.text), ("vision_model", self.config.vision)):
            for i in range(config.num_layers):
                prefix = f"{tower}.encoder.layers.{i}.self_attn"
                for kind in ("weight", "bias"):
                    fuse(state, f"{prefix}.qkv_proj.{kind}", [f"{prefix}.{p}_proj.{kind}" for p in "qkv"])
        if _PATCH_WEIGHT not in state:
            raise ValueError(f"missing weight: {_PATCH_WEIGHT}")
        state[_PATCH_WEIGHT] = state[_PATCH_WEIGHT].flatten(1)  # [D, C, p, p] -> [D, C * p * p]
        return state


def check_images(
    pixel_values: torch.Tensor, image_lens: list[int], channels: int, size: int, tokens_per_image: int
) -> None:
    """A vision tower's images must be its own size, each a sequence of `tokens_per_image` tokens."""
    if tuple(pixel_values.shape[1:]) != (channels, size, size):
        raise ValueError(
            f"images of shape {tuple(pixel_values.shape[1:])}; this model takes ({channels}, {size}, {size}) "
            "(other sizes would need its position embeddings interpolated, which is not supported)"
        )
    if len(image_lens) != len(pixel_values) or any(length != tokens_per_image for length in image_lens):
        raise ValueError(
            f"{len(pixel_values)} image(s) make {len(pixel_values) * tokens_per_image} tokens at this model's patch "
            f"size, {tokens_per_image} each; the batch has {sum(image_lens)} in {len(image_lens)} image sequence(s)"
        )
