"""FlashInfer ragged prefill (`flashinfer-python`): BatchPrefillWithRaggedKVCacheWrapper over packed q, k, v.

plan() turns the batch's offsets into a work schedule on the host once per forward; run() is the per-layer
kernel. For a CUDA graph each bucket gets its own wrapper with `use_cuda_graph=True` and fixed index
buffers, and plan() runs again before every replay to refill them: with a CUDA graph FlashInfer sizes the
schedule from the first plan's row count and the fixed batch size, so every replan of a bucket fits the
launch the graph recorded. Its FA2 kernels (before Hopper) then always split KV and stage partial outputs in
the float workspace, which a large bucket can outgrow: that capture fails and the bucket stays eager. On
Hopper the FA3 kernels do not use it. Written against FlashInfer's published API; not yet run on a GPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any, ClassVar

import torch

from bouquet.layers.attention_backends.base import AttentionBackend, AttentionShape, BackendUnavailableError
from bouquet.layers.context import ForwardContext

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace, shared by every wrapper


class FlashInferBackend(AttentionBackend):
    """One wrapper a window: plan() takes the window (`window_left`), so a model whose layers slide different
    windows, or slide one and attend fully in others, gets a plan for each, made once per batch."""

    name: ClassVar[str] = "flashinfer"
    supports_cuda_graphs: ClassVar[bool] = True
    supports_sliding_window: ClassVar[bool] = True

    def __init__(self) -> None:
        try:
            import flashinfer
        except Exception as error:  # a broken install (a missing dependency, a CUDA mismatch) too, not only none
            message = (
                f"attention backend 'flashinfer' needs pip install flashinfer-python; {type(error).__name__}: {error}"
            )
            raise BackendUnavailableError(message) from error
        self._flashinfer = flashinfer
        self._workspace: torch.Tensor | None = None
        self._eager: dict[int, Any] = {}  # by window_left
        self._graph_wrappers: dict[tuple[Hashable, int], Any] = {}
        self._planned: dict[int, torch.cuda.Event] = {}  # per wrapper: after its last plan's upload

    @classmethod
    def can_run(cls, shape: AttentionShape) -> bool:
        # FlashInfer's window bounds the keys on the left only: a bidirectional window has a right bound too.
        # Its plan, shared by every layer, fixes the heads and causality.
        return super().can_run(shape) and (shape.causal or not shape.windows) and shape.uniform

    def prepare(self, ctx: ForwardContext) -> dict[int, Any]:
        for left in self._window_lefts():
            if left not in self._eager:
                self._eager[left] = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
                    self._workspace_for(ctx), "NHD"
                )
            self._plan(self._eager[left], ctx, left)
        return self._eager

    def prepare_capture(self, ctx: ForwardContext, key: Hashable) -> dict[int, Any]:
        wrappers = {}
        for left in self._window_lefts():
            wrappers[left] = self._graph_wrappers[key, left] = self._graph_wrapper(ctx)
            self._plan(wrappers[left], ctx, left)
        return wrappers

    def prepare_replay(self, ctx: ForwardContext, key: Hashable) -> None:
        for left in self._window_lefts():
            self._plan(self._graph_wrappers[key, left], ctx, left)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        ctx: ForwardContext,
        causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        assert bias is None, "flashinfer adds no position bias (bind refuses such a model)"
        return ctx.attn_metadata[-1 if window is None else window[0]].run(q, k, v)

    def _window_lefts(self) -> list[int]:
        """-1 (no window) for the layers that attend fully, and each window's left extent. Full attention is
        planned even where every layer slides: the shape records windows, not which layers lack one."""
        assert self.shape is not None, "flashinfer plans with the model's attention shape: call bind() first"
        return [-1, *sorted({left for left, _ in self.shape.windows})]

    def _graph_wrapper(self, ctx: ForwardContext) -> Any:
        num_seqs = len(ctx.seq_lens)
        device = ctx.cu_seqlens.device
        return self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace_for(ctx),
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
            kv_indptr_buf=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        )

    def _workspace_for(self, ctx: ForwardContext) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.cu_seqlens.device)
        return self._workspace

    def _plan(self, wrapper: Any, ctx: ForwardContext, window_left: int) -> None:
        shape = self.shape
        assert shape is not None, "flashinfer plans with the model's attention shape: call bind() first"
        # plan() writes the wrapper's pinned host buffer and uploads it with a non-blocking copy. With the
        # engine a step ahead, that copy may still be queued behind the step in flight: wait for it (and
        # only it) before the buffer is rewritten.
        previous = self._planned.get(id(wrapper))
        if previous is not None:
            previous.synchronize()
        # Offsets from the host copy: planning on the host needs no device-to-host sync.
        indptr = torch.tensor([0, *itertools.accumulate(ctx.seq_lens)], dtype=torch.int32)
        wrapper.plan(
            indptr,
            indptr,
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
            causal=shape.causal,
            window_left=window_left,
            sm_scale=shape.scale,
            q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
        )
        event = torch.cuda.Event(blocking=True)
        event.record()
        self._planned[id(wrapper)] = event
