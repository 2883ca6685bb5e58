"""A packed batch as the model takes it: device tensors of ids, positions within each sequence, and what
pooling and attention read. One preparation for every device; CUDA graphs load the same fields into their
static buffers (cuda_graphs.py)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bouquet.batch import Batch
from bouquet.layers.context import ForwardContext
from bouquet.layers.pooling import SpanInputs
from bouquet.layers.sparse import SparseInputs


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
    spans: SpanInputs | None = None  # eager batches only
    sparse: SparseInputs | None = None  # eager batches only
    key_lens: list[int] | None = None  # host copy of Batch.key_lens; eager batches only
    pixel_values: torch.Tensor | None = None  # [B, C, H, W] or [P, patch_dim] float32 (Batch); eager batches only
    image_grid_thw: torch.Tensor | None = None  # [N, 3] int64 with patch images (Batch); eager batches only
    cu_images: torch.Tensor | None = None  # [B + 1] int64 with pixel_values (Batch); eager batches only

    def context(self) -> ForwardContext:
        return ForwardContext(self.cu_seqlens, self.max_seqlen, self.seq_lens, key_lens=self.key_lens)


def padded_positions(batch: Batch, num_real_tokens: int) -> np.ndarray:  # [T] int64
    """Positions within each sequence; pad tokens get 0, so a long pad sequence never exceeds a model's limit."""
    seq_lens = np.diff(batch.cu_seqlens)
    positions = np.arange(batch.num_tokens) - np.repeat(batch.cu_seqlens[:-1], seq_lens)
    positions[num_real_tokens:] = 0
    return positions


def prepare_inputs(
    batch: Batch, device: torch.device, sparse: SparseInputs | None = None, real_tokens: int | None = None
) -> ModelInputs:
    """The eager path's inputs: the batch as it is; `sparse` from `prepare_sparse`. Tokens from `real_tokens` on (a
    token bucket's pad sequence, engine/memory.py) at position 0, as in a graph's buffers: a pad sequence may be
    longer than a short position table (SigLIP's 64)."""
    seq_lens = np.diff(batch.cu_seqlens)
    real = batch.num_tokens if real_tokens is None else real_tokens
    hosts = [batch.input_ids, padded_positions(batch, real), batch.cu_seqlens]
    hosts += [batch.dimensions, batch.normalize, batch.prompt_lens]
    if batch.token_type_ids is not None:
        hosts.append(batch.token_type_ids)
    input_ids, positions, cu_seqlens, dimensions, normalize, prompt_lens, *token_types = upload(hosts, device)
    # A copy: the batch's arrays may be read-only views of a message's bytes, which torch does not wrap.
    pixel_values = None if batch.pixel_values is None else torch.tensor(batch.pixel_values, device=device)
    grids, cu_images = (
        None if array is None else torch.tensor(array, dtype=torch.long, device=device)
        for array in (batch.image_grid_thw, batch.cu_images)
    )
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
        prepare_spans(batch, device),
        sparse,
        None if batch.key_lens is None else batch.key_lens.tolist(),
        pixel_values,
        grids,
        cu_images,
    )


def prepare_spans(batch: Batch, device: torch.device) -> SpanInputs | None:
    """The batch's spans as the pooler reads them: every span's tokens by their row in the packed batch, and
    where each output row comes from (a sequence's own row, or a span's)."""
    if batch.cu_spans is None or batch.span_bounds is None or batch.raw_spans is None:
        return None
    counts = np.diff(batch.cu_spans)
    span_seq = np.repeat(np.arange(batch.num_seqs), counts)  # [S] the sequence of each span
    starts = batch.cu_seqlens[span_seq] + batch.span_bounds[:, 0]  # [S] first token's row in the batch
    lengths = batch.span_bounds[:, 1] - batch.span_bounds[:, 0]
    cu_lengths = np.cumsum(lengths) - lengths  # [S] where each span's tokens start in token_index
    token_index = np.arange(int(lengths.sum())) + np.repeat(starts - cu_lengths, lengths)
    span_index = np.repeat(np.arange(len(lengths)), lengths)
    pooled = counts == 0 if batch.all_outputs is None else (counts == 0) | batch.all_outputs
    order = np.arange(batch.num_seqs)[pooled]  # sequences without spans (or asking for all outputs) keep their row...
    row_of_seq = batch.cu_rows[:-1][pooled]
    rows = np.empty(batch.num_rows, np.int64)
    rows[row_of_seq] = order
    rows[np.delete(np.arange(batch.num_rows), row_of_seq)] = batch.num_seqs + np.arange(len(lengths))  # ...spans
    raw = batch.raw_spans[span_seq]
    vectors = np.zeros(len(span_seq), bool) if batch.token_vectors is None else batch.token_vectors[span_seq]
    hosts = [token_index, span_index, lengths, batch.dimensions[span_seq], batch.normalize[span_seq], raw, rows]
    weighted = np.zeros(len(span_seq), bool) if batch.all_outputs is None else batch.all_outputs[span_seq]
    hosts += [vectors, weighted]
    token_index_t, span_index_t, lengths_t, dimensions, normalize, raw_t, order_t, vectors_t, weighted_t = upload(
        hosts, device
    )
    return SpanInputs(
        token_index_t, span_index_t, lengths_t.float(), dimensions.int(), normalize.bool(), raw_t.bool(), order_t,
        any_raw=bool(raw.any()), all_raw=bool(raw.all()),
        token_vectors=vectors_t.bool() if vectors.any() else None, all_token_vectors=bool(vectors.all()),
        weighted=weighted_t.bool() if weighted.any() else None,
    )  # fmt: skip


def prepare_sparse(batch: Batch, device: torch.device, every_seq: bool = False) -> SparseInputs | None:
    """The tokens of the sequences whose rows are sparse (those that ask, or all of them with `every_seq`) and
    where their rows go; None when none is. Built from the batch before any padding: pad tokens, which only ever
    follow the real ones, never reach the sparse head."""
    wanted = np.ones(batch.num_seqs, bool) if every_seq else batch.sparse
    if wanted is None or not wanted.any():
        return None
    if batch.cu_spans is not None and np.diff(batch.cu_spans)[wanted].any():
        raise ValueError("a sequence asks for both a sparse row and pooling spans")
    seqs = np.flatnonzero(wanted)
    lengths = batch.seq_lens[seqs]
    cu_lengths = np.cumsum(lengths) - lengths  # [S] where each sequence's tokens start in token_index
    token_index = np.arange(int(lengths.sum())) + np.repeat(batch.cu_seqlens[seqs] - cu_lengths, lengths)
    seq_index = np.repeat(np.arange(len(seqs)), lengths)
    rows = batch.cu_rows[seqs]
    hosts = [token_index, seq_index, batch.input_ids[token_index], rows]
    token_index_t, seq_index_t, input_ids, rows_t = upload(hosts, device)
    return SparseInputs(token_index_t, seq_index_t, input_ids, rows_t, len(seqs), len(seqs) == batch.num_rows)


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
