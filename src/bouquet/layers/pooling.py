"""Pooling: a method (CLS, MEAN, LAST) that turns token states into one row per sequence, then a head that
truncates each row to its requested dimensions and L2-normalises it when asked."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from bouquet.model_dir import PoolingMethod


# Zero-length sequences (CUDA-graph padding slots) start at T and end before 0: the clamps keep their
# indices in bounds; their rows are dropped afterwards. Clamping a [B] index costs nothing measurable.
def pool_cls(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return hidden[cu_seqlens[:-1].long().clamp(max=hidden.shape[0] - 1)].float()


def pool_last(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    return hidden[(cu_seqlens[1:].long() - 1).clamp(min=0)].float()


def pool_mean(hidden: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    # Sums accumulate in float32 whatever the activations' dtype.
    seq_lens = cu_seqlens.diff()
    # output_size: without it repeat_interleave reads the total back from the device, which a graph forbids.
    seq_ids = torch.repeat_interleave(
        torch.arange(len(seq_lens), device=hidden.device), seq_lens, output_size=hidden.shape[0]
    )
    sums = hidden.new_zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, seq_ids, hidden.float())
    return sums / seq_lens.clamp(min=1).unsqueeze(1).float()


POOLING_METHODS: dict[PoolingMethod, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    PoolingMethod.CLS: pool_cls,
    PoolingMethod.MEAN: pool_mean,
    PoolingMethod.LAST: pool_last,
}


def embedding_head(
    pooled: torch.Tensor,  # [B, D] float32
    dimensions: torch.Tensor,  # [B] int, 0 keeps all D
    normalize: torch.Tensor,  # [B] bool
) -> torch.Tensor:  # [B, D] float32; row i is zero beyond dimensions[i]
    width = pooled.shape[1]
    keep = torch.where(dimensions > 0, dimensions, width)
    columns = torch.arange(width, device=pooled.device)
    truncated = pooled * (columns[None, :] < keep[:, None])
    normalized = F.normalize(truncated, p=2.0, dim=1)
    return torch.where(normalize[:, None], normalized, truncated)


def pool(
    method: PoolingMethod,
    hidden: torch.Tensor,  # [T, D]
    cu_seqlens: torch.Tensor,  # [B + 1]
    dimensions: torch.Tensor,
    normalize: torch.Tensor,
) -> torch.Tensor:  # [B, D] float32
    return embedding_head(POOLING_METHODS[method](hidden, cu_seqlens), dimensions, normalize)


def pool_eager(
    method: PoolingMethod,
    hidden: torch.Tensor,  # [T, D]
    cu_seqlens: torch.Tensor,  # [B + 1]
    dimensions: np.ndarray,  # [B] int, on the host
    normalize: np.ndarray,  # [B] bool, on the host
) -> torch.Tensor:  # [B, D] float32, the rows `pool` gives
    """`pool` for the eager path, where nothing is captured and the batch's options are on the host: a lone
    sequence is mean-pooled in one op, and the head truncates or normalises only when some row asks for it.
    Ops are what a short step pays for here: run after a forward, each dispatch starts from cold caches, and
    the general pooling cost a lone query 0.3 ms of its 5-6 ms step (docs/benchmarks.md)."""
    if method is PoolingMethod.MEAN and len(cu_seqlens) == 2 and hidden.shape[0] > 0:
        pooled = hidden.float().mean(0, keepdim=True)
    else:
        pooled = POOLING_METHODS[method](hidden, cu_seqlens)
    if not dimensions.any():
        if normalize.all():
            return F.normalize(pooled, p=2.0, dim=1)
        if not normalize.any():
            return pooled
    as_tensor = partial(torch.as_tensor, device=pooled.device)
    return embedding_head(pooled, as_tensor(dimensions.astype(np.int32)), as_tensor(normalize.astype(bool)))
