"""A packed batch as the model takes it: device tensors of ids, positions within each sequence, and what
pooling and attention read. One preparation for every device; CUDA graphs load the same fields into their
static buffers (cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bouquet.batch import Batch
from bouquet.layers.context import ForwardContext


@dataclass
class ModelInputs:
    """Device tensors for one forward; for a graph, views of the static buffers at fixed addresses."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    token_type_ids: torch.Tensor | None  # [T] int64
    cu_seqlens: torch.Tensor  # [B + 1] int32
    dimensions: torch.Tensor  # [B] int32
    normalize: torch.Tensor  # [B] bool
    prompt_lens: torch.Tensor  # [B] int32
    seq_lens: list[int]  # host copy
    max_seqlen: int

    def context(self) -> ForwardContext:
        return ForwardContext(self.cu_seqlens, self.max_seqlen, self.seq_lens)


def padded_positions(batch: Batch, num_real_tokens: int) -> np.ndarray:  # [T] int64
    """Positions within each sequence; pad tokens get 0, so a long pad sequence never exceeds a model's limit."""
    seq_lens = np.diff(batch.cu_seqlens)
    positions = np.arange(batch.num_tokens) - np.repeat(batch.cu_seqlens[:-1], seq_lens)
    positions[num_real_tokens:] = 0
    return positions


def prepare_inputs(batch: Batch, device: torch.device) -> ModelInputs:
    """The eager path's inputs: the batch as it is, no buckets."""
    seq_lens = np.diff(batch.cu_seqlens)
    hosts = [batch.input_ids, padded_positions(batch, batch.num_tokens), batch.cu_seqlens]
    hosts += [batch.dimensions, batch.normalize, batch.prompt_lens]
    if batch.token_type_ids is not None:
        hosts.append(batch.token_type_ids)
    input_ids, positions, cu_seqlens, dimensions, normalize, prompt_lens, *token_types = upload(hosts, device)
    return ModelInputs(
        input_ids,
        positions,
        token_types[0] if token_types else None,
        cu_seqlens.int(),
        dimensions.int(),
        normalize.bool(),
        prompt_lens.int(),
        seq_lens.tolist(),
        int(seq_lens.max(initial=0)),
    )


def upload(arrays: list[np.ndarray], device: torch.device) -> list[torch.Tensor]:  # each [n] int64
    """The arrays on `device` as int64; on CUDA through one pinned buffer and one non-blocking copy.

    A copy from pageable memory may make the driver wait for the stream, which would hold the engine thread
    behind the step still in flight; the caching host allocator keeps the pinned block until the copy is done.
    """
    sizes = [len(a) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(np.asarray(a, dtype=np.int64)) for a in arrays]
    host = torch.empty(sum(sizes), dtype=torch.long, pin_memory=True)
    np.concatenate(arrays, out=host.numpy(), casting="unsafe")
    return list(host.to(device, non_blocking=True).split(sizes))
