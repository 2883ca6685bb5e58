"""The unit of work the engine computes: packed sequences plus how each one's embedding is finished."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Batch:
    """Packed, padding-free sequences: sequence i is input_ids[cu_seqlens[i]:cu_seqlens[i + 1]].

    `dimensions[i]` truncates row i (0 keeps all; Matryoshka models), `normalize[i]` L2-normalises it,
    `prompt_lens[i]` counts sequence i's leading prompt tokens (pooled or not as the model's Pooling says).
    """

    input_ids: np.ndarray  # [T] int32
    cu_seqlens: np.ndarray  # [B + 1] int32
    dimensions: np.ndarray  # [B] int32
    normalize: np.ndarray  # [B] bool
    prompt_lens: np.ndarray  # [B] int32
    token_type_ids: np.ndarray | None = None  # [T] int32, BERT only; zeros when absent

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def max_seqlen(self) -> int:
        return int(np.diff(self.cu_seqlens).max(initial=0))

    @classmethod
    def from_packed(
        cls,
        input_ids: np.ndarray,
        cu_seqlens: np.ndarray,
        normalize: bool = True,
        dimensions: int = 0,
        prompt_tokens: int = 0,
    ) -> Batch:
        num_seqs = len(cu_seqlens) - 1
        return cls(
            input_ids=np.asarray(input_ids, dtype=np.int32),
            cu_seqlens=np.asarray(cu_seqlens, dtype=np.int32),
            dimensions=np.full(num_seqs, dimensions, dtype=np.int32),
            normalize=np.full(num_seqs, normalize, dtype=bool),
            prompt_lens=np.full(num_seqs, prompt_tokens, dtype=np.int32),
        )
