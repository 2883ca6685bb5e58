"""A model's stack of layers, each taking and returning the hidden states: run one after another, or replayed as
the kernel calls a CPU graph recorded for the step's shape (engine/cpu_graphs.py) where the engine holds one."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from bouquet.layers.context import get_forward_context


def run_layers(layers: Iterable[nn.Module], hidden: torch.Tensor) -> torch.Tensor:  # [T, D] -> [T, D]
    graphs = get_forward_context().layer_graphs
    return run_eagerly(layers, hidden) if graphs is None else graphs(layers, hidden)


def run_eagerly(layers: Iterable[nn.Module], hidden: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        hidden = layer(hidden)
    return hidden
