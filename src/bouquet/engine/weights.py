"""Reading checkpoint files and loading them into a model with every mismatch named."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn


def read_checkpoint(files: tuple[Path, ...]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for path in files:
        if path.suffix == ".safetensors":
            state.update(load_file(str(path)))
        else:
            state.update(torch.load(path, map_location="cpu", weights_only=True))
    return state


def load_checked(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copies `state` into the model's parameters; any unused, missing or mis-shaped weight is an error."""
    params = dict(model.named_parameters())
    unused = sorted(set(state) - set(params))
    if unused:
        raise ValueError(f"unused weight in checkpoint: {unused[0]} ({len(unused)} unused in all)")
    missing = sorted(set(params) - set(state))
    if missing:
        raise ValueError(f"missing weight: {missing[0]} ({len(missing)} missing in all)")
    for name, param in params.items():
        tensor = state[name]
        if tensor.shape != param.shape:
            raise ValueError(f"weight {name} has shape {tuple(tensor.shape)}, the config implies {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(tensor)
