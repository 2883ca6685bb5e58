"""The packed batch, the one representation of sequences on every hop: packed from token ids once (by the
gateway, or `bouquet embed`), cut into chunks by token budget, sent over gRPC as its own bytes, queued by the
replica and sliced into engine steps. numpy only, so the gateway can use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np


@dataclass(frozen=True)
class RowOptions:
    """How a request's rows are finished, the same for all its sequences (what the wire sends as scalars)."""

    dimensions: int = 0  # 0 keeps the full width
    normalize: bool = True
    prompt_tokens: int = 0  # leading tokens of each sequence that are the prompt's


@dataclass(frozen=True)
class Batch:
    """Packed, padding-free sequences: sequence i is input_ids[cu_seqlens[i]:cu_seqlens[i + 1]].

    `dimensions[i]` truncates row i (0 keeps all; Matryoshka models), `normalize[i]` L2-normalises it,
    `prompt_lens[i]` counts sequence i's leading prompt tokens (pooled or not as the model's Pooling says).
    The arrays may be views of another batch's, or of a message's bytes: nothing writes to them.
    """

    input_ids: np.ndarray  # [T] int32
    cu_seqlens: np.ndarray  # [B + 1] int32
    dimensions: np.ndarray  # [B] int32
    normalize: np.ndarray  # [B] bool
    prompt_lens: np.ndarray  # [B] int32
    token_type_ids: np.ndarray | None = None  # [T] int32, BERT only; zeros when absent

    @classmethod
    def pack(
        cls,
        sequences: Sequence[Sequence[int]],
        options: RowOptions = RowOptions(),
        token_type_ids: Sequence[Sequence[int]] | None = None,
    ) -> Batch:
        """The one place sequences of token ids are laid end to end."""
        lengths = np.fromiter(map(len, sequences), dtype=np.int32, count=len(sequences))
        cu_seqlens = np.zeros(len(sequences) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        types = None if token_type_ids is None else _flatten(token_type_ids, int(cu_seqlens[-1]))
        return cls.from_packed(_flatten(sequences, int(cu_seqlens[-1])), cu_seqlens, options, types)

    @classmethod
    def from_packed(
        cls,
        input_ids: np.ndarray,  # [T] int32
        cu_seqlens: np.ndarray,  # [B + 1] int32
        options: RowOptions = RowOptions(),
        token_type_ids: np.ndarray | None = None,  # [T] int32
    ) -> Batch:
        """Arrays already packed, every sequence finished by `options`."""
        num_seqs = len(cu_seqlens) - 1
        return cls(
            input_ids=np.asarray(input_ids, dtype=np.int32),
            cu_seqlens=np.asarray(cu_seqlens, dtype=np.int32),
            dimensions=np.full(num_seqs, options.dimensions, dtype=np.int32),
            normalize=np.full(num_seqs, options.normalize, dtype=bool),
            prompt_lens=np.full(num_seqs, options.prompt_tokens, dtype=np.int32),
            token_type_ids=None if token_type_ids is None else np.asarray(token_type_ids, dtype=np.int32),
        )

    @property
    def num_seqs(self) -> int:
        return len(self.cu_seqlens) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def seq_lens(self) -> np.ndarray:  # [B] int32
        return np.diff(self.cu_seqlens)

    def options(self) -> RowOptions:
        """The options all its sequences share; a batch mixing several has none to send as one request."""
        options = RowOptions(int(self.dimensions[0]), bool(self.normalize[0]), int(self.prompt_lens[0]))
        mixed = (self.dimensions != options.dimensions).any() or (self.normalize != options.normalize).any()
        if mixed or (self.prompt_lens != options.prompt_tokens).any():
            raise ValueError("the batch's sequences differ in dimensions, normalize or prompt_lens")
        return options

    def width(self, full: int) -> int:
        """The widest of its rows, where dimensions 0 means the model's `full` width."""
        return int(np.where(self.dimensions > 0, self.dimensions, full).max(initial=0))

    def slice(self, start: int, stop: int) -> Batch:
        """Sequences [start, stop) as a batch of their own (views of these arrays, but for cu_seqlens)."""
        if start == 0 and stop == self.num_seqs:
            return self
        first, last = int(self.cu_seqlens[start]), int(self.cu_seqlens[stop])
        return Batch(
            input_ids=self.input_ids[first:last],
            cu_seqlens=self.cu_seqlens[start : stop + 1] - first,
            dimensions=self.dimensions[start:stop],
            normalize=self.normalize[start:stop],
            prompt_lens=self.prompt_lens[start:stop],
            token_type_ids=None if self.token_type_ids is None else self.token_type_ids[first:last],
        )

    @staticmethod
    def concat(batches: Sequence[Batch]) -> Batch:
        """The batches' sequences end to end, each keeping its options; token types are zeros where absent."""
        if len(batches) == 1:
            return batches[0]
        offsets = np.cumsum([0, *(batch.num_tokens for batch in batches[:-1])])
        ends = [batch.cu_seqlens[1:] + offset for batch, offset in zip(batches, offsets, strict=True)]
        token_type_ids = None
        if any(batch.token_type_ids is not None for batch in batches):
            token_type_ids = np.concatenate([_token_types(batch) for batch in batches])
        return Batch(
            input_ids=np.concatenate([batch.input_ids for batch in batches]),
            cu_seqlens=np.concatenate([np.zeros(1, np.int32), *ends], dtype=np.int32),
            dimensions=np.concatenate([batch.dimensions for batch in batches]),
            normalize=np.concatenate([batch.normalize for batch in batches]),
            prompt_lens=np.concatenate([batch.prompt_lens for batch in batches]),
            token_type_ids=token_type_ids,
        )


def _flatten(sequences: Sequence[Sequence[int]], count: int) -> np.ndarray:  # [count] int32
    return np.fromiter(chain.from_iterable(sequences), dtype=np.int32, count=count)


def _token_types(batch: Batch) -> np.ndarray:  # [T] int32
    return np.zeros(batch.num_tokens, np.int32) if batch.token_type_ids is None else batch.token_type_ids


def count_within_budget(cu_seqlens: np.ndarray, first: int, max_tokens: float, max_seqs: int | None = None) -> int:
    """How many sequences from `first` on, in order, fit together in `max_tokens` tokens (and `max_seqs`
    sequences); 0 when sequence `first` alone is over the budget."""
    ends = cu_seqlens[first + 1 :]
    count = int(np.searchsorted(ends, int(cu_seqlens[first]) + max_tokens, side="right"))
    return count if max_seqs is None else max(0, min(count, max_seqs))


def token_budget_runs(cu_seqlens: np.ndarray, max_tokens: float, max_seqs: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive sequences covering them all in order, each as long as the budget
    allows: at most `max_tokens` tokens and `max_seqs` sequences; a sequence over the budget is a run alone."""
    num_seqs = len(cu_seqlens) - 1
    runs: list[tuple[int, int]] = []
    start = 0
    while start < num_seqs:
        stop = start + max(1, count_within_budget(cu_seqlens, start, max_tokens, max_seqs))
        runs.append((start, stop))
        start = stop
    return runs
