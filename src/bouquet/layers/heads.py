"""Heads that turn a pooled row into a cross-encoder's scores. Kept in float32 (plain nn.Linear, which the
engine leaves in float32): a [B, hidden] row is cheap, and the scores are what a reranker sorts by."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class ClassifierHead(nn.Module):
    """tanh(x @ W1.T + b1) @ W2.T + b2: BERT's pooler with its classifier, and RoBERTa's classification head."""

    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.out = nn.Linear(hidden_size, num_labels)
        self.num_labels = num_labels

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [B, hidden] float32 -> [B, num_labels] logits
        return self.out(torch.tanh(self.dense(rows)))


def num_labels(hf_config: dict[str, Any]) -> int:
    """transformers' rule: `num_labels`, else as many as `id2label` names, else 2."""
    if "num_labels" in hf_config:
        return int(hf_config["num_labels"])
    return len(hf_config.get("id2label") or {0: "", 1: ""})


def take_head_weights(state: dict[str, torch.Tensor], names: dict[str, str]) -> dict[str, torch.Tensor]:
    """Removes the head's tensors from `state` under the model's names (`names`: checkpoint name -> module name)."""
    missing = [name for name in names if name not in state]
    if missing:
        raise ValueError(f"missing weight: {missing[0]}")
    return {module_name: state.pop(name) for name, module_name in names.items()}
