"""The data plane: one path from a packed batch to finished rows, the same on every device.

`execute` replays a captured CUDA graph when the batch's bucket has one and runs the model and its pooler
eagerly otherwise (on the CPU always). The device differences live elsewhere: how a step's rows leave the
device (engine.py) and how graphs pad, capture and replay (cuda_graphs.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from bouquet.batch import Batch
from bouquet.engine.cpu_graphs import CpuLayerGraphs
from bouquet.engine.cuda_graphs import CudaGraphRunner
from bouquet.engine.inputs import ModelInputs, prepare_inputs, prepare_sparse
from bouquet.engine.memory import pad_to_bucket
from bouquet.layers.attention import bind_backend
from bouquet.layers.attention_backends import AttentionBackend, create_attention_backend
from bouquet.layers.context import ForwardContext, forward_context
from bouquet.layers.pooling import Pooler
from bouquet.layers.sparse import SparseInputs


class ModelRunner:
    def __init__(self, model: nn.Module, pooler: Pooler, backend: AttentionBackend, device: torch.device):
        self.model = model
        self.pooler = pooler
        self.device = device
        self.graphs: CudaGraphRunner | None = None  # set by the engine on CUDA when the backend can be captured
        self.layer_graphs: CpuLayerGraphs | None = None  # set by the engine on the CPU (--cpu-graphs)
        self.token_buckets = 0  # eager steps' token counts per doubling (engine/memory.py); 0: exact
        self.placeholder = _placeholder(model)
        self._key_lens_backend: AttentionBackend | None = None  # SDPA, for batches whose keys end early
        self.set_backend(backend)

    def set_backend(self, backend: AttentionBackend) -> None:
        self.backend = backend
        bind_backend(self.model, backend)

    def execute(self, batch: Batch) -> torch.Tensor:  # [rows, dim] float32 on the device: one per sequence or span
        if batch.pixel_values is not None and not getattr(self.model, "takes_images", False):
            raise ValueError(f"this model ({type(self.model).__name__}) takes no images")
        if batch.patch_images != getattr(self.model, "variable_images", False) and batch.pixel_values is not None:
            kind = "images of any size inside token sequences" if batch.patch_images else "fixed-size images"
            raise ValueError(f"this model ({type(self.model).__name__}) takes no {kind}")
        if self.graphs is not None and batch.key_lens is None and (rows := self.graphs.run(batch)) is not None:
            return rows
        padded = pad_to_bucket(batch, self.token_buckets, self.placeholder)
        inputs = prepare_inputs(padded, self.device, self._sparse_inputs(batch), real_tokens=batch.num_tokens)
        rows = self.forward(inputs, self.backend.prepare, uniform_normalize(batch))
        return rows[: batch.num_rows]  # the pad sequence's row, if any, dropped

    def _sparse_inputs(self, batch: Batch) -> SparseInputs | None:
        if batch.any_sparse and self.pooler.sparse_head is None:
            raise ValueError("this model gives no sparse rows: it has no SPLADE head or sparse_linear.pt")
        return prepare_sparse(batch, self.device, every_seq=self.pooler.task == "sparse")

    def forward(
        self,
        inputs: ModelInputs,
        prepare: Callable[[ForwardContext], Any],  # the attention metadata: planned now, or a graph's own
        uniform_normalize: bool | None = None,
    ) -> torch.Tensor:  # [B, dim] float32 on the device
        hidden = self.encode(inputs, prepare)
        return self.pooler(
            hidden, inputs.cu_seqlens, inputs.prompt_lens, inputs.dimensions, inputs.normalize, uniform_normalize,
            inputs.spans, inputs.sparse,
        )  # fmt: skip

    def encode(self, inputs: ModelInputs, prepare: Callable[[ForwardContext], Any]) -> torch.Tensor:
        """[T, hidden] token states: the model alone."""
        ctx = inputs.context()
        if ctx.key_lens is not None and not self.backend.supports_key_lens:
            ctx.backend = self.key_lens_backend()
            prepare = ctx.backend.prepare
        ctx.attn_metadata = prepare(ctx)
        if self.layer_graphs is not None and inputs.pixel_values is None:
            ctx.layer_graphs = self.layer_graphs.bind(ctx, prepare, self.backend.backend_for(ctx.max_seqlen))
        with forward_context(ctx):
            if inputs.pixel_values is None:
                return self.model(inputs.input_ids, inputs.positions, inputs.token_type_ids)
            # only models that declare `takes_images` get here; which sequences hold which images: Batch
            images = {"pixel_values": inputs.pixel_values, "cu_images": inputs.cu_images}
            if inputs.image_grid_thw is not None:  # patch images (Qwen3-VL's, SigLIP 2's)
                images["image_grid_thw"] = inputs.image_grid_thw
            return self.model(inputs.input_ids, inputs.positions, **images)

    def key_lens_backend(self) -> AttentionBackend:
        """SDPA for a batch whose keys end before its sequences do (ColBERT's query expansion): its key mask does
        it at no extra cost; the other backends have no such mask. Bound to the model's shape at first use."""
        if self._key_lens_backend is None:
            backend = create_attention_backend("sdpa")
            assert self.backend.shape is not None, "the engine binds its backend before any batch"
            backend.bind(self.backend.shape)
            self._key_lens_backend = backend
        return self._key_lens_backend


def uniform_normalize(batch: Batch) -> bool | None:
    """Whether every row keeps its full width and is normalised (True) or every row is left raw (False);
    None when rows differ, so that the pooler's general head runs. Read from the batch's host arrays."""
    if batch.dimensions.any():
        return None
    if batch.normalize.all():
        return True
    return False if not batch.normalize.any() else None


def _placeholder(model: nn.Module) -> tuple[int, int] | None:
    """(merge size, placeholder token id) of a model whose images sit inside token sequences (Qwen3-VL)."""
    if not getattr(model, "variable_images", False):
        return None
    _, merge, placeholder_id, image_sequences, _ = model.image_patches
    return None if image_sequences else (merge, placeholder_id)
