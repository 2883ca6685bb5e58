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

from bouquet.layers.attention_backends.base import AttentionBackend, BackendUnavailableError
from bouquet.layers.context import ForwardContext

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace, shared by every wrapper


class FlashInferBackend(AttentionBackend):
    name: ClassVar[str] = "flashinfer"
    supports_cuda_graphs: ClassVar[bool] = True

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
        self._eager: Any = None
        self._graph_wrappers: dict[Hashable, Any] = {}
        self._planned: dict[int, torch.cuda.Event] = {}  # per wrapper: after its last plan's upload

    def prepare(self, ctx: ForwardContext) -> Any:
        if self._eager is None:
            self._eager = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self._workspace_for(ctx), "NHD")
        self._plan(self._eager, ctx)
        return self._eager

    def prepare_capture(self, ctx: ForwardContext, key: Hashable) -> Any:
        num_seqs = len(ctx.seq_lens)
        device = ctx.cu_seqlens.device
        wrapper = self._flashinfer.BatchPrefillWithRaggedKVCacheWrapper(
            self._workspace_for(ctx),
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
            kv_indptr_buf=torch.empty(num_seqs + 1, dtype=torch.int32, device=device),
        )
        self._graph_wrappers[key] = wrapper
        self._plan(wrapper, ctx)
        return wrapper

    def prepare_replay(self, ctx: ForwardContext, key: Hashable) -> None:
        self._plan(self._graph_wrappers[key], ctx)

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        ctx: ForwardContext,
        causal: bool,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        return ctx.attn_metadata.run(q, k, v)

    def _workspace_for(self, ctx: ForwardContext) -> torch.Tensor:
        if self._workspace is None:
            self._workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=ctx.cu_seqlens.device)
        return self._workspace

    def _plan(self, wrapper: Any, ctx: ForwardContext) -> None:
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
            sm_scale=shape.scale,
            q_data_type=shape.dtype,
            kv_data_type=shape.dtype,
        )
        event = torch.cuda.Event(blocking=True)
        event.record()
        self._planned[id(wrapper)] = event
