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
it keeps alive every tensor the run creates (the recorded pointers address them; those it allocated move into the
thread's arena, graph_arena.py) and refuses any op that computes, since a replay would skip it: a model whose layers
run torch's own ops (a residual add, a LayerNorm) cannot be replayed from kernel calls, and its steps stay eager.
Memory the run did not create is the model's (weights) or the thread's (int8's scratch rows): both outlive the
thread's graphs. Graphs are per engine thread, since two workers replaying one graph would share its buffers, and
bounded in count and bytes.
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
from bouquet.engine.graph_arena import GraphArena, allocated_by, arena_bytes
from bouquet.kernels.recording import KernelProgram, inside_kernel_call, recording
from bouquet.layers.context import ForwardContext, forward_context
from bouquet.layers.layer_stack import run_eagerly

logger = logging.getLogger(__name__)

MAX_TOKENS = 128  # longer steps run eagerly: their Python is a smaller share of their time
# A lone query's lengths, captured at start-up (Engine._capture_short_steps); longer shapes are captured lazily.
# 64: queries of 33-64 tokens (~2% of bench/corpus.py's) met on their first sightings an eager run or a capture, which
# set a fresh server's p99; in the threads' shared arena (graph_arena.py) MiniLM's 64 shapes keep ~14 MB.
SHORT_QUERY_TOKENS = 64
MAX_GRAPHS = 128  # per engine thread and stack of layers: a lone query's 64 shapes, and as many met under load
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
        self.allocated: list[torch.UntypedStorage] = []  # the memory the run itself created (graph_arena.py)

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
        if name in _ALLOCATING:
            self.allocated.extend(t.untyped_storage() for t in outputs)
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
    """Records a run's kernel calls (cuda_graphs.Capturer), within a byte budget shared by one thread's graphs: what
    each graph keeps of its own, plus the arena its allocations move into (graph_arena.py).

    A capture costs about three eager runs, and one found over the budget is thrown away and its step run again:
    under a mix of query lengths, each new shape past the budget cost its step ~4x (20 ms served tails on a 4.5 ms
    float32 query, docs/benchmarks.md). So a graph's cost is predicted first, from the bytes per token the thread's
    graphs kept and allocated so far (the largest ratios seen: stacks of two towers differ), and a bucket that would
    not fit is not captured at all."""

    computes = True  # the capture is an eager run: its output is the capturing step's answer

    def __init__(self, max_bytes: int, max_tokens: int = 0):
        self.bytes_left = max_bytes
        self.max_tokens = max_tokens  # the longest step a graph is captured for: the arena is sized for it
        self.arena = GraphArena()
        self.kept_per_token = 0.0  # 0: no graph yet, nothing to predict from
        self.allocated_per_token = 0.0

    def fits(self, bucket: Bucket) -> bool:
        allocated = self.allocated_per_token * bucket.num_tokens
        growth = allocated if allocated > self.arena.nbytes else 0.0  # a new arena: the old one stays
        return self.kept_per_token * bucket.num_tokens + growth <= self.bytes_left

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[CpuGraph, torch.Tensor]:
        guard = _KeepAndGuard()
        with recording() as program, guard:
            output = fn()
        if not program.calls:
            raise NotReplayable("the layers made no kernel call")
        allocated = allocated_by(program, guard.allocated)
        moved = {s.data_ptr() for s in allocated}
        kept = [t for t in guard.kept if t.untyped_storage().data_ptr() not in moved]
        kept_bytes = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}.values())
        allocated_bytes = arena_bytes(allocated)
        tokens = max(bucket.num_tokens, 1)
        self.kept_per_token = max(self.kept_per_token, kept_bytes / tokens)
        self.allocated_per_token = max(self.allocated_per_token, allocated_bytes / tokens)
        growth = allocated_bytes if allocated_bytes > self.arena.nbytes else 0  # a new arena: the old one stays
        if kept_bytes + growth > self.bytes_left:
            raise NotReplayable(f"its {(kept_bytes + growth) / 2**20:.1f} MB would pass the thread's graph budget")
        # a new arena is sized for the longest step a graph is captured for, as far as the budget allows
        size = min(int(self.allocated_per_token * self.max_tokens * 1.05), self.bytes_left - kept_bytes)
        output, grown = self.arena.relocate(program, allocated, output, size)
        self.bytes_left -= kept_bytes + grown
        logger.debug(
            "a CPU graph of %d kernel calls keeps %.1f MB, %.1f MB moved into the thread's arena of %.1f MB",
            len(program.calls), kept_bytes / 2**20, allocated_bytes / 2**20, self.arena.nbytes / 2**20,
        )  # fmt: skip
        return CpuGraph(program, [*kept, self.arena.memory]), output


@dataclass
class _Inputs:
    """A graph's own copies of what a step brings: a replay copies the step's into them."""

    hidden: torch.Tensor  # [T, D]
    cu_seqlens: torch.Tensor  # [B + 1] int32


class _ThreadGraphs(threading.local):
    """One thread's graphs, per stack of layers (a model may have two: CLIP's towers), one byte budget for all."""

    def __init__(self, max_graphs: int, max_bytes: int, max_tokens: int) -> None:
        self.capturer = CpuCapturer(max_bytes, max_tokens)
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
        self._local = _ThreadGraphs(max_graphs, max_bytes, max_tokens)
        self._reasons: set[str] = set()
        self._lock = threading.Lock()

    def captured_here(self) -> int:
        """How many graphs this thread has captured, over every stack."""
        return sum(graphs.stats.captures for graphs in self._local.stacks.values())

    def bytes_here(self) -> int:
        """The bytes this thread's graphs keep, their arena included."""
        return self.max_bytes - self._local.capturer.bytes_left

    def arena_bytes_here(self) -> int:
        """The bytes of the arena this thread's graphs share (graph_arena.py)."""
        return self._local.capturer.arena.nbytes

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
