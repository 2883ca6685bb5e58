"""torch scaled_dot_product_attention over packed sequences (the CPU backend, and the CUDA fallback).

SDPA has no variable-length form, so sequences are gathered into padded groups of similar length: each
group is one batched SDPA call, and a group of equal lengths laid out contiguously is a free view. The
grouping keeps the attention work wasted on padding under `1 - min_efficiency` per group (see
docs/benchmarks.md for the per-sequence, single-padded-batch and grouped measurements).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from bouquet.engine.context import ForwardContext
from bouquet.layers.attention_backends.base import AttentionBackend


@dataclass(frozen=True)
class _Group:
    start: int  # first token when the group is one contiguous run of equal-length sequences
    num_seqs: int
    seq_len: int
    gather_index: torch.Tensor | None  # [b * L] packed row per padded slot (pad slots -> row T, zeros)
    key_mask: torch.Tensor | None  # [b, 1, 1, L] True where a key is real; None when nothing is padded
    valid_slots: torch.Tensor | None  # [n] padded slots that hold real tokens
    dest_rows: torch.Tensor | None  # [n] packed rows those slots go back to


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

    def __init__(self, min_efficiency: float = 0.8):
        self.min_efficiency = min_efficiency

    def prepare(self, ctx: ForwardContext) -> list[_Group]:
        starts = [0]
        for length in ctx.seq_lens:
            starts.append(starts[-1] + length)
        groups = plan_groups(ctx.seq_lens, self.min_efficiency)
        device = ctx.cu_seqlens.device
        return [self._make_group(members, ctx.seq_lens, starts, device) for members in groups]

    @staticmethod
    def _make_group(members: list[int], seq_lens: list[int], starts: list[int], device: torch.device) -> _Group:
        members.sort()
        lengths = [seq_lens[i] for i in members]
        seq_len = max(lengths)
        contiguous = members == list(range(members[0], members[-1] + 1))
        if contiguous and min(lengths) == seq_len:
            return _Group(starts[members[0]], len(members), seq_len, None, None, None, None)
        total = starts[-1]
        slot = torch.arange(seq_len)
        member_starts = torch.tensor([starts[i] for i in members])
        member_lens = torch.tensor(lengths)
        is_real = slot[None, :] < member_lens[:, None]  # [b, L]
        gather = torch.where(is_real, member_starts[:, None] + slot[None, :], total).flatten()
        valid_slots = is_real.flatten().nonzero().squeeze(1)
        return _Group(
            start=-1,
            num_seqs=len(members),
            seq_len=seq_len,
            gather_index=gather.to(device),
            key_mask=is_real[:, None, None, :].to(device),
            valid_slots=valid_slots.to(device),
            dest_rows=gather[valid_slots].to(device),
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        ctx: ForwardContext,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:
        groups: list[_Group] = ctx.attn_metadata
        if len(groups) == 1 and groups[0].gather_index is None:
            return self._attend_contiguous(q, k, v, groups[0], causal, scale)
        out = torch.empty_like(q)
        padded = (
            [self._with_zero_row(t) for t in (q, k, v)] if any(g.gather_index is not None for g in groups) else None
        )
        for group in groups:
            if group.gather_index is None:
                rows = slice(group.start, group.start + group.num_seqs * group.seq_len)
                out[rows] = self._attend_contiguous(q, k, v, group, causal, scale)
            else:
                assert padded is not None
                self._attend_gathered(*padded, out, group, causal, scale)
        return out

    @staticmethod
    def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(1, *x.shape[1:])])

    def _attend_contiguous(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: _Group, causal: bool, scale: float
    ) -> torch.Tensor:
        rows = slice(group.start, group.start + group.num_seqs * group.seq_len)
        shape = (group.num_seqs, group.seq_len)
        out = _sdpa(*(t[rows].unflatten(0, shape) for t in (q, k, v)), None, causal, scale)
        return out.flatten(0, 1)

    def _attend_gathered(
        self,
        q_padded: torch.Tensor,  # [T + 1, H, D], last row zeros
        k_padded: torch.Tensor,
        v_padded: torch.Tensor,
        out: torch.Tensor,  # [T, H, D]
        group: _Group,
        causal: bool,
        scale: float,
    ) -> None:
        assert group.gather_index is not None and group.valid_slots is not None and group.dest_rows is not None
        shape = (group.num_seqs, group.seq_len)
        qkv = (t.index_select(0, group.gather_index).unflatten(0, shape) for t in (q_padded, k_padded, v_padded))
        # Right padding: with a causal mask, real queries never see the pad keys behind them.
        mask = None if causal else group.key_mask
        attended = _sdpa(*qkv, mask, causal, scale).flatten(0, 1)
        out.index_copy_(0, group.dest_rows, attended.index_select(0, group.valid_slots))


def _sdpa(
    q: torch.Tensor,  # [b, L, H, D]
    k: torch.Tensor,  # [b, L, Hkv, D]
    v: torch.Tensor,
    key_mask: torch.Tensor | None,  # [b, 1, 1, L]
    causal: bool,
    scale: float,
) -> torch.Tensor:  # [b, L, H, D]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=key_mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[2],
    )
    return out.transpose(1, 2)
