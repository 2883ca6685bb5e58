"""The packed batch, the one representation of sequences on every hop: packed from token ids once (by the
gateway, or `bouquet embed`), cut into chunks by token budget, sent over gRPC as its own bytes, queued by the
replica and sliced into engine steps. numpy only, so the gateway can use it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain

import numpy as np

from bouquet.encodings import Encoding


@dataclass(frozen=True)
class RowOptions:
    """How a request's rows are finished, the same for all its sequences: the one form of these facts from the parsed
    request (an API router builds it) to the wire (`replica/client.embed_request` sends it as scalars) and back out
    of it (`replica/request.decode_request`). A batch's per-sequence arrays are filled from it when it is packed."""

    dimensions: int | None = None  # None keeps the full width (0 on the wire and in a batch's arrays)
    normalize: bool | None = True  # None: as the model's Normalize module says (the gateway resolves it before packing)
    prompt_tokens: int = 0  # leading tokens of each sequence that are the prompt's
    raw_spans: bool = False  # span rows are token states as the model outputs them: no Dense modules
    encoding: Encoding = Encoding.FLOAT32  # how the finished rows travel back (bouquet/encodings.py)
    sparse: bool = False  # each sequence's row is the model's sparse row (vocabulary wide), not its embedding
    token_vectors: bool = False  # span rows go through the model's multi-vector (ColBERT) projection, not Dense
    all_outputs: bool = False  # bge-m3's three outputs: the pooled row, then the span rows, each with its weight


@dataclass(frozen=True)
class Batch:
    """Packed, padding-free sequences: sequence i is input_ids[cu_seqlens[i]:cu_seqlens[i + 1]].

    `dimensions[i]` truncates row i (0 keeps all; Matryoshka models), `normalize[i]` L2-normalises it,
    `prompt_lens[i]` counts sequence i's leading prompt tokens (pooled or not as the model's Pooling says),
    `encodings[i]` is how row i travels back (an `Encoding`; the replica encodes, the engine never reads it).
    The arrays may be views of another batch's, or of a message's bytes: nothing writes to them.

    Spans (optional) pool several rows from one sequence: sequence i's spans are span_bounds[cu_spans[i]:
    cu_spans[i + 1]], each a (start, end) pair of token offsets within the sequence, pooled by the mean of its
    tokens. A sequence with spans gives one row per span, in order; one without gives one row, pooled as the
    model pools. `raw_spans[i]`: sequence i's span rows skip the model's Dense modules (token states).
    `token_vectors[i]`: sequence i's span rows go through the model's multi-vector projection instead (ColBERT's
    per-token vectors; docs/late-interaction.md).

    `all_outputs[i]` (bge-m3's three outputs from one forward): sequence i gives its pooled row first, then its span
    rows (spans of one token), each span row with its token's weight from the model's token-weight sparse head put
    before its values (`[weight, *values]`); docs/late-interaction.md.

    `key_lens[i]` (optional): only the first key_lens[i] tokens of sequence i are attended to; the tokens after
    them attend to those but no token attends to them (ColBERT's query expansion tokens, as PyLate and Stanford's
    ColBERT mask them). None: every token is a key.

    `pixel_values` (optional, [N, C, H, W]): fixed-size images (CLIP's, SigLIP's), one a sequence, as the model's
    processor left them; an image's sequence is its tokens (its patches and whatever the model adds), which
    `input_ids` only count (zeros). `cu_images` [B + 1] says which sequences they are (sequence i holds
    cu_images[i + 1] - cu_images[i] of them, 0 or 1): texts may share the step, each tower running on its own
    sequences (models/clip.py); a request is all texts or all images (`Batch.pack_images`).

    `image_grid_thw` (optional, with `pixel_values` and `cu_images`): images of any size inside token sequences
    (Qwen3-VL). `pixel_values` is then every image's patches end to end ([P, patch_dim], image j's are
    prod(image_grid_thw[j]) rows), sequence i's images are image_grid_thw[cu_images[i]:cu_images[i + 1]], and
    `input_ids` are real tokens with each image's placeholder tokens; its tokens and its images' patches (the
    vision tower's tokens) count in the budget (`cu_budget`); text-only sequences (no images) share such a batch.
    For a model whose images are sequences of their own (SigLIP 2: `Batch.pack_image_sequences`), an image's sequence
    is its patches, one token each, its `input_ids` zeros that only count them, and its only image (`image_sequences`
    set: the tokens are the vision tower's, so the budget counts them alone); texts share such a batch too.
    """

    input_ids: np.ndarray  # [T] int32
    cu_seqlens: np.ndarray  # [B + 1] int32
    dimensions: np.ndarray  # [B] int32
    normalize: np.ndarray  # [B] bool
    prompt_lens: np.ndarray  # [B] int32
    encodings: np.ndarray  # [B] uint8
    token_type_ids: np.ndarray | None = None  # [T] int32, BERT only; zeros when absent
    cu_spans: np.ndarray | None = None  # [B + 1] int32; None: no sequence has spans
    span_bounds: np.ndarray | None = None  # [S, 2] int32 (start, end) within the sequence; set with cu_spans
    raw_spans: np.ndarray | None = None  # [B] bool; set with cu_spans
    sparse: np.ndarray | None = None  # [B] bool; None: no sequence asks for its sparse row
    token_vectors: np.ndarray | None = None  # [B] bool; set with cu_spans
    key_lens: np.ndarray | None = None  # [B] int32, 1 <= key_lens[i] <= its length; None: every token is a key
    pixel_values: np.ndarray | None = None  # [B, C, H, W] float32; None: the sequences are token ids
    all_outputs: np.ndarray | None = None  # [B] bool; None: no sequence asks for them
    image_grid_thw: np.ndarray | None = None  # [N, 3] int32 (frames, rows, columns) in patches; set with cu_images
    cu_images: np.ndarray | None = None  # [B + 1] int32; set with pixel_values (each kind: the class docstring)
    image_sequences: bool = False  # with image_grid_thw: each image a sequence of its own (SigLIP 2)
    # the options every sequence shares, as packed (the arrays above are filled from them); None: a step mixing
    # requests, whose sequences each keep their own
    row_options: RowOptions | None = None

    @classmethod
    def pack(
        cls,
        sequences: Sequence[Sequence[int]],
        options: RowOptions = RowOptions(),
        token_type_ids: Sequence[Sequence[int]] | None = None,
        spans: Sequence[Sequence[tuple[int, int]]] | None = None,  # per sequence, (start, end) pairs; may be empty
        key_lens: Sequence[int] | None = None,
    ) -> Batch:
        """The one place sequences of token ids are laid end to end."""
        lengths = np.fromiter(map(len, sequences), dtype=np.int32, count=len(sequences))
        cu_seqlens = np.zeros(len(sequences) + 1, dtype=np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        types = None if token_type_ids is None else _flatten(token_type_ids, int(cu_seqlens[-1]))
        batch = cls.from_packed(_flatten(sequences, int(cu_seqlens[-1])), cu_seqlens, options, types)
        if key_lens is not None:
            batch = replace(batch, key_lens=np.asarray(key_lens, dtype=np.int32))
        if spans is None:
            return batch
        counts = np.fromiter(map(len, spans), dtype=np.int32, count=len(spans))
        cu_spans = np.concatenate([np.zeros(1, np.int32), np.cumsum(counts, dtype=np.int32)])
        bounds = np.array([bound for pairs in spans for bound in pairs], dtype=np.int32).reshape(-1, 2)
        return batch.with_spans(cu_spans, bounds, options.raw_spans, options.token_vectors)

    @classmethod
    def pack_images(cls, pixel_values: np.ndarray, tokens_per_image: int, options: RowOptions = RowOptions()) -> Batch:
        """Images ([N, C, H, W] float32, preprocessed) as N sequences of `tokens_per_image` tokens each (the
        model's: 1 + (H / patch)(W / patch) for CLIP)."""
        cu_seqlens = np.arange(len(pixel_values) + 1, dtype=np.int32) * tokens_per_image
        batch = cls.from_packed(np.zeros(int(cu_seqlens[-1]), np.int32), cu_seqlens, options)
        cu_images = np.arange(len(pixel_values) + 1, dtype=np.int32)  # every sequence one image
        return replace(batch, pixel_values=np.asarray(pixel_values, dtype=np.float32), cu_images=cu_images)

    @classmethod
    def pack_image_sequences(
        cls, pixel_values: np.ndarray, grids: np.ndarray, options: RowOptions = RowOptions()
    ) -> Batch:
        """Images of any size as patches, each a sequence of its own (SigLIP 2): `pixel_values` [P, patch_dim]
        float32, image after image, `grids` [N, 3] each image's (1, rows, columns) in patches."""
        grids = np.asarray(grids, dtype=np.int32).reshape(-1, 3)
        cu_seqlens = np.concatenate([np.zeros(1, np.int32), np.cumsum(grids.prod(1), dtype=np.int32)])
        batch = cls.from_packed(np.zeros(int(cu_seqlens[-1]), np.int32), cu_seqlens, options)
        return replace(batch.with_patch_images(pixel_values, grids, [1] * len(grids)), image_sequences=True)

    def with_patch_images(self, pixel_values: np.ndarray, grids: np.ndarray, images_per_seq: Sequence[int]) -> Batch:
        """These token sequences with their images as patches (the class describes the fields): `grids` [N, 3] in
        token order, `images_per_seq[i]` of them in sequence i."""
        cu_images = np.concatenate([np.zeros(1, np.int32), np.cumsum(images_per_seq, dtype=np.int32)])
        grids = np.asarray(grids, dtype=np.int32).reshape(-1, 3)
        assert len(cu_images) == self.num_seqs + 1 and cu_images[-1] == len(grids), "images do not fit the batch"
        assert len(pixel_values) == int(grids.prod(1).sum()), "patches do not fit the grids"
        return replace(
            self, pixel_values=np.asarray(pixel_values, dtype=np.float32), image_grid_thw=grids, cu_images=cu_images
        )

    @property
    def patch_images(self) -> bool:
        """Whether its images (if any) are patches inside token sequences, not one fixed-size image a sequence."""
        return self.image_grid_thw is not None

    @property
    def fixed_images(self) -> bool:
        """Whether it holds fixed-size images, one a sequence (CLIP's), texts perhaps beside them (`cu_images`)."""
        return self.pixel_values is not None and self.image_grid_thw is None

    @property
    def all_images(self) -> bool:
        """Whether every sequence is a fixed-size image: a request of images, as the wire carries one."""
        return self.fixed_images and self.pixel_values is not None and len(self.pixel_values) == self.num_seqs

    def with_spans(
        self, cu_spans: np.ndarray, span_bounds: np.ndarray, raw: bool = False, token_vectors: bool = False
    ) -> Batch:
        """This batch with pooling spans: `cu_spans` [B + 1] and `span_bounds` [S, 2], as the class describes."""
        assert len(cu_spans) == self.num_seqs + 1 and len(span_bounds) == cu_spans[-1], "spans do not fit the batch"
        return replace(
            self,
            cu_spans=np.asarray(cu_spans, dtype=np.int32),
            span_bounds=np.asarray(span_bounds, dtype=np.int32).reshape(-1, 2),
            raw_spans=np.full(self.num_seqs, raw, dtype=bool),
            token_vectors=np.full(self.num_seqs, token_vectors, dtype=bool),
            row_options=None if self.row_options is None else replace(
                self.row_options, raw_spans=raw, token_vectors=token_vectors
            ),
        )  # fmt: skip

    @classmethod
    def from_packed(
        cls,
        input_ids: np.ndarray,  # [T] int32
        cu_seqlens: np.ndarray,  # [B + 1] int32
        options: RowOptions = RowOptions(),
        token_type_ids: np.ndarray | None = None,  # [T] int32
    ) -> Batch:
        """Arrays already packed, every sequence finished by `options`."""
        assert options.normalize is not None, "the model's default normalisation is resolved before packing"
        num_seqs = len(cu_seqlens) - 1
        return cls(
            input_ids=np.asarray(input_ids, dtype=np.int32),
            cu_seqlens=np.asarray(cu_seqlens, dtype=np.int32),
            dimensions=np.full(num_seqs, options.dimensions or 0, dtype=np.int32),
            normalize=np.full(num_seqs, options.normalize, dtype=bool),
            prompt_lens=np.full(num_seqs, options.prompt_tokens, dtype=np.int32),
            encodings=np.full(num_seqs, options.encoding, dtype=np.uint8),
            token_type_ids=None if token_type_ids is None else np.asarray(token_type_ids, dtype=np.int32),
            sparse=np.ones(num_seqs, dtype=bool) if options.sparse else None,
            all_outputs=np.ones(num_seqs, dtype=bool) if options.all_outputs else None,
            row_options=options,
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

    @property
    def cu_budget(self) -> np.ndarray:  # [B + 1] int32 or int64
        """Where each sequence starts in the token budget's units: its tokens, plus the patches of its patch images
        (Qwen3-VL), since the vision tower runs on every patch before its merger makes each 2 x 2 block one token;
        counting only the tokens, a step of images would hold 4 times the vision work the budget allows. The same
        array as `cu_seqlens` for any other batch (SigLIP 2's image sequences: their tokens are their patches)."""
        if self.image_grid_thw is None or self.cu_images is None or self.image_sequences:
            return self.cu_seqlens
        cu_patches = np.concatenate([np.zeros(1, np.int64), np.cumsum(self.image_grid_thw.prod(1, dtype=np.int64))])
        cu_budget: np.ndarray = self.cu_seqlens + cu_patches[self.cu_images]
        return cu_budget

    @property
    def budget_tokens(self) -> int:
        """Its work in the token budget's units (`cu_budget`): the tokens, plus the patches of patch images."""
        return int(self.cu_budget[-1])

    @property
    def cu_rows(self) -> np.ndarray:  # [B + 1] int64: sequence i's rows are cu_rows[i]:cu_rows[i + 1]
        """Where each sequence's rows start: one row per span, or one for a sequence without spans; a sequence
        asking for all outputs has its pooled row too, before its spans'."""
        if self.cu_spans is None:
            return np.arange(self.num_seqs + 1)
        counts = np.diff(self.cu_spans)
        counts = np.maximum(counts, 1) if self.all_outputs is None else np.maximum(counts + self.all_outputs, 1)
        return np.concatenate([np.zeros(1, np.int64), np.cumsum(counts)])

    @property
    def num_rows(self) -> int:
        return self.num_seqs if self.cu_spans is None else int(self.cu_rows[-1])

    def options(self) -> RowOptions:
        """The options all its sequences share: those it was packed with (or read off the wire with), kept through
        slices and through a concat of batches that share them. A step concatenating several requests' sequences has
        no one set of options (each sequence keeps its own in the arrays): ValueError, as it is no request to send."""
        if self.row_options is None:
            raise ValueError("the batch's sequences come from requests with different row options")
        return self.row_options

    @property
    def any_sparse(self) -> bool:
        return self.sparse is not None and bool(self.sparse.any())

    @property
    def any_all_outputs(self) -> bool:
        return self.all_outputs is not None and bool(self.all_outputs.any())

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
            encodings=self.encodings[start:stop],
            token_type_ids=None if self.token_type_ids is None else self.token_type_ids[first:last],
            sparse=None if self.sparse is None else self.sparse[start:stop],
            key_lens=None if self.key_lens is None else self.key_lens[start:stop],
            **self._image_slice(start, stop),
            image_sequences=self.image_sequences,
            all_outputs=None if self.all_outputs is None else self.all_outputs[start:stop],
            row_options=self.row_options,
            **self._span_slice(start, stop),
        )

    def _image_slice(self, start: int, stop: int) -> dict[str, np.ndarray | None]:
        if self.pixel_values is None or self.cu_images is None:
            return {"pixel_values": None}
        first, last = int(self.cu_images[start]), int(self.cu_images[stop])
        cu_images = self.cu_images[start : stop + 1] - first
        if self.image_grid_thw is None:  # fixed-size images: one image a row of pixel_values
            return {"pixel_values": self.pixel_values[first:last], "cu_images": cu_images}
        cu_patches = np.concatenate([np.zeros(1, np.int64), np.cumsum(self.image_grid_thw.prod(1, dtype=np.int64))])
        return {
            "pixel_values": self.pixel_values[int(cu_patches[first]) : int(cu_patches[last])],
            "image_grid_thw": self.image_grid_thw[first:last],
            "cu_images": cu_images,
        }

    def _span_slice(self, start: int, stop: int) -> dict[str, np.ndarray]:
        if self.cu_spans is None or self.span_bounds is None or self.raw_spans is None:
            return {}
        first, last = int(self.cu_spans[start]), int(self.cu_spans[stop])
        return {
            "cu_spans": self.cu_spans[start : stop + 1] - first,
            "span_bounds": self.span_bounds[first:last],
            "raw_spans": self.raw_spans[start:stop],
            "token_vectors": _flags(self.token_vectors, self.num_seqs)[start:stop],
        }

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
            encodings=np.concatenate([batch.encodings for batch in batches]),
            token_type_ids=token_type_ids,
            sparse=_concat_sparse(batches),
            key_lens=_concat_key_lens(batches),
            **_concat_images(batches),
            image_sequences=any(batch.image_sequences for batch in batches),
            all_outputs=_concat_all_outputs(batches),
            row_options=_shared_options(batches),
            **_concat_spans(batches),
        )


def _flatten(sequences: Sequence[Sequence[int]], count: int) -> np.ndarray:  # [count] int32
    return np.fromiter(chain.from_iterable(sequences), dtype=np.int32, count=count)


def _token_types(batch: Batch) -> np.ndarray:  # [T] int32
    return np.zeros(batch.num_tokens, np.int32) if batch.token_type_ids is None else batch.token_type_ids


def _shared_options(batches: Sequence[Batch]) -> RowOptions | None:
    """The options of batches that all share them; None when any differs (a step mixing requests)."""
    first = batches[0].row_options
    return first if all(batch.row_options == first for batch in batches) else None


def _concat_sparse(batches: Sequence[Batch]) -> np.ndarray | None:
    """The batches' sparse flags end to end; a batch without them adds sequences that do not ask."""
    if all(batch.sparse is None for batch in batches):
        return None
    return np.concatenate([np.zeros(b.num_seqs, bool) if b.sparse is None else b.sparse for b in batches])


def _concat_all_outputs(batches: Sequence[Batch]) -> np.ndarray | None:
    if all(batch.all_outputs is None for batch in batches):
        return None
    return np.concatenate([_flags(b.all_outputs, b.num_seqs) for b in batches])


def _concat_spans(batches: Sequence[Batch]) -> dict[str, np.ndarray]:
    """The batches' spans end to end; a batch without spans adds sequences without any."""
    if all(batch.cu_spans is None for batch in batches):
        return {}
    counts = [np.zeros(b.num_seqs, np.int32) if b.cu_spans is None else np.diff(b.cu_spans) for b in batches]
    no_bounds = np.zeros((0, 2), np.int32)
    return {
        "cu_spans": np.concatenate([np.zeros(1, np.int32), np.cumsum(np.concatenate(counts), dtype=np.int32)]),
        "span_bounds": np.concatenate([no_bounds if b.span_bounds is None else b.span_bounds for b in batches]),
        "raw_spans": np.concatenate([_flags(b.raw_spans, b.num_seqs) for b in batches]),
        "token_vectors": np.concatenate([_flags(b.token_vectors, b.num_seqs) for b in batches]),
    }


def _flags(flags: np.ndarray | None, num_seqs: int) -> np.ndarray:  # [B] bool
    return np.zeros(num_seqs, bool) if flags is None else flags


def _concat_key_lens(batches: Sequence[Batch]) -> np.ndarray | None:
    """The batches' key lengths end to end; a batch without them has every token a key."""
    if all(batch.key_lens is None for batch in batches):
        return None
    return np.concatenate([b.seq_lens if b.key_lens is None else b.key_lens for b in batches], dtype=np.int32)


def _concat_images(batches: Sequence[Batch]) -> dict[str, np.ndarray | None]:
    """The batches' images end to end, a batch without images adding sequences without any; fixed-size images and
    patch images are two models' and never share a batch."""
    with_images = [batch for batch in batches if batch.pixel_values is not None]
    if not with_images:
        return {"pixel_values": None}
    if len({batch.patch_images for batch in with_images}) > 1:
        raise ValueError("fixed-size images and patch images never share a batch")
    counts = [np.zeros(b.num_seqs, np.int32) if b.cu_images is None else np.diff(b.cu_images) for b in batches]
    grids = [b.image_grid_thw for b in with_images if b.image_grid_thw is not None]
    return {
        "pixel_values": np.concatenate([b.pixel_values for b in with_images if b.pixel_values is not None]),
        "image_grid_thw": np.concatenate(grids) if grids else None,
        "cu_images": np.concatenate([np.zeros(1, np.int32), np.cumsum(np.concatenate(counts), dtype=np.int32)]),
    }


def count_within_budget(cu_budget: np.ndarray, first: int, max_tokens: float, max_seqs: int | None = None) -> int:
    """How many sequences from `first` on, in order, fit together in `max_tokens` tokens (and `max_seqs`
    sequences); 0 when sequence `first` alone is over the budget. `cu_budget`: where each sequence starts in the
    budget's units (a batch's `cu_budget`; `cu_seqlens` for token ids alone)."""
    ends = cu_budget[first + 1 :]
    count = int(np.searchsorted(ends, int(cu_budget[first]) + max_tokens, side="right"))
    return count if max_seqs is None else max(0, min(count, max_seqs))


def token_budget_runs(cu_budget: np.ndarray, max_tokens: float, max_seqs: int | None = None) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive sequences covering them all in order, each as long as the budget
    allows: at most `max_tokens` tokens and `max_seqs` sequences; a sequence over the budget is a run alone."""
    num_seqs = len(cu_budget) - 1
    runs: list[tuple[int, int]] = []
    start = 0
    while start < num_seqs:
        stop = start + max(1, count_within_budget(cu_budget, start, max_tokens, max_seqs))
        runs.append((start, stop))
        start = stop
    return runs
