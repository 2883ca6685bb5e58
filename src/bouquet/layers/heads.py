"""Heads that turn a pooled row into a cross-encoder's scores. Kept in float32 (plain nn.Linear, which the
engine leaves in float32): a [B, hidden] row is cheap, and the scores are what a reranker sorts by.

Every head has an `out` projection to `num_labels` logits; the pooler reads `num_labels` as the row's width.

`MaskedLMHead` is the exception: a masked LM's head over token states (SPLADE's, layers/sparse.py), whose
vocabulary-wide projection is most of its cost, so its matrix products run in the compute dtype as the model's do."""

from __future__ import annotations

import torch
from torch import nn

from bouquet.layers.activation import get_activation
from bouquet.layers.linear import Linear, LinearActivation
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


class MaskedLMHead(nn.Module):
    """norm(act(x @ W1.T + b1)) @ E.T + b: BERT's `cls.predictions` and RoBERTa's `lm_head`, whose decoder is
    the word embeddings (tied) unless the config unties them."""

    def __init__(self, hidden_size: int, vocab_size: int, activation: str, eps: float):
        super().__init__()
        self.dense = LinearActivation(hidden_size, hidden_size, activation)
        self.norm = LayerNorm(hidden_size, eps=eps)
        self.decoder = Linear(hidden_size, vocab_size)  # its own copy of the embeddings, in the compute dtype
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [t, hidden] -> [t, vocab] logits, compute dtype
        return self.decoder(self.norm(self.dense(hidden)))


def take_masked_lm_head(
    state: dict[str, torch.Tensor],
    names: dict[str, str],  # checkpoint name -> MaskedLMHead name, the decoder's weight and bias aside
    decoder: str,  # the decoder's checkpoint prefix
    bias: str,  # the output bias's checkpoint name (transformers ties the decoder's bias to it)
    word_embeddings: torch.Tensor | None,  # the decoder's weight when tied; None: the checkpoint's own
) -> dict[str, torch.Tensor]:
    """Removes a masked LM head's tensors from `state`, under `lm_head.` and MaskedLMHead's names. A checkpoint
    may hold the tied weight and bias again under the decoder's name (older transformers saved them); the copy is
    dropped."""
    head = {f"lm_head.{name}": tensor for name, tensor in take_head_weights(state, names).items()}
    decoder_weight, decoder_bias = state.pop(f"{decoder}.weight", None), state.pop(f"{decoder}.bias", None)
    output_bias = state.pop(bias, decoder_bias)
    weight = word_embeddings if word_embeddings is not None else decoder_weight
    for name, tensor in ((f"{decoder}.weight", weight), (bias, output_bias)):
        if tensor is None:
            raise ValueError(f"missing weight: {name}")
    return {**head, "lm_head.decoder.weight": weight, "lm_head.decoder.bias": output_bias}
