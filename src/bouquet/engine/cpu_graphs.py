"""CPU graphs: a short step's stack of layers recorded as its kernel calls and replayed for later steps of the
same shape, without the Python between the calls.

Where every op in a model's layers is one of bouquet's C kernels or a torch op called as one (int8 linears, with
their products on AMX tiles or oneDNN's; bfloat16 linears on AMX tiles; float32 linears of short steps by
layers/f32_short.py's kernel, or on oneDNN's packed weights as int8 keeps the QKV projections on CPUs without VNNI;
`cpu_varlen` attention), a short step's time is mostly the Python around them: modules, views, allocations, argument
packing (docs/benchmarks.md). A step is keyed by its (tokens, sequences, attention backend) within its stack of
layers; as CUDA graphs do (cuda_graphs.LazyGraphs), a key's first step runs eagerly, its second is captured, later
ones replay.

Capture runs the layers eagerly on buffers of the graph's own, the hidden states and cu_seqlens that a replay
copies the step's into, while kernels/recording.py keeps every kernel call. A dispatch mode watches the run:
it keeps alive every tensor the run creates (the recorded pointers address them) and refuses any op that
computes, since a replay would skip it: a model whose layers run torch's own ops (a residual add, a LayerNorm)
cannot be replayed from kernel calls, and its steps stay eager. Memory the run did not create is the model's
(weights) or the thread's (int8's scratch rows): both outlive the thread's graphs. Graphs are per engine thread,
since two workers replaying one graph would share its buffers, and bounded in count and bytes.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from bouquet.engine.cuda_graphs import Bucket, BucketState, LazyGraphs
from bouquet.kernels.recording import KernelProgram, inside_kernel_call, recording
from bouquet.layers.context import ForwardContext, forward_context
from bouquet.layers.layer_stack import run_eagerly

logger = logging.getLogger(__name__)

MAX_TOKENS = 128  # longer steps run eagerly: their Python is a smaller share of their time
# A lone query's lengths, captured at start-up (Engine._capture_short_steps); longer shapes are captured lazily.
SHORT_QUERY_TOKENS = 32
MAX_GRAPHS = 64  # per engine thread and stack of layers
# Per engine thread, the tensors its graphs keep (MiniLM: ~0.1 MB a token; docs/memory.md): graphs do not share
# memory, since buffers that outlive a capture (int8's scratch rows) cannot be told from those that do not.
MAX_BYTES = 64 * 2**20
# Ops that only allocate: what they return is written by the kernels that follow, which the graph records.
_ALLOCATING = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty"}


class NotReplayable(RuntimeError):
    """The layers did work outside bouquet's kernels, or their graph would not fit the thread's budget."""


class _KeepAndGuard(TorchDispatchMode):
    """Keeps every tensor an op returns; refuses ops that compute, and views that turn out to be copies."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: list[torch.Tensor] = []

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # False: __torch_dispatch__ is not wrapped to keep torch.compile out of it, a wrapper whose first call
        # imports torch._dynamo (2.5 s and 74 MB here, on a request's step); nothing is compiled under this mode.
        return False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if inside_kernel_call():  # a torch op the recording keeps as a call: a replay runs it again
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        name = func._schema.name
        given = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        returned_as_given = all(any(o is t for t in given) for o in outputs)  # `.to` its own dtype
        if name not in _ALLOCATING and not returned_as_given and not (func.is_view and _shares_storage(outputs, given)):
            raise NotReplayable(f"{name} computes outside bouquet's kernels")
        self.kept.extend(outputs)
        return out


def _shares_storage(outputs: list[torch.Tensor], given: list[torch.Tensor]) -> bool:
    """Whether every output views an input's memory: a view op may still copy (a reshape of strided rows)."""
    storages = {t.untyped_storage().data_ptr() for t in given}
    return all(t.untyped_storage().data_ptr() in storages for t in outputs)


@dataclass
class CpuGraph:
    program: KernelProgram
    kept: list[torch.Tensor]  # every tensor the recorded calls may address, besides the model's and the thread's

    def replay(self) -> None:
        self.program.replay()


class CpuCapturer:
    """Records a run's kernel calls (cuda_graphs.Capturer), within a byte budget shared by one thread's graphs.

    A capture costs about three eager runs, and one found over the budget is thrown away and its step run again:
    under a mix of query lengths, each new shape past the budget cost its step ~4x (20 ms served tails on a 4.5 ms
    float32 query, docs/benchmarks.md). So a graph's size is predicted first, from the bytes per token the thread's
    graphs kept so far (the largest ratio seen: stacks of two towers differ), and a bucket that would not fit is not
    captured at all."""

    computes = True  # the capture is an eager run: its output is the capturing step's answer

    def __init__(self, max_bytes: int):
        self.bytes_left = max_bytes
        self.bytes_per_token = 0.0  # 0: no graph yet, nothing to predict from

    def fits(self, bucket: Bucket) -> bool:
        return self.bytes_per_token * bucket.num_tokens <= self.bytes_left

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[CpuGraph, torch.Tensor]:
        guard = _KeepAndGuard()
        with recording() as program, guard:
            output = fn()
        size = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in guard.kept}.values())
        self.bytes_per_token = max(self.bytes_per_token, size / max(bucket.num_tokens, 1))
        if size > self.bytes_left:
            raise NotReplayable(f"its {size / 2**20:.1f} MB would pass the thread's graph budget")
        if not program.calls:
            raise NotReplayable("the layers made no kernel call")
        self.bytes_left -= size
        logger.debug("a CPU graph of %d kernel calls keeps %.1f MB", len(program.calls), size / 2**20)
        return CpuGraph(program, guard.kept), output


@dataclass
class _Inputs:
    """A graph's own copies of what a step brings: a replay copies the step's into them."""

    hidden: torch.Tensor  # [T, D]
    cu_seqlens: torch.Tensor  # [B + 1] int32


class _ThreadGraphs(threading.local):
    """One thread's graphs, per stack of layers (a model may have two: CLIP's towers), one byte budget for all."""

    def __init__(self, max_graphs: int, max_bytes: int) -> None:
        self.capturer = CpuCapturer(max_bytes)
        self.max_graphs = max_graphs
        self.stacks: dict[int, LazyGraphs] = {}  # by the stack's id: a model's ModuleList lives as long as it
        self.inputs: dict[tuple[int, Bucket], _Inputs] = {}

    def of(self, stack: int) -> LazyGraphs:
        if stack not in self.stacks:
            self.stacks[stack] = LazyGraphs(self.capturer, self.max_graphs, "CPU graph", quiet=True)
        return self.stacks[stack]


class CpuLayerGraphs:
    """The engine's CPU graphs; `bind` gives a step's forward context its `layer_graphs`."""

    def __init__(self, max_tokens: int = MAX_TOKENS, max_graphs: int = MAX_GRAPHS, max_bytes: int = MAX_BYTES):
        self.max_tokens = max_tokens
        self.max_bytes = max_bytes
        self._local = _ThreadGraphs(max_graphs, max_bytes)
        self._reasons: set[str] = set()
        self._lock = threading.Lock()

    def captured_here(self) -> int:
        """How many graphs this thread has captured, over every stack."""
        return sum(graphs.stats.captures for graphs in self._local.stacks.values())

    def bytes_here(self) -> int:
        """The bytes this thread's graphs keep."""
        return self.max_bytes - self._local.capturer.bytes_left

    def thread_graphs(self, layers: Iterable[nn.Module]) -> LazyGraphs:
        """This thread's graphs of a stack of layers (their states and counts, for tests and logs)."""
        return self._local.of(id(layers))

    def bind(
        self, ctx: ForwardContext, prepare: Callable[[ForwardContext], Any], backend: str
    ) -> Callable[[Sequence[nn.Module], torch.Tensor], torch.Tensor] | None:
        """What runs the layers of the step whose context is `ctx`: None (eager) above the token bound or when
        the step plans its attention on a backend other than the layers' own (ColBERT's key lengths)."""
        num_tokens = sum(ctx.seq_lens)
        if ctx.backend is not None or num_tokens > self.max_tokens:
            return None
        bucket = Bucket(num_tokens, len(ctx.seq_lens), 0, backend)
        return lambda layers, hidden: self.run(bucket, layers, hidden, ctx, prepare)

    def run(
        self,
        bucket: Bucket,
        layers: Iterable[nn.Module],
        hidden: torch.Tensor,
        ctx: ForwardContext,
        prepare: Callable[[ForwardContext], Any],
    ) -> torch.Tensor:
        local, key = self._local, (id(layers), bucket)
        graphs = local.of(id(layers))

        def capture() -> Callable[[], torch.Tensor]:
            inputs = local.inputs[key] = _Inputs(hidden.clone(), ctx.cu_seqlens.clone())
            own = replace(ctx, cu_seqlens=inputs.cu_seqlens, attn_metadata=None, layer_graphs=None)
            own.attn_metadata = prepare(own)  # the backend's metadata on the graph's cu_seqlens

            def layers_on_own_inputs() -> torch.Tensor:
                with forward_context(own):
                    return run_eagerly(layers, inputs.hidden)

            return layers_on_own_inputs

        def before_replay() -> None:
            inputs = local.inputs[key]
            inputs.hidden.copy_(hidden)
            inputs.cu_seqlens.copy_(ctx.cu_seqlens)

        output = graphs.run(bucket, lambda: run_eagerly(layers, hidden), capture, before_replay)
        state = graphs.states.get(bucket)
        if state is BucketState.EAGER:
            local.inputs.pop(key, None)
            self._explain(graphs.capture_errors.get(bucket))
        # The graph's output is rewritten by its next replay: the step gets its own copy.
        return output.clone() if state is BucketState.CAPTURED else output

    def _explain(self, reason: str | None) -> None:
        """Says once per reason why a step shape stays eager (a model's layers with torch's ops: every shape)."""
        if reason is None:
            return
        with self._lock:
            if reason in self._reasons:
                return
            self._reasons.add(reason)
        logger.info("CPU graphs: a step shape stays eager: %s", reason)
