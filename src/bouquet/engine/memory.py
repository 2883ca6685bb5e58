"""A CPU replica's memory: the matrix products' per-shape state, bounded by bounding the shapes.

On the CPU every Linear runs through oneDNN (layers/linear.py), which builds a primitive, JIT-compiled
kernels included, for each input shape it meets, and keeps it: oneDNN's primitive cache and ideep's own LRU
cache hold up to 1,024 each. A step's shape is its token count, so MiniLM's four linear shapes make four
primitives per distinct count, about 2.3 MB in all (0.57 MB each, float32, measured). A replica fed steps
of every size from 1 to 1,024 tokens therefore fills both caches: that, with the freed memory the engine
threads' malloc arenas keep around it, took a replica from 360 MB to 1.3-1.6 GB before it levelled off
(docs/memory.md has the measurements). Worse, at a few hundred distinct counts the caches churn and a step
of a new count spends 1-3 ms a linear building its primitives again.

`pad_to_bucket` rounds a step's token count up to one of `per_doubling` sizes in each doubling (exact up to
2 x `per_doubling`), so at most (log2(max tokens) - log2(per_doubling) + 1) x per_doubling counts
ever reach oneDNN: 112 up to 1,024 tokens with 16 a doubling, about 260 MB of primitives at most,
all of them cached. The pad tokens form one extra sequence of their own (as in CUDA graphs' buckets), whose
row the caller drops; a step pads by less than 1/16 of its tokens.
"""

from __future__ import annotations

from bouquet.batch import Batch
from bouquet.engine.cuda_graphs import Bucket, pad_batch


def bucket_tokens(num_tokens: int, per_doubling: int) -> int:
    """`num_tokens` rounded up to the next of `per_doubling` evenly spaced sizes in its doubling; exact up to
    2 x `per_doubling`, and always when `per_doubling` is 0."""
    if per_doubling <= 0 or num_tokens <= 2 * per_doubling:
        return num_tokens
    step = (1 << (num_tokens.bit_length() - 1)) // per_doubling
    return -(-num_tokens // step) * step


def pad_to_bucket(batch: Batch, per_doubling: int) -> Batch:
    """`batch` with its token count rounded up by `bucket_tokens`: the pad tokens are one more sequence, the
    last; sequences 0..B-1 are unchanged. The batch itself when its count is already a bucket's."""
    num_tokens = bucket_tokens(batch.num_tokens, per_doubling)
    if num_tokens == batch.num_tokens or batch.cu_spans is not None:
        return batch  # a batch with pooling spans (contextual, /embed_all) runs at its exact count
    return pad_batch(batch, Bucket(num_tokens, batch.num_seqs + 1))
