"""Heads that turn a pooled row into a cross-encoder's scores. Kept in float32 (plain nn.Linear, which the
engine leaves in float32): a [B, hidden] row is cheap, and the scores are what a reranker sorts by.

Every head has an `out` projection to `num_labels` logits; the pooler reads `num_labels` as the row's width."""

from __future__ import annotations

import torch
from torch import nn

from bouquet.layers.activation import get_activation
from bouquet.layers.norms import LayerNorm


class ClassifierHead(nn.Module):
    """tanh(x @ W1.T + b1) @ W2.T + b2: BERT's pooler with its classifier, and RoBERTa's classification head."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)
        self.num_labels = num_labels

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [B, hidden] float32 -> [B, num_labels] logits
        return self.out(torch.tanh(self.dense(rows)))


class NormedClassifierHead(nn.Module):
    """norm(act(x @ W1.T (+ b1))) @ W2.T + b2: ModernBERT's prediction head with its classifier."""

    def __init__(
        self, hidden_size: int, num_labels: int, activation: str, eps: float, dense_bias: bool, norm_bias: bool
    ):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size, bias=dense_bias)
        self.activation = get_activation(activation)
        self.norm = LayerNorm(hidden_size, eps=eps, bias=norm_bias)
        self.out = nn.Linear(hidden_size, num_labels)
        self.num_labels = num_labels

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [B, hidden] float32 -> [B, num_labels] logits
        return self.out(self.norm(self.activation(self.dense(rows))))


class LinearHead(nn.Module):
    """x @ W.T, no bias: a decoder's `score` projection (Qwen3ForSequenceClassification), or rows of its LM head
    (a causal reranker's "yes" less "no", `lm_head_rows`) without the vocabulary-wide projection."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.out = nn.Linear(hidden_size, num_labels, bias=False)
        self.num_labels = num_labels

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [B, hidden] float32 -> [B, num_labels] logits
        return self.out(rows)


def lm_head_rows(lm_head: torch.Tensor, true_id: int, false_id: int | None) -> torch.Tensor:  # [1, hidden]
    """The one row whose product with a token state is logit[true] - logit[false] (logit[true] without a false
    token): sentence-transformers' LogitScore, and vLLM's `classifier_from_token` conversion."""
    row = lm_head[true_id].float()
    return (row if false_id is None else row - lm_head[false_id].float())[None]


def take_head_weights(state: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Removes the head's tensors from `state` under the model's names (`names`: checkpoint name -> module name)."""
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"missing weight: {missing[0]}")
    return {module_name: state.pop(name) for name, module_name in names.items()}
