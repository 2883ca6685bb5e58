"""Sparse rows: one weight per vocabulary entry for a sequence, from its token states.

Two heads compute them. SPLADE (sentence-transformers' SpladePooling after a masked LM) takes, per sequence and
vocabulary entry, the max (or sum) over all its tokens, special tokens included, of log(1 + relu(MLM logit)).
The MLM head's [tokens, vocab] logits are what a batch cannot afford to hold at once (30,522 floats a token for
BERT's vocabulary, 250,002 for XLM-R's), so tokens go through it in blocks of a bounded size, each reduced into
the rows before the next. bge-m3's token weights (FlagEmbedding's `sparse_linear`) put relu(linear(state)) of
each token at its token id, keeping the largest per id, with the special tokens' ids left at zero.

Rows are float32 and as the model computes them: no truncation or normalisation. The heads run eagerly only: a
block loop and per-batch index tensors, never a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.heads import MaskedLMHead

# The most logits a SPLADE block holds at once: 2^24 floats, 64 MB in float32 (550 tokens of BERT's vocabulary).
SPARSE_BLOCK_ELEMENTS = 1 << 24


@dataclass
class SparseInputs:
    """The sequences whose rows are sparse (engine/inputs.py builds them from the host arrays): their tokens, in
    order, by their row in the packed batch."""

    token_index: torch.Tensor  # [L] int64: the hidden row of each sparse sequence's tokens, sequence after sequence
    seq_index: torch.Tensor  # [L] int64: the sparse row (0..S-1) that token belongs to
    input_ids: torch.Tensor  # [L] int64: its token id
    rows: torch.Tensor  # [S] int64: the output row each sparse row takes
    num_rows: int  # S, a host copy
    every_row: bool  # every output row is sparse: no embedding to pool


class SpladeHead(nn.Module):
    """sentence-transformers' SpladePooling over the model's masked-LM head, on packed tokens in blocks."""

    def __init__(self, lm_head: MaskedLMHead, pooling: str, activation: str):
        super().__init__()
        self.lm_head = lm_head
        self.vocab_size = lm_head.vocab_size
        self.pooling = pooling
        self.log1p_count = 2 if activation == "log1p_relu" else 1
        self.block_tokens = max(16, SPARSE_BLOCK_ELEMENTS // self.vocab_size)

    @property
    def name(self) -> str:
        return f"splade-{self.pooling}"

    def forward(self, hidden: torch.Tensor, sparse: SparseInputs) -> torch.Tensor:  # [S, vocab] float32
        if self.pooling == "max":
            return self._log1p(self._max_logits(hidden, sparse).float())
        return self._sum(hidden, sparse)

    def _blocks(self, hidden: torch.Tensor, sparse: SparseInputs):  # (seq_index [b], logits [b, vocab]) per block
        for start in range(0, len(sparse.token_index), self.block_tokens):
            block = slice(start, start + self.block_tokens)
            yield sparse.seq_index[block], self.lm_head(hidden[sparse.token_index[block]])

    def _max_logits(self, hidden: torch.Tensor, sparse: SparseInputs) -> torch.Tensor:  # [S, vocab], logits' dtype
        """max(0, the largest logit) per sequence: relu and log1p rise monotonically, so the max of
        log1p(relu(x)) is log1p of this, and the activation runs on [S, vocab] once instead of on every token."""
        rows = hidden.new_zeros(sparse.num_rows, self.vocab_size, dtype=self.lm_head.decoder.weight.dtype)
        for seq_index, logits in self._blocks(hidden, sparse):
            rows.scatter_reduce_(0, seq_index[:, None].expand_as(logits), logits, "amax")
        return rows

    def _sum(self, hidden: torch.Tensor, sparse: SparseInputs) -> torch.Tensor:
        rows = hidden.new_zeros(sparse.num_rows, self.vocab_size, dtype=torch.float32)
        for seq_index, logits in self._blocks(hidden, sparse):
            rows.index_add_(0, seq_index, self._log1p(F.relu(logits.float())))
        return rows

    def _log1p(self, values: torch.Tensor) -> torch.Tensor:  # values >= 0, float32; in place
        for _ in range(self.log1p_count):
            values = values.log1p_()
        return values


class TokenWeightHead(nn.Module):
    """bge-m3's sparse head: FlagEmbedding's `sparse_linear` (its weight and bias, in float32), each token's
    weight relu(linear(state)) kept at its token id, the largest per id, zero at `skip_token_ids`."""

    def __init__(self, hidden_size: int, vocab_size: int, skip_token_ids: tuple[int, ...]):
        super().__init__()
        self.linear = nn.Linear(hidden_size, 1)
        self.vocab_size = vocab_size
        self.register_buffer("skip_token_ids", torch.tensor(skip_token_ids, dtype=torch.long), persistent=False)

    @property
    def name(self) -> str:
        return "token-weights"

    def token_weights(self, states: torch.Tensor) -> torch.Tensor:  # [L, hidden] -> [L] float32
        return F.relu(self.linear(states.float())).squeeze(1)

    def forward(self, hidden: torch.Tensor, sparse: SparseInputs) -> torch.Tensor:  # [S, vocab] float32
        weights = self.token_weights(hidden[sparse.token_index])  # [L]
        rows = weights.new_zeros(sparse.num_rows * self.vocab_size)
        # Zeros to start: a weight is kept only above zero, as FlagEmbedding keeps it.
        rows.scatter_reduce_(0, sparse.seq_index * self.vocab_size + sparse.input_ids, weights, "amax")
        rows = rows.view(sparse.num_rows, self.vocab_size)
        rows[:, self.skip_token_ids] = 0.0
        return rows


def place_sparse_rows(rows: torch.Tensor, sparse_rows: torch.Tensor, sparse: SparseInputs) -> torch.Tensor:
    """The batch's rows with the sparse ones in their places; the narrower kind padded with zeros."""
    width = max(rows.shape[1], sparse_rows.shape[1])
    rows = F.pad(rows, (0, width - rows.shape[1]))
    return rows.index_copy_(0, sparse.rows, F.pad(sparse_rows, (0, width - sparse_rows.shape[1])))
