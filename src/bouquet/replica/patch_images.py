"""A request's images of any size as patches (EmbedRequest.image_grid_thw): inside its token sequences (Qwen3-VL),
or each a sequence of its own (SigLIP 2); read in place from the message's bytes and checked against its sequences,
so that a step sliced from it anywhere holds each sequence's images whole and every image fills its placeholder
tokens (or its own sequence) exactly."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from bouquet.batch import Batch
from bouquet.proto import embedding_pb2


class InvalidImages(ValueError):
    """The request's images do not fit its sequences (replica/request.py answers it as InvalidInput)."""


@dataclass(frozen=True)
class PatchImageLimits:
    """What the model takes of images inside token sequences; patch_dim 0: none."""

    patch_dim: int = 0  # the values of one patch
    merge_size: int = 1  # rows and columns of patches merged into one token
    image_token_id: int = -1  # the placeholder token an image's merged tokens replace
    image_sequences: bool = False  # each image a sequence of its own, one token a patch, its input_ids zeros
    max_patches: int = 0  # with image_sequences: the most patches one image may have


def attach_patch_images(batch: Batch, message: embedding_pb2.EmbedRequest, limits: PatchImageLimits) -> Batch:
    """The token batch with the message's images; InvalidImages names the first problem."""
    if not limits.patch_dim:
        raise InvalidImages("this model takes no images of varying size (image_grid_thw)")
    if message.image_shape:
        raise InvalidImages("images inside token sequences send image_grid_thw and cu_images, not image_shape")
    grids = _int32s("image_grid_thw", message.image_grid_thw)
    if len(grids) % 3 or not len(grids):
        raise InvalidImages(f"image_grid_thw has {len(grids)} values, not (frames, rows, columns) per image")
    grids = grids.reshape(-1, 3)
    merge = limits.merge_size
    if (grids[:, 0] != 1).any() or (grids[:, 1:] < merge).any() or (grids[:, 1:] % merge).any():
        raise InvalidImages(f"an image grid must be (1, rows, columns), rows and columns multiples of {merge}")
    cu_images = _int32s("cu_images", message.cu_images)
    if len(cu_images) != batch.num_seqs + 1 or cu_images[0] != 0 or cu_images[-1] != len(grids):
        raise InvalidImages(f"cu_images must go from 0 to {len(grids)} in {batch.num_seqs + 1} values")
    if (np.diff(cu_images) < 0).any():
        raise InvalidImages("cu_images must not decrease")
    patches = int(grids.prod(1, dtype=np.int64).sum())
    if len(message.pixel_values) != 4 * patches * limits.patch_dim:
        raise InvalidImages(
            f"pixel_values has {len(message.pixel_values)} bytes; the grids make {patches} float32 patches of "
            f"{limits.patch_dim} values"
        )
    if limits.image_sequences:
        _check_image_sequences(batch, grids, cu_images, limits.max_patches)
    else:
        _check_placeholders(batch, grids, cu_images, limits)
    pixels = np.frombuffer(message.pixel_values, "<f4").reshape(patches, limits.patch_dim)
    batch = batch.with_patch_images(pixels, grids, np.diff(cu_images).tolist())
    return replace(batch, image_sequences=True) if limits.image_sequences else batch


def _check_placeholders(batch: Batch, grids: np.ndarray, cu_images: np.ndarray, limits: PatchImageLimits) -> None:
    """Each sequence holds as many placeholder tokens as its images make."""
    per_image = grids.prod(1, dtype=np.int64) // limits.merge_size**2
    wanted = np.diff(np.concatenate([[0], np.cumsum(per_image)])[cu_images])
    marks = np.concatenate([[0], np.cumsum(batch.input_ids == limits.image_token_id)])
    held = np.diff(marks[batch.cu_seqlens])
    if (held != wanted).any():
        seq = int(np.argmax(held != wanted))
        raise InvalidImages(f"sequence {seq} has {held[seq]} image tokens; its images make {wanted[seq]}")


def _check_image_sequences(batch: Batch, grids: np.ndarray, cu_images: np.ndarray, max_patches: int) -> None:
    """A sequence holding an image holds it alone: as many tokens as its patches, all zeros."""
    counts = np.diff(cu_images)
    if counts.max() > 1:
        raise InvalidImages(f"sequence {int(np.argmax(counts > 1))} holds {counts.max()} images; an image is a "
                            "sequence of its own")  # fmt: skip
    patches = grids.prod(1, dtype=np.int64)
    if patches.max() > max_patches:
        raise InvalidImages(f"image {int(np.argmax(patches))} has {patches.max()} patches; at most {max_patches}")
    lengths = batch.seq_lens[counts == 1]
    if (lengths != patches).any():
        index = int(np.argmax(lengths != patches))
        raise InvalidImages(f"image {index} has {patches[index]} patches in a sequence of {lengths[index]} tokens")
    marks = np.concatenate([[0], np.cumsum(batch.input_ids != 0)])
    if np.diff(marks[batch.cu_seqlens])[counts == 1].any():
        raise InvalidImages("an image's sequence holds only zeros (its tokens are its patches)")


def image_sequence_flags(cu_images: bytes, num_seqs: int) -> np.ndarray | None:  # [B] bool
    """Which sequences hold an image, for the length checks of texts only; None when cu_images does not fit the
    sequences (attach_patch_images then says why)."""
    if len(cu_images) != 4 * (num_seqs + 1):
        return None
    return np.diff(np.frombuffer(cu_images, dtype="<i4")) > 0


def _int32s(name: str, data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise InvalidImages(f"{name} has {len(data)} bytes, not a whole number of 4-byte little-endian int32s")
    return np.frombuffer(data, dtype="<i4").astype(np.int32, copy=False)
