"""Batch metadata for one forward pass, set by the engine around the model and read only by attention.

A leaf: it imports nothing of bouquet, so layers, backends and the engine can all use it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    cu_seqlens: torch.Tensor  # [B + 1] int32
    max_seqlen: int
    seq_lens: list[int]  # host copy, so backends can plan without a device sync
    attn_metadata: Any = None  # what the attention backend prepared once, shared by all layers
    # Per sequence, how many leading tokens are keys; the later ones attend but are never attended to (ColBERT's
    # query expansion). None: every token is a key.
    key_lens: list[int] | None = None
    backend: Any = None  # the backend for this forward when it is not the one bound to the layers (key_lens)
    # (layers, hidden) -> hidden: runs a model's stack of layers where a CPU graph may replay it (layer_stack.py);
    # None: the layers run one after another.
    layer_graphs: Any = None


# Per thread, so two engines (or a test beside an engine) never see each other's batch.
_local = threading.local()


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    previous = getattr(_local, "ctx", None)
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous


def get_forward_context() -> ForwardContext:
    ctx = getattr(_local, "ctx", None)
    assert ctx is not None, "attention ran outside `with forward_context(...)`"
    return ctx
