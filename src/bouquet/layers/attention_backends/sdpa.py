"""torch scaled_dot_product_attention over packed sequences (the CPU backend, and the CUDA fallback).

SDPA has no variable-length form, so sequences are gathered into padded groups of similar length: each
group is one batched SDPA call, and a group of equal lengths laid out contiguously is a free view. The
grouping keeps the attention work wasted on padding under `1 - min_efficiency` per group (see
docs/benchmarks.md for the per-sequence, single-padded-batch and grouped measurements).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from bouquet.layers.attention_backends.base import AttentionBackend
from bouquet.layers.context import ForwardContext


@dataclass(frozen=True)
class _Group:
    start: int  # first packed row, for a group that is one contiguous run of equal-length sequences
    num_seqs: int
    seq_len: int
    gather_index: torch.Tensor | None  # [b * L] packed row per padded slot; None for a contiguous run
    key_mask: torch.Tensor | None  # [b, 1, 1, L] True where a key is real; None when nothing is padded
    short_keys: bool = False  # some sequence's keys end before it does (ForwardContext.key_lens), not just padding


@dataclass(frozen=True)
class _Plan:
    groups: list[_Group]
    # [T] row of the groups' concatenated padded outputs that holds each packed row; None when the only
    # group is a contiguous run, whose output already is the packed layout.
    slot_of_row: torch.Tensor | None


def plan_groups(seq_lens: list[int], min_efficiency: float) -> list[list[int]]:
    """Sequence indices grouped so that sum(l^2) / (b * L^2) >= min_efficiency within each group."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    groups: list[list[int]] = []
    used = 0
    for i in order:
        if groups:
            longest = seq_lens[groups[-1][0]]
            members = len(groups[-1]) + 1
            if (used + seq_lens[i] ** 2) >= min_efficiency * members * longest**2:
                groups[-1].append(i)
                used += seq_lens[i] ** 2
                continue
        groups.append([i])
        used = seq_lens[i] ** 2
    return groups


class SdpaBackend(AttentionBackend):
    name: ClassVar[str] = "sdpa"
    # Both through an explicit mask, so a windowed layer still costs full attention here.
    supports_sliding_window: ClassVar[bool] = True
    supports_position_bias: ClassVar[bool] = True
    supports_key_lens: ClassVar[bool] = True  # keys ending before their sequence, through the same key mask

    def __init__(self, min_efficiency: float = 0.8):
        self.min_efficiency = min_efficiency

    def prepare(self, ctx: ForwardContext) -> _Plan:
        starts = [0, *itertools.accumulate(ctx.seq_lens)]
        groups, row_slots = [], []
        for members in plan_groups(ctx.seq_lens, self.min_efficiency):
            members.sort()
            group, rows, slots = _make_group(members, ctx.seq_lens, starts, ctx.key_lens)
            row_slots.append((rows, slots + sum(g.num_seqs * g.seq_len for g in groups)))
            groups.append(group)
        device = ctx.cu_seqlens.device
        groups = [g if g.gather_index is None else _to_device(g, device) for g in groups]
        if len(groups) == 1 and groups[0].gather_index is None:
            return _Plan(groups, None)
        slot_of_row = torch.empty(starts[-1], dtype=torch.long)
        for rows, slots in row_slots:
            slot_of_row[rows] = slots
        return _Plan(groups, _upload(slot_of_row, device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        plan: _Plan = ctx.attn_metadata
        outputs = [_attend_group(q, k, v, group, _Masking(causal, window, bias), scale) for group in plan.groups]
        if plan.slot_of_row is None:
            return outputs[0]
        padded = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
        return padded.index_select(0, plan.slot_of_row)


def _make_group(
    members: list[int], seq_lens: list[int], starts: list[int], key_lens: list[int] | None = None
) -> tuple[_Group, torch.Tensor, torch.Tensor]:
    """The group, and which packed rows land in which of its padded slots."""
    lengths = [seq_lens[i] for i in members]
    keys = lengths if key_lens is None else [key_lens[i] for i in members]
    short_keys = keys != lengths
    seq_len = max(lengths)
    contiguous = members == list(range(members[0], members[-1] + 1))
    if contiguous and min(lengths) == seq_len and not short_keys:
        first = starts[members[0]]
        num_slots = len(members) * seq_len
        group = _Group(first, len(members), seq_len, None, None)
        return group, torch.arange(first, first + num_slots), torch.arange(num_slots)
    slot = torch.arange(seq_len)
    member_starts = torch.tensor([starts[i] for i in members])
    is_real = slot[None, :] < torch.tensor(lengths)[:, None]  # [b, L]
    # Pad slots read the sequence's own first row: any finite value will do, since a pad key is masked
    # (bidirectional) or lies after every real query (causal), and pad queries are never read back.
    gather = torch.where(is_real, member_starts[:, None] + slot[None, :], member_starts[:, None]).flatten()
    is_key = slot[None, :] < torch.tensor(keys)[:, None]  # [b, L]: real, and not after the sequence's keys
    key_mask = None if min(keys) == seq_len else is_key[:, None, None, :]
    real_slots = is_real.flatten().nonzero().squeeze(1)
    return _Group(-1, len(members), seq_len, gather, key_mask, short_keys), gather[real_slots], real_slots


def _to_device(group: _Group, device: torch.device) -> _Group:
    assert group.gather_index is not None
    key_mask = None if group.key_mask is None else _upload(group.key_mask, device)
    gather_index = _upload(group.gather_index, device)
    return _Group(group.start, group.num_seqs, group.seq_len, gather_index, key_mask, group.short_keys)


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A plan's index tensor on `device`. On CUDA through pinned memory, without waiting: a copy from pageable
    memory makes the engine thread wait for the step still in flight on its stream, which ends the overlap of
    preparing one step while the device computes the last."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class _Masking:
    causal: bool
    window: tuple[int, int] | None
    bias: torch.Tensor | None  # [H, L, L] float32

    def mask(self, group: _Group, like: torch.Tensor) -> tuple[torch.Tensor | None, bool]:
        """SDPA's attn_mask for the group (on `like`'s device, scores in its dtype) and its is_causal."""
        if self.window is None and self.bias is None and not (self.causal and group.short_keys):
            # Right padding: with a causal mask, real queries never see the pad keys behind them.
            return (None, True) if self.causal else (group.key_mask, False)
        length = group.seq_len
        positions = torch.arange(length, device=like.device)
        offset = positions[None, :] - positions[:, None]  # [L, L]: key j - query i
        left, right = self.window or (length, length)
        allowed = (offset >= -left) & (offset <= (0 if self.causal else right))  # [L, L]
        if group.key_mask is not None:
            allowed = allowed & group.key_mask  # [b, 1, L, L]
        if self.bias is None:
            return allowed, False
        scores = self.bias[:, :length, :length].to(like.dtype)
        return scores.masked_fill(~allowed, float("-inf")), False


def _attend_group(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _Group, masking: _Masking, scale: float
) -> torch.Tensor:  # [b * L, H, D]
    shape = (group.num_seqs, group.seq_len)
    if group.gather_index is None:
        rows = slice(group.start, group.start + group.num_seqs * group.seq_len)
        qkv = [t[rows].unflatten(0, shape) for t in (q, k, v)]
    else:
        qkv = [t.index_select(0, group.gather_index).unflatten(0, shape) for t in (q, k, v)]
    mask, causal = masking.mask(group, q)
    return _sdpa(*qkv, mask, causal, scale).flatten(0, 1)


def _sdpa(
    q: torch.Tensor,  # [b, L, H, D]
    k: torch.Tensor,  # [b, L, Hkv, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [b, 1, 1, L] keys, or [b | 1, H | 1, L, L]: bool, or float scores to add
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [b, L, H, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    # The CPU flash kernel writes [b, L, H, D] memory and returns a transposed view: this is free there.
    return out.transpose(1, 2)
