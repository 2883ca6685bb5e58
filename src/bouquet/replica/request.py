"""A request as the scheduler holds it, the wire's request decoded and checked, and the errors it can meet.

The engine validates nothing, so everything that could crash a forward or read outside a table is checked
here, once, as a message comes off the wire and before it joins the queue; a bad request then fails alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.proto import embedding_pb2

if TYPE_CHECKING:
    from bouquet.replica.scheduler import StepEngine


class InvalidInput(ValueError):
    """The request can never succeed as sent (INVALID_ARGUMENT)."""


class QueueFull(Exception):
    """The queue has no room for the request's tokens now (RESOURCE_EXHAUSTED); a retry may succeed."""


class DeadlineExpired(Exception):
    """The caller's deadline passed before the request's work was computed (DEADLINE_EXCEEDED)."""


class Unavailable(Exception):
    """The replica is loading its model or shutting down (UNAVAILABLE); another replica may serve it."""


@dataclass(frozen=True)
class Limits:
    """What the model accepts; taken from the engine once."""

    vocab_size: int
    type_vocab_size: int  # 1 for models without token types: only zeros are accepted
    max_seq_length: int
    dimension: int  # a row's full width

    @classmethod
    def from_engine(cls, engine: StepEngine) -> Limits:
        return cls(
            vocab_size=engine.spec.vocab_size,
            type_vocab_size=int(engine.spec.hf_config.get("type_vocab_size", 1)),
            max_seq_length=engine.max_seq_length,
            dimension=engine.dimension,
        )


def decode_request(message: embedding_pb2.EmbedRequest, limits: Limits) -> Batch:
    """The message's batch, its arrays read in place from the bytes; InvalidInput names the first problem."""
    input_ids = _int32s("input_ids", message.input_ids)
    cu_seqlens = _int32s("cu_seqlens", message.cu_seqlens)
    token_type_ids = _int32s("token_type_ids", message.token_type_ids) if message.token_type_ids else None
    options = RowOptions(message.dimensions, message.normalize, message.prompt_tokens)
    _validate(limits, input_ids, cu_seqlens, token_type_ids, options.dimensions)
    return Batch.from_packed(input_ids, cu_seqlens, options, token_type_ids)


def _int32s(name: str, data: bytes) -> np.ndarray:  # [len(data) // 4] int32, read-only
    if len(data) % 4:
        raise InvalidInput(f"{name} has {len(data)} bytes, not a whole number of 4-byte little-endian int32s")
    return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)  # a copy only on big-endian hosts


def _validate(
    limits: Limits, input_ids: np.ndarray, cu_seqlens: np.ndarray, token_type_ids: np.ndarray | None, dimensions: int
) -> None:
    """Raises InvalidInput naming the first problem; returns quietly when the engine can take the request."""
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != len(input_ids):
        raise InvalidInput(
            f"cu_seqlens must start at 0, end at len(input_ids)={len(input_ids)} and hold at least one sequence"
        )
    seq_lens = np.diff(cu_seqlens)
    if seq_lens.min() < 1:
        raise InvalidInput(f"sequence {int(np.argmin(seq_lens))} is empty (cu_seqlens must strictly increase)")
    if seq_lens.max() > limits.max_seq_length:
        index = int(np.argmax(seq_lens))
        raise InvalidInput(
            f"sequence {index} has {int(seq_lens[index])} tokens; this model takes at most {limits.max_seq_length}"
        )
    _check_range("input_ids", input_ids, limits.vocab_size)
    if token_type_ids is not None:
        if len(token_type_ids) != len(input_ids):
            raise InvalidInput(f"token_type_ids has {len(token_type_ids)} values for {len(input_ids)} input_ids")
        _check_range("token_type_ids", token_type_ids, limits.type_vocab_size)
    if not 0 <= dimensions <= limits.dimension:
        raise InvalidInput(f"dimensions must be in [0, {limits.dimension}] (0 keeps all), got {dimensions}")


def _check_range(name: str, values: np.ndarray, size: int) -> None:
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= size:
        bad = low if low < 0 else high
        raise InvalidInput(f"{name} holds {bad}, outside [0, {size})")


@dataclass(eq=False)
class Request:
    """A batch waiting for its rows; the scheduler moves `next_seq` forward as it cuts steps from it."""

    batch: Batch
    deadline: float | None  # event-loop time
    future: asyncio.Future[np.ndarray]
    rows: np.ndarray  # [B, width] float32, filled as steps finish
    on_rows: Callable[[int], None] | None = None  # told how many rows each step hands out, on the event loop
    next_seq: int = 0  # first sequence not yet in a step
    rows_left: int = 0  # sequences whose rows have not come back

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def queued_tokens(self) -> int:
        return self.batch.num_tokens - int(self.batch.cu_seqlens[self.next_seq])

    @property
    def queued_seqs(self) -> int:
        return self.num_seqs - self.next_seq

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
