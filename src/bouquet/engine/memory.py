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
row the caller drops; a step pads by less than 1/16 of its tokens. A step of images of any size, whose patch
counts take any value, has its images' patches rounded up the same way by a pad image (SigLIP 2's a sequence of
its own; Qwen3-VL's inside the pad sequence, with its placeholders): without it every new count built the vision
tower's primitives again and kept them (docs/benchmarks.md). A step of texts beside fixed-size images (CLIP's,
SigLIP's) runs each tower on its own tokens: its texts' are rounded up by a pad text, its images' are whole images'.

`build_primitives` builds them all at start-up (`cpu_warmup_tokens`), for each OpenMP team size a step can run
with (oneDNN keys a primitive by its thread count too): a replica then starts at its plateau and stays flat,
and no request pays for a build (4 to 30 ms a new count before). Only the linears are run, one of each shape,
on zeros: about 1 s for MiniLM on 2 cores, against minutes of serving to meet every count. They must all stay:
oneDNN's cache holds 1,024 primitives by default, fewer than MiniLM's 1,536 (an inner product and its nested
matmul for 4 linears at 112 counts on one thread and 80 lone counts on all), so it evicted and rebuilt them
and memory crept up (docs/memory.md); `reserve_primitive_cache` raises the capacity.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import numpy as np
import torch
from torch import nn

from bouquet.batch import Batch
from bouquet.engine.cuda_graphs import Bucket, pad_batch
from bouquet.layers.linear import Linear


def bucket_tokens(num_tokens: int, per_doubling: int) -> int:
    """`num_tokens` rounded up to the next of `per_doubling` evenly spaced sizes in its doubling; exact up to
    2 x `per_doubling`, and always when `per_doubling` is 0."""
    if per_doubling <= 0 or num_tokens <= 2 * per_doubling:
        return num_tokens
    step = (1 << (num_tokens.bit_length() - 1)) // per_doubling
    return -(-num_tokens // step) * step


def pad_to_bucket(batch: Batch, per_doubling: int, placeholder: tuple[int, int] | None = None) -> Batch:
    """`batch` with its token count rounded up by `bucket_tokens`: the pad tokens are one more sequence, the
    last; sequences 0..B-1 are unchanged. The batch itself when its count is already a bucket's. `placeholder`:
    (merge size, placeholder token id) of a model whose images sit inside token sequences (Qwen3-VL)."""
    if batch.cu_spans is not None or batch.key_lens is not None:
        return batch  # a batch with pooling spans (contextual, /embed_all, ColBERT) runs at its exact count
    has_patches = batch.patch_images and batch.pixel_values is not None and len(batch.pixel_values) > 0
    if has_patches and batch.image_sequences:
        return _pad_image_sequences(batch, per_doubling)
    if has_patches and placeholder is not None:
        return _pad_patch_images(batch, per_doubling, *placeholder)
    if batch.fixed_images and not batch.all_images:
        return _pad_texts_beside_images(batch, per_doubling)
    num_tokens = bucket_tokens(batch.num_tokens, per_doubling)
    if num_tokens == batch.num_tokens or batch.pixel_values is not None:
        return batch  # fixed-size images run at whole images' counts (built at start-up: `image_warmup`)
    return pad_batch(batch, Bucket(num_tokens, batch.num_seqs + 1))


def _pad_texts_beside_images(batch: Batch, per_doubling: int) -> Batch:
    """A step of texts and fixed-size images: the text tower's tokens rounded up by `bucket_tokens` with a pad
    text, the last sequence (token id 0, as `pad_batch`'s); the vision tower's are whole images' already."""
    assert batch.cu_images is not None, "fixed-size images come with cu_images"
    texts = np.diff(batch.cu_images) == 0
    text_tokens = int(batch.seq_lens[texts].sum())
    pad = bucket_tokens(text_tokens, per_doubling) - text_tokens
    return batch if pad == 0 else Batch.concat([batch, Batch.pack([[0] * pad])])


def _pad_image_sequences(batch: Batch, per_doubling: int) -> Batch:
    """A step holding images each a sequence of their own (SigLIP 2), its vision tower's tokens (every image's
    patches) rounded up by `bucket_tokens` with one pad image, a single row of patches of zeros, the last
    sequence: its row is dropped as a pad sequence's is. Texts in the step keep their counts (SigLIP 2 pads each
    to the text positions already)."""
    assert batch.pixel_values is not None and batch.image_grid_thw is not None, "asked of a step with images"
    patches = len(batch.pixel_values)
    pad = bucket_tokens(patches, per_doubling) - patches
    if not pad:
        return batch
    zeros = np.zeros((pad, batch.pixel_values.shape[1]), np.float32)
    return Batch.concat([batch, Batch.pack_image_sequences(zeros, np.array([[1, 1, pad]], np.int32))])


def _pad_patch_images(batch: Batch, per_doubling: int, merge: int, placeholder_id: int) -> Batch:
    """A step whose images sit inside token sequences (Qwen3-VL): one pad sequence brings both counts to buckets,
    the vision tower's (every image's patches: a pad image of `merge` rows of zero patches) and the decoder's (its
    tokens: the pad image's placeholders, then pad tokens). A bucket of a count of whole merge blocks is one too
    (every bucket above 2 x `per_doubling` is a multiple of 4), and so is a quarter of it, the merger's rows."""
    assert batch.pixel_values is not None, "asked of a step with images"
    patches = len(batch.pixel_values)
    pad_patches = bucket_tokens(patches, per_doubling) - patches
    if pad_patches % (merge * merge):
        pad_patches = 0  # a count this rounding cannot reach in whole blocks: the vision tower's stays exact
    image_tokens = pad_patches // (merge * merge)
    pad_tokens = bucket_tokens(batch.num_tokens + image_tokens, per_doubling) - batch.num_tokens
    if not pad_tokens:
        return batch
    pad = Batch.pack([[placeholder_id] * image_tokens + [0] * (pad_tokens - image_tokens)])
    if image_tokens:
        zeros = np.zeros((pad_patches, batch.pixel_values.shape[1]), np.float32)
        pad = pad.with_patch_images(zeros, np.array([[1, merge, pad_patches // merge]], np.int32), [1])
    return Batch.concat([batch, pad])


# Primitives oneDNN keeps: the buckets' (above) for models of up to about 10 linear kinds. A bound on count, not
# bytes: with buckets only shapes that steps meet are built (0.57 MB each for MiniLM's float32 linears).
PRIMITIVE_CACHE_CAPACITY = 4096


def reserve_primitive_cache() -> None:
    """Sizes oneDNN's primitive cache for the buckets, unless $ONEDNN_PRIMITIVE_CACHE_CAPACITY says otherwise.
    oneDNN reads it once, at its first primitive: this must run before the first model is loaded."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(PRIMITIVE_CACHE_CAPACITY))


def bucket_counts(max_tokens: int, per_doubling: int) -> list[int]:
    """Every count `bucket_tokens` gives for 1..`max_tokens` tokens, ascending."""
    return sorted({bucket_tokens(n, per_doubling) for n in range(1, max_tokens + 1)})


def distinct_linears(modules: Iterable[nn.Module], skip: Iterable[nn.Module] = ()) -> list[Linear]:
    """One prepacked or int8 linear of each kind `modules` run on a step's tokens, those under `skip` left out (a
    SPLADE masked-LM head, a classifier: they run on pooled rows or fixed blocks, not on a step's count). A
    primitive depends on the shapes, the dtype and the fused activation, not on the weights' values."""
    skipped = {id(module) for root in skip for module in root.modules()}
    kinds: dict[tuple[object, ...], Linear] = {}
    for module in (module for root in modules for module in root.modules()):
        if not isinstance(module, Linear) or id(module) in skipped:
            continue
        if module.packed_weight is not None or module.int8 is not None:
            kind = (type(module), module.in_features, module.out_features, module.bias is not None,
                    repr(getattr(module, "epilogue", None)), module.weight.dtype, module.int8 is None)  # fmt: skip
            kinds.setdefault(kind, module)
    return list(kinds.values())


ImageLinears = tuple[nn.Module, int, int]  # a module whose linears run on (per image x images + extra) rows


def image_warmup(
    parts: Iterable[ImageLinears], max_tokens: int, tokens_per_image: int
) -> list[tuple[list[Linear], list[int]]]:
    """The linears of a model's fixed-size image steps and the counts to build them at: whole images up to
    `max_tokens` (such steps are never padded: `pad_to_bucket`), each linear at its own rows for k images (a patch
    embedding sees patches, a pooling head one row an image). A linear takes the last of `parts` holding it, so
    the parts go from a tower to the modules inside it that differ."""
    rows: dict[int, tuple[Linear, int, int]] = {}
    for module, per_image, extra in parts:
        for linear in module.modules():
            if isinstance(linear, Linear):
                rows[id(linear)] = (linear, per_image, extra)
    groups: dict[tuple[int, int], list[Linear]] = {}
    for linear, per_image, extra in rows.values():
        groups.setdefault((per_image, extra), []).append(linear)
    images = range(1, max_tokens // tokens_per_image + 1)
    return [
        (distinct_linears(linears), sorted({k * per_image + extra for k in images}))
        for (per_image, extra), linears in groups.items()
    ]


@torch.inference_mode()
def build_primitives(linears: list[Linear], counts: list[int]) -> None:
    """Runs each of `linears` once at each token count, on this thread with its OpenMP team."""
    for count in counts:
        for linear in linears:
            linear(torch.zeros(count, linear.in_features))
