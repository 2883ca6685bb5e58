"""Helpers models use to turn a checkpoint's tensors into their own parameter layout."""

from __future__ import annotations

import re

import torch


def strip_prefixes(state: dict[str, torch.Tensor], prefixes: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Drops a wrapper's prefix ("bert.", "model.") so bare and wrapped checkpoints load the same."""
    stripped = {}
    for name, tensor in state.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                name = name[len(prefix) :]
                break
        stripped[name] = tensor
    return stripped


def drop_ignored(state: dict[str, torch.Tensor], ignored: re.Pattern[str]) -> dict[str, torch.Tensor]:
    """Removes tensors an embedding model never uses (a classifier pooler, an LM head, index buffers)."""
    return {name: tensor for name, tensor in state.items() if not ignored.fullmatch(name)}


def scalar(state: dict[str, torch.Tensor], name: str) -> float | None:
    """A one-value tensor of the checkpoint as a float (kept out of the model's dtype); None when it has none."""
    tensor = state.get(name)
    return None if tensor is None else float(tensor.float().reshape(()))


def fuse(state: dict[str, torch.Tensor], fused_name: str, part_names: list[str]) -> None:
    """Concatenates parts (q, k, v projections) along the output dimension into one parameter, in place."""
    missing = [name for name in part_names if name not in state]
    if missing:
        raise ValueError(f"missing weight: {missing[0]}")
    state[fused_name] = torch.cat([state.pop(name) for name in part_names], dim=0)
