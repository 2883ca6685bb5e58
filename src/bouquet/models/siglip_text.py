"""SigLIP's text tower (SigLIP's and SigLIP 2's: transformers' SiglipTextTransformer): CLIP's layers without the
causal mask, the final norm, and a `head` Linear on the state at the last position.

SigLIP was trained on texts padded to a fixed length (64 in every released checkpoint), so that last position is
a pad for any shorter text; transformers' processors and its docs pad so (`padding="max_length"`). `texts` pads them
the same way, with the tokenizer's pad token up to `length`. When the tokenizer gives an attention mask, pads are
never keys: the real tokens' states are then those of the text alone, and the last pad's is all that is read, so
one pad at the last position stands for all of them. Without a mask (SigLIP's own tokenizers give input_ids alone),
pads are keys like any token, and every text runs at `length` tokens. Texts longer than `length` run as sent.

A tokenizer that pads on the left (SigLIP 2's class in transformers 5: tokenizer_class.py) puts the pads first, so
the last position is the text's last token; masked, those pads change nothing but where the text's positions
start, and the text runs alone from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from bouquet.layers.attention import Attention, planned_context
from bouquet.layers.attention_backends import AttentionBackend, create_attention_backend
from bouquet.layers.context import ForwardContext, forward_context
from bouquet.layers.linear import Linear
from bouquet.layers.norms import LayerNorm
from bouquet.models.clip import ClipEncoder, ClipTextEmbeddings
from bouquet.text_padding import TextPadding

if TYPE_CHECKING:
    from bouquet.models.siglip import SiglipConfig


class SiglipTextTransformer(nn.Module):
    def __init__(self, config: SiglipConfig):
        super().__init__()
        self.embeddings = ClipTextEmbeddings(config.vocab_size, config.max_positions, config.text.hidden_size)
        self.encoder = ClipEncoder(config.text, causal=False)
        self.final_layer_norm = LayerNorm(config.text.hidden_size, eps=config.text.layer_norm_eps)
        self.head = Linear(config.text.hidden_size, config.projection_size)
        self._key_lens_backend: AttentionBackend | None = None  # SDPA, for masked pads when the bound one has none

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, P] float32
        """The texts as sent, in the step's forward context; each one's row at its first token."""
        return self.head(self._states(input_ids, positions)[last_token_rows(positions)]).float()

    def _states(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T, D]
        return self.final_layer_norm(self.encoder(self.embeddings(input_ids, positions)))

    @property
    def attention(self) -> Attention:
        """The first layer's attention, whose backend the engine bound (every layer of both towers shares it)."""
        return self.encoder.layers[0].self_attn.attn

    def texts(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        seq_lens: list[int],
        padding: TextPadding | None,
        length: int,  # what the texts are padded to
    ) -> torch.Tensor:  # [T, P] float32: each text's row at its first token
        """The texts padded as the processor pads them (as sent without a pad token), in a context of their own."""
        device = input_ids.device
        if padding is None:
            with forward_context(planned_context(self.attention, seq_lens, device)):
                return self(input_ids, positions)
        ids, padded_positions, padded_lens = padded_layout(input_ids, positions, seq_lens, padding, length)
        with forward_context(self._padded_context(padded_lens, seq_lens, padding.masked)):
            hidden = self._states(ids, padded_positions)
        pooled = self.head(hidden[torch.from_numpy(np.cumsum(padded_lens) - 1).to(device)]).float()
        rows = pooled.new_zeros(len(input_ids), pooled.shape[1])
        rows[torch.from_numpy(np.cumsum(seq_lens) - seq_lens).to(device)] = pooled
        return rows

    def _padded_context(self, padded_lens: list[int], key_lens: list[int], masked: bool) -> ForwardContext:
        """Padded texts: with masked pads only each text's own tokens are keys (on SDPA, unless the bound backend
        masks keys itself)."""
        device = self.embeddings.token_embedding.weight.device
        if not masked:
            return planned_context(self.attention, padded_lens, device)
        lengths = torch.tensor([0, *padded_lens], dtype=torch.int32)
        ctx = ForwardContext(lengths.cumsum(0, dtype=torch.int32).to(device), max(padded_lens), padded_lens,
                             key_lens=key_lens)  # fmt: skip
        ctx.backend = self._masking_backend()
        ctx.attn_metadata = ctx.backend.prepare(ctx)
        return ctx

    def _masking_backend(self) -> AttentionBackend:
        bound = self.attention.backend
        assert bound is not None and bound.shape is not None, "attention ran before the engine bound a backend"
        if bound.supports_key_lens:
            return bound
        if self._key_lens_backend is None:
            self._key_lens_backend = create_attention_backend("sdpa")
            self._key_lens_backend.bind(bound.shape)
        return self._key_lens_backend


def last_token_rows(positions: torch.Tensor) -> torch.Tensor:  # [T] int64
    """For each token, the row whose state it should carry: a sequence's first token takes its last token's row,
    every other token keeps its own. Sequences start where positions are 0; shapes never depend on the values."""
    rows = torch.arange(len(positions), device=positions.device)
    starts = positions == 0
    seq_ids = torch.cumsum(starts, 0) - 1
    last = torch.zeros_like(rows).scatter_reduce(0, seq_ids, rows, "amax")
    return torch.where(starts, last[seq_ids], rows)


def padded_layout(
    input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int], padding: TextPadding, length: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:  # ids [T'], positions [T'], each padded length
    """The texts with the pads the processor gives them up to `length`: after them (masked pads: the last alone), or
    before them (masked pads: none; the texts' positions start where the processor's pads end)."""
    lengths = np.array(seq_lens)
    gaps = np.maximum(length - lengths, 0)  # the positions the processor's pads take
    pads = _pad_counts(gaps, padding)
    padded = lengths + pads
    device = input_ids.device
    lead = pads if padding.left else np.zeros_like(pads)  # pads laid before each text
    shift = np.repeat((np.cumsum(padded) - padded) - (np.cumsum(lengths) - lengths) + lead, lengths)
    real = torch.from_numpy(np.arange(int(lengths.sum())) + shift).to(device)  # each text token's new row
    ids = torch.full((int(padded.sum()),), padding.pad_id, dtype=input_ids.dtype, device=device)
    starts = gaps - pads if padding.left else length - pads
    places = [np.arange(start, start + n) for start, n in zip(starts, pads, strict=True)]
    pad_positions = torch.from_numpy(np.concatenate([np.zeros(0, np.int64), *places])).to(device)
    offsets = torch.from_numpy(np.repeat(gaps if padding.left else np.zeros_like(gaps), lengths)).to(device)
    padded_positions = pad_positions.new_zeros(len(ids)).index_copy(0, real, positions.long() + offsets)
    padded_positions[_pad_rows(real, len(ids))] = pad_positions
    return ids.index_copy(0, real, input_ids), padded_positions, padded.tolist()


def _pad_counts(gaps: np.ndarray, padding: TextPadding) -> np.ndarray:
    """The pads each text runs with: all of them when pads are keys; when they are masked, only the last position
    is read, so one pad stands for all after a text and none is needed before one (module docstring)."""
    if not padding.masked:
        return gaps
    return np.zeros_like(gaps) if padding.left else np.minimum(gaps, 1)


def _pad_rows(real: torch.Tensor, total: int) -> torch.Tensor:  # [total - len(real)] int64
    """The rows of a padded layout that `real` leaves free, in order."""
    free = torch.ones(total, dtype=torch.bool, device=real.device)
    free[real] = False
    return free.nonzero().flatten()
