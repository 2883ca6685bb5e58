"""A request as the scheduler holds it, the wire's request decoded and checked, and the errors it can meet.

The engine validates nothing, so everything that could crash a forward or read outside a table is checked
here, once, as a message comes off the wire and before it joins the queue; a bad request then fails alone.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np

from bouquet.batch import Batch, RowOptions
from bouquet.encodings import Encoding
from bouquet.proto import embedding_pb2
from bouquet.replica.patch_images import InvalidImages, PatchImageLimits, attach_patch_images, image_sequence_flags
from bouquet.sparse_rows import max_sparse_rows

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
    hidden_size: int = 0  # a raw span row's width (the model's token states); 0: as `dimension`
    mean_spans: bool = True  # whether span means can go through the model's head (one pooling method, embed task)
    sparse_dimension: int = 0  # a sparse row's width (the vocabulary's); 0: the model gives no sparse rows
    sparse_only: bool = False  # a SPLADE model: every row is sparse, a request must ask for sparse rows
    token_dimension: int = 0  # a multi-vector (ColBERT) token row's width; 0: the model gives none
    image_shape: tuple[int, ...] = ()  # (C, H, W) of the images the model takes; (): it takes none
    image_tokens: int = 0  # the tokens of one image; 0: the model takes no images
    patch_images: PatchImageLimits = field(
        default_factory=PatchImageLimits
    )  # images of any size inside token sequences (Qwen3-VL)
    # bge-m3's token-weight sparse head (sparse_linear.pt): the ids it never weights; None: the model has no such head
    unweighted_ids: tuple[int, ...] | None = None

    @classmethod
    def from_engine(cls, engine: StepEngine) -> Limits:
        return cls(
            vocab_size=engine.spec.vocab_size,
            type_vocab_size=int(engine.spec.hf_config.get("type_vocab_size", 1)),
            max_seq_length=engine.max_seq_length,
            dimension=engine.dimension,
            hidden_size=engine.spec.hidden_size,
            mean_spans=engine.task == "embed" and len(engine.pooling.methods) == 1,
            sparse_dimension=engine.sparse_dimension,
            sparse_only=engine.task == "sparse",
            token_dimension=getattr(engine, "token_dimension", 0),  # tests' stand-in engines may not say
            image_shape=tuple(getattr(engine, "image_shape", ())),
            image_tokens=getattr(engine, "image_tokens", 0),
            patch_images=PatchImageLimits(*getattr(engine, "image_patches", ())),
            unweighted_ids=getattr(engine, "unweighted_ids", None),
        )

    def full_width(
        self, raw_spans: bool, sparse: bool = False, token_vectors: bool = False, all_outputs: bool = False
    ) -> int:
        """The width of a row: a sparse row's is the vocabulary's, a raw span row's the model's hidden size, a token
        vector's the multi-vector projection's, any other's `dimension`; with all outputs, the widest of the pooled
        row and a span row with its weight."""
        if all_outputs:
            return max(self.dimension, 1 + self.full_width(raw_spans, token_vectors=token_vectors))
        if sparse:
            return self.sparse_dimension
        if token_vectors:
            return self.token_dimension
        return (self.hidden_size or self.dimension) if raw_spans else self.dimension


def decode_request(message: embedding_pb2.EmbedRequest, limits: Limits) -> Batch:
    """The message's batch, its arrays read in place from the bytes; InvalidInput names the first problem."""
    options = row_options(message, limits)
    if message.image_grid_thw or message.cu_images:
        return _decode_patch_images(message, limits, options)
    if message.pixel_values or message.image_shape:
        return _decode_images(message, limits, options)
    input_ids = _int32s("input_ids", message.input_ids)
    cu_seqlens = _int32s("cu_seqlens", message.cu_seqlens)
    token_type_ids = _int32s("token_type_ids", message.token_type_ids) if message.token_type_ids else None
    _validate_sparse(limits, options, message.cu_spans, len(cu_seqlens) - 1)
    _validate(limits, input_ids, cu_seqlens, token_type_ids)
    patches = limits.patch_images
    if patches.patch_dim and not patches.image_sequences and (input_ids == patches.image_token_id).any():
        raise InvalidInput("the image placeholder token comes only with images (image_grid_thw)")
    batch = Batch.from_packed(input_ids, cu_seqlens, options, token_type_ids)
    if message.key_lens:
        batch = replace(batch, key_lens=_key_lens(message.key_lens, batch.seq_lens))
    if not message.cu_spans:
        if message.span_bounds or options.raw_spans or options.token_vectors or message.maxsim or options.all_outputs:
            raise InvalidInput("span_bounds, raw_spans, token_vectors, maxsim and all_outputs need cu_spans")
        return batch
    cu_spans = _int32s("cu_spans", message.cu_spans)
    span_bounds = _int32s("span_bounds", message.span_bounds)
    _validate_spans(limits, batch.seq_lens, cu_spans, span_bounds, options.raw_spans, options.token_vectors)
    if options.all_outputs:
        _validate_all_outputs(limits, options, span_bounds.reshape(-1, 2), message.maxsim)
    if message.maxsim:
        _validate_maxsim(options, cu_spans)
    return batch.with_spans(cu_spans, span_bounds.reshape(-1, 2), options.raw_spans, options.token_vectors)


def row_options(message: embedding_pb2.EmbedRequest, limits: Limits) -> RowOptions:
    """The message's row options (replica/client.py's `wire_options` writes them), the encoding known and
    `dimensions` within the width of the rows asked for: the one place they are read off the wire."""
    options = RowOptions(
        message.dimensions or None,
        message.normalize,
        message.prompt_tokens,
        raw_spans=message.raw_spans,
        encoding=_encoding(message.encoding),
        sparse=message.sparse,
        token_vectors=message.token_vectors,
        all_outputs=message.all_outputs,
    )
    width = limits.full_width(options.raw_spans, token_vectors=options.token_vectors)
    if (options.dimensions or 0) > width:
        raise InvalidInput(f"dimensions must be in [0, {width}] (0 keeps all), got {options.dimensions}")
    return options


def _validate_maxsim(options: RowOptions, cu_spans: np.ndarray) -> None:
    """MaxSim scores a query's token vectors (sequence 0) against each later sequence's, all at full width in
    float32: every sequence needs a vector."""
    if not options.token_vectors or options.dimensions or options.encoding is not Encoding.FLOAT32:
        raise InvalidInput("maxsim needs token_vectors, dimensions 0 and encoding FLOAT32")
    if len(cu_spans) < 3:
        raise InvalidInput("maxsim needs a query and at least one document: two sequences or more")
    empty = np.diff(cu_spans) == 0
    if empty.any():
        raise InvalidInput(f"maxsim: sequence {int(np.argmax(empty))} has no token vectors (spans)")


def _validate_all_outputs(limits: Limits, options: RowOptions, bounds: np.ndarray, maxsim: bool) -> None:
    """All outputs come from a model with a token-weight sparse head, at full width in float32, over spans of one
    token each (a span's weight is its token's); scored (maxsim), with the token vectors."""
    if limits.unweighted_ids is None:
        raise InvalidInput("all_outputs: this model has no token-weight sparse head (bge-m3's sparse_linear.pt)")
    if options.dimensions or options.encoding is not Encoding.FLOAT32 or options.sparse or options.raw_spans:
        raise InvalidInput("all_outputs come at full width in float32: no dimensions, encoding, sparse or raw_spans")
    if (bounds[:, 1] - bounds[:, 0] != 1).any():
        raise InvalidInput("all_outputs: every span is one token (its weight and vector are that token's)")
    if maxsim and not options.token_vectors:
        raise InvalidInput("all_outputs with maxsim scores token vectors too: set token_vectors")


def _key_lens(data: bytes, seq_lens: np.ndarray) -> np.ndarray:  # [B] int32
    key_lens = _int32s("key_lens", data)
    if len(key_lens) != len(seq_lens):
        raise InvalidInput(f"key_lens has {len(key_lens)} values for {len(seq_lens)} sequences")
    bad = (key_lens < 1) | (key_lens > seq_lens)
    if bad.any():
        index = int(np.argmax(bad))
        raise InvalidInput(
            f"key_lens[{index}] is {int(key_lens[index])}: a sequence's keys are 1 to its {int(seq_lens[index])} tokens"
        )
    return key_lens


def _validate_sparse(limits: Limits, options: RowOptions, cu_spans: bytes, num_seqs: int) -> None:
    """A sparse request goes to a model with a sparse head, takes its rows whole as float32 pairs and has no spans;
    a SPLADE model gives nothing else."""
    if not options.sparse:
        if limits.sparse_only:
            raise InvalidInput("this model (SPLADE) gives sparse rows only: ask with sparse=true")
        return
    if not limits.sparse_dimension:
        raise InvalidInput("this model has no sparse head (SPLADE, or bge-m3's sparse_linear.pt): no sparse rows")
    if options.dimensions or options.encoding is not Encoding.FLOAT32 or cu_spans or options.normalize:
        raise InvalidInput(
            "sparse rows come whole as float32 pairs, one a sequence: no dimensions, normalize, encoding or spans"
        )
    most = max_sparse_rows(limits.sparse_dimension)
    if num_seqs > most:
        raise InvalidInput(f"{num_seqs} sparse rows in one request; at most {most} of this vocabulary's width")


def _encoding(number: int) -> Encoding:
    try:
        return Encoding(number)
    except ValueError:
        known = ", ".join(f"{encoding.name} ({encoding.value})" for encoding in Encoding)
        raise InvalidInput(f"encoding {number} is not one this replica knows: {known}") from None


def _int32s(name: str, data: bytes) -> np.ndarray:  # [len(data) // 4] int32, read-only
    if len(data) % 4:
        raise InvalidInput(f"{name} has {len(data)} bytes, not a whole number of 4-byte little-endian int32s")
    return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)  # a copy only on big-endian hosts


def _decode_patch_images(message: embedding_pb2.EmbedRequest, limits: Limits, options: RowOptions) -> Batch:
    """Token sequences holding images of any size (replica/patch_images.py)."""
    if message.token_type_ids or message.cu_spans or message.span_bounds or message.key_lens or message.maxsim:
        raise InvalidInput("a request with image_grid_thw sends no token_type_ids, spans, key_lens or maxsim")
    if options.sparse or options.raw_spans or options.token_vectors or options.all_outputs:
        raise InvalidInput("a request with image_grid_thw asks for no sparse rows, spans or all_outputs")
    input_ids = _int32s("input_ids", message.input_ids)
    cu_seqlens = _int32s("cu_seqlens", message.cu_seqlens)
    images = None  # an image's own sequence is bounded by its patches (attach_patch_images), not the text limit
    if limits.patch_images.image_sequences:
        images = image_sequence_flags(message.cu_images, len(cu_seqlens) - 1)
    _validate(limits, input_ids, cu_seqlens, None, images)
    try:
        return attach_patch_images(Batch.from_packed(input_ids, cu_seqlens, options), message, limits.patch_images)
    except InvalidImages as error:
        raise InvalidInput(str(error)) from None


def _decode_images(message: embedding_pb2.EmbedRequest, limits: Limits, options: RowOptions) -> Batch:
    """An image request's batch: its images, each laid out as the model's `image_tokens` tokens."""
    if not limits.image_tokens:
        raise InvalidInput("this model takes no images")
    texts = [message.input_ids, message.cu_seqlens, message.token_type_ids, message.cu_spans, message.span_bounds]
    if any(texts) or message.key_lens or message.maxsim or options.sparse or options.raw_spans or options.token_vectors:
        raise InvalidInput("an image request sends pixel_values and image_shape: no token ids, spans, key_lens, "
                           "sparse, token_vectors or maxsim")  # fmt: skip
    shape = tuple(message.image_shape)
    if shape != limits.image_shape:
        raise InvalidInput(f"image_shape {list(shape)}; this model takes images of shape {list(limits.image_shape)}")
    image_bytes = 4 * int(np.prod(shape))
    if not message.pixel_values or len(message.pixel_values) % image_bytes:
        raise InvalidInput(
            f"pixel_values has {len(message.pixel_values)} bytes, not a whole number of float32 images of shape "
            f"{list(shape)} ({image_bytes} bytes each)"
        )
    pixels = np.frombuffer(message.pixel_values, "<f4").reshape(-1, *shape)
    return Batch.pack_images(pixels, limits.image_tokens, options)


def _validate(
    limits: Limits,
    input_ids: np.ndarray,
    cu_seqlens: np.ndarray,
    token_type_ids: np.ndarray | None,
    images: np.ndarray | None = None,  # [B] bool: the sequences that are images, exempt from the text limit
) -> None:
    """Raises InvalidInput naming the first problem; returns quietly when the engine can take the request."""
    if len(cu_seqlens) < 2 or cu_seqlens[0] != 0 or cu_seqlens[-1] != len(input_ids):
        raise InvalidInput(
            f"cu_seqlens must start at 0, end at len(input_ids)={len(input_ids)} and hold at least one sequence"
        )
    seq_lens = np.diff(cu_seqlens)
    if seq_lens.min() < 1:
        raise InvalidInput(f"sequence {int(np.argmin(seq_lens))} is empty (cu_seqlens must strictly increase)")
    texts = seq_lens if images is None else np.where(images, 0, seq_lens)
    if texts.max() > limits.max_seq_length:
        index = int(np.argmax(texts))
        raise InvalidInput(
            f"sequence {index} has {int(seq_lens[index])} tokens; this model takes at most {limits.max_seq_length}"
        )
    _check_range("input_ids", input_ids, limits.vocab_size)
    if token_type_ids is not None:
        if len(token_type_ids) != len(input_ids):
            raise InvalidInput(f"token_type_ids has {len(token_type_ids)} values for {len(input_ids)} input_ids")
        _check_range("token_type_ids", token_type_ids, limits.type_vocab_size)


def _validate_spans(
    limits: Limits, seq_lens: np.ndarray, cu_spans: np.ndarray, span_bounds: np.ndarray, raw: bool,
    token_vectors: bool = False,
) -> None:  # fmt: skip
    """Spans in any order, overlapping or not; each within its sequence and not empty; at most one span per token
    of its sequence (which bounds the rows a request can ask for)."""
    if len(cu_spans) != len(seq_lens) + 1 or cu_spans[0] != 0 or int(cu_spans[-1]) * 2 != len(span_bounds):
        raise InvalidInput(
            f"cu_spans must hold {len(seq_lens) + 1} values from 0 to the number of (start, end) pairs in "
            f"span_bounds ({len(span_bounds) / 2:g})"
        )
    counts = np.diff(cu_spans)
    if counts.min() < 0:
        raise InvalidInput(f"cu_spans decreases at sequence {int(np.argmin(counts))}")
    if (counts > seq_lens).any():
        index = int(np.argmax(counts > seq_lens))
        raise InvalidInput(
            f"sequence {index} has {int(counts[index])} spans, more than its {int(seq_lens[index])} tokens"
        )
    if raw and counts.min() == 0:
        raise InvalidInput(f"raw_spans: sequence {int(np.argmin(counts))} has no spans")
    if token_vectors and (raw or not limits.token_dimension):
        why = "not with raw_spans" if raw else "this model has no multi-vector (ColBERT) projection"
        raise InvalidInput(f"token_vectors: {why}")
    if not raw and not token_vectors and not limits.mean_spans:
        raise InvalidInput("this model's rows cannot be pooled over spans (it pools by several methods, or scores)")
    bounds = span_bounds.reshape(-1, 2)
    ends = np.repeat(seq_lens, counts)
    bad = (bounds[:, 0] < 0) | (bounds[:, 0] >= bounds[:, 1]) | (bounds[:, 1] > ends)
    if bad.any():
        index = int(np.argmax(bad))
        start, end = (int(v) for v in bounds[index])
        raise InvalidInput(f"span {index} is [{start}, {end}): spans need 0 <= start < end <= its sequence's length")


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
    rows: np.ndarray  # [rows, width] float32, filled as steps finish
    on_rows: Callable[[int], None] | None = None  # told how many rows each step hands out, on the event loop
    next_seq: int = 0  # first sequence not yet in a step
    rows_left: int = 0  # rows that have not come back (one per sequence, or per span of a sequence with spans)

    @property
    def num_seqs(self) -> int:
        return self.batch.num_seqs

    @property
    def queued_tokens(self) -> int:  # in the budget's units (Batch.cu_budget)
        cu_budget = self.batch.cu_budget
        return int(cu_budget[-1] - cu_budget[self.next_seq])

    @property
    def queued_seqs(self) -> int:
        return self.num_seqs - self.next_seq

    def expired(self, now: float) -> bool:
        return self.deadline is not None and now >= self.deadline
