"""Whole-model CUDA graphs: padded buckets, static buffers, lazy capture, replay; eager above the top bucket.

A batch is padded to the smallest bucket of (total tokens, sequence count) that holds it: pad tokens form one
extra sequence, further sequence slots are zero-length, and pad rows are dropped from the output. Per bucket
the first hit runs eagerly (it warms up lazy initialisation, cuBLAS handles and JIT-compiled kernels), the
second is captured, later hits replay. Every graph draws from one shared memory pool.

The state machine is independent of CUDA: it drives a `Capturer`, so the CPU tests run it with a stand-in
that records calls; `CudaCapturer` is the real one (torch.cuda.CUDAGraph). Only attention backends whose
metadata lives in fixed device buffers (`supports_cuda_graphs`) may be captured.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import numpy as np
import torch

from bouquet.batch import Batch
from bouquet.config import CudaGraphConfig
from bouquet.engine.inputs import ModelInputs, padded_positions, upload
from bouquet.layers.context import ForwardContext

if TYPE_CHECKING:
    from bouquet.layers.attention_backends.base import AttentionBackend

logger = logging.getLogger(__name__)


class Bucket(NamedTuple):
    num_tokens: int
    num_seqs: int
    # The max_seqlen its graph's kernels are launched with (`graph_max_seqlen`); 0: num_tokens.
    max_seqlen: int = 0
    # The attention backend its graph records: with `auto`, the one its table gives the batch's longest sequence
    # (a batch in the same sizes that the table gives another backend has a graph of its own).
    backend: str = ""


class GraphBuckets:
    def __init__(self, token_sizes: tuple[int, ...], seq_sizes: tuple[int, ...]):
        self.token_sizes = token_sizes
        self.seq_sizes = seq_sizes

    @property
    def top(self) -> Bucket:
        return Bucket(self.token_sizes[-1], self.seq_sizes[-1])

    def bucket_for(self, num_tokens: int, num_seqs: int) -> Bucket | None:
        """The smallest bucket holding the batch and its pad sequence; None above the top (run eagerly)."""
        i = bisect.bisect_left(self.token_sizes, num_tokens)
        if i == len(self.token_sizes):
            return None
        padded_tokens = self.token_sizes[i]
        # Pad tokens need a sequence slot of their own, so they never join (and change) a real sequence.
        needed_seqs = num_seqs + (padded_tokens > num_tokens)
        j = bisect.bisect_left(self.seq_sizes, needed_seqs)
        if j == len(self.seq_sizes):
            return None
        return Bucket(padded_tokens, self.seq_sizes[j])


def graph_max_seqlen(padded: Batch, num_tokens: int) -> int:
    """The max_seqlen a graph's kernels run with: the longest sequence of the padded batch, the pad sequence
    included, rounded up to a power of two (at least 16), at most the bucket's tokens. It must bound every
    sequence a replay meets, so it is part of the bucket; the bucket's token count would do, but FlashAttention
    launches blocks for max_seqlen rows of every sequence slot: 4,096 tokens of 50-token sequences would launch
    64 times the blocks that have rows."""
    longest = int(np.diff(padded.cu_seqlens).max(initial=1))
    return min(num_tokens, 1 << max(4, (longest - 1).bit_length()))


def pad_batch(batch: Batch, bucket: Bucket) -> Batch:
    """`batch` padded to `bucket`; sequences 0..B-1 and their tokens are unchanged."""
    pad_tokens = bucket.num_tokens - batch.num_tokens
    pad_seqs = bucket.num_seqs - batch.num_seqs
    assert pad_tokens >= 0 and pad_seqs >= (pad_tokens > 0), f"{batch.num_tokens}/{batch.num_seqs} > {bucket}"
    # Token id 0 exists in every vocabulary; the pad sequence's states are never read back.
    input_ids = np.pad(batch.input_ids, (0, pad_tokens))
    cu_seqlens = np.pad(batch.cu_seqlens, (0, pad_seqs), constant_values=bucket.num_tokens)
    token_type_ids = None if batch.token_type_ids is None else np.pad(batch.token_type_ids, (0, pad_tokens))
    return Batch(
        input_ids=input_ids,
        cu_seqlens=cu_seqlens.astype(np.int32),
        dimensions=np.pad(batch.dimensions, (0, pad_seqs)),
        normalize=np.pad(batch.normalize, (0, pad_seqs)),
        prompt_lens=np.pad(batch.prompt_lens, (0, pad_seqs)),
        encodings=np.pad(batch.encodings, (0, pad_seqs)),
        token_type_ids=token_type_ids,
    )


class StaticBuffers:
    """Device input buffers sized for the top bucket; every bucket uses leading views of them."""

    def __init__(self, top: Bucket, device: torch.device):
        # torch.empty, not zeros: a fill kernel would run on the default stream, which does not order with
        # the engine's stream, so it could land after the first batch is loaded. `load` writes every element
        # a bucket's graph reads.
        def empty(size: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(size, dtype=dtype, device=device)

        self.input_ids = empty(top.num_tokens, torch.long)
        self.positions = empty(top.num_tokens, torch.long)
        self.token_type_ids = empty(top.num_tokens, torch.long)
        self.cu_seqlens = empty(top.num_seqs + 1, torch.int32)
        self.dimensions = empty(top.num_seqs, torch.int32)
        self.normalize = empty(top.num_seqs, torch.bool)
        self.prompt_lens = empty(top.num_seqs, torch.int32)

    def load(self, padded: Batch, positions: np.ndarray, bucket: Bucket) -> ModelInputs:
        """Copies `padded` into the buffers (stream-ordered, so a replay still in flight reads its own data)."""
        tokens, seqs = bucket.num_tokens, bucket.num_seqs
        token_types = padded.token_type_ids if padded.token_type_ids is not None else np.zeros(tokens, np.int32)
        hosts = [padded.input_ids, positions, token_types, padded.cu_seqlens]
        hosts += [padded.dimensions, padded.normalize, padded.prompt_lens]
        views = [
            self.input_ids[:tokens],
            self.positions[:tokens],
            self.token_type_ids[:tokens],
            self.cu_seqlens[: seqs + 1],
            self.dimensions[:seqs],
            self.normalize[:seqs],
            self.prompt_lens[:seqs],
        ]
        for view, uploaded in zip(views, upload(hosts, self.input_ids.device), strict=True):
            view.copy_(uploaded)
        return ModelInputs(
            *views,
            np.diff(padded.cu_seqlens).tolist(),
            # Fixed per bucket: kernels bake max_seqlen into their launch grid at capture.
            max_seqlen=bucket.max_seqlen or tokens,
        )


class Graph(Protocol):
    def replay(self) -> None: ...


class Capturer(Protocol):
    # Whether recording runs `fn` for real (a CPU graph's capture is an eager run), so that the capturing step's
    # output is already its answer; a CUDA capture only records, and the step replays.
    computes: bool

    def fits(self, bucket: Bucket) -> bool:
        """Whether a graph of this bucket would be kept, judged before capturing it (a capture that would only be
        thrown away costs a CPU step several eager runs)."""
        ...

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[Graph, torch.Tensor]:
        """Records `fn` once; returns the graph and `fn`'s output tensor, which every replay rewrites."""
        ...


class CudaCapturer:
    """torch.cuda.CUDAGraph capture into one memory pool shared by all graphs (unverified without a GPU)."""

    computes = False

    def __init__(self, stream: torch.cuda.Stream | None = None):
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = stream

    def fits(self, bucket: Bucket) -> bool:
        return True  # graphs share one memory pool: the bound is `max_graphs`

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[Graph, torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        # thread_local: the readback thread may synchronize finished events while this thread captures;
        # the default "global" mode would make those calls fail.
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            output = fn()
        return graph, output


class BucketState(Enum):
    WARM = "warm"  # ran eagerly once
    CAPTURED = "captured"
    EAGER = "eager"  # the graph bound was reached, or its capture failed, when it was due: stays eager


@dataclass
class GraphStats:
    eager: int = 0
    captures: int = 0
    replays: int = 0


class LazyGraphs:
    """Per bucket: first hit eager, second captured, later replayed; at most `max_graphs` graphs kept.

    A bucket due for capture once the bound is reached stays eager rather than evicting another graph:
    evicting and recapturing in turn would cost a capture per step under a cycling mix of shapes. A bucket
    whose capture fails (a kernel that cannot be captured, a backend's plan that does not fit its buffers)
    stays eager too, with the error logged and kept in `capture_errors`: retrying would fail every step.
    """

    def __init__(self, capturer: Capturer, max_graphs: int, kind: str = "CUDA graph", quiet: bool = False):
        self.capturer = capturer
        self.max_graphs = max_graphs
        self.kind = kind  # as the log names it
        # Captures and failures logged at DEBUG: CPU graphs are many and small, and fail by design where a
        # model's layers run torch's own ops (their owner says so once).
        self.capture_level, self.failure_level = (logging.DEBUG,) * 2 if quiet else (logging.INFO, logging.WARNING)
        self.states: dict[Bucket, BucketState] = {}
        self.graphs: dict[Bucket, tuple[Graph, torch.Tensor]] = {}
        self.capture_errors: dict[Bucket, str] = {}
        self.stats = GraphStats()

    def run(
        self,
        bucket: Bucket,
        eager: Callable[[], torch.Tensor],
        capture: Callable[[], Callable[[], torch.Tensor]],
        before_replay: Callable[[], None],
    ) -> torch.Tensor:
        """`capture` does the host-side set-up outside the graph and returns the function to record."""
        state = self.states.get(bucket)
        if state is BucketState.WARM:
            state = self._capture(bucket, capture)
            if state is BucketState.CAPTURED and self.capturer.computes:
                return self.graphs[bucket][1]
        if state is BucketState.CAPTURED:
            graph, output = self.graphs[bucket]
            before_replay()
            graph.replay()
            self.stats.replays += 1
            return output
        self.states.setdefault(bucket, BucketState.WARM)
        self.stats.eager += 1
        return eager()

    def _capture(self, bucket: Bucket, capture: Callable[[], Callable[[], torch.Tensor]]) -> BucketState:
        if len(self.graphs) >= self.max_graphs:
            self.states[bucket] = BucketState.EAGER
            return BucketState.EAGER
        if not self.capturer.fits(bucket):
            self.capture_errors[bucket] = "its graph would pass the thread's graph budget"
            self.states[bucket] = BucketState.EAGER
            return BucketState.EAGER
        try:
            self.graphs[bucket] = self.capturer.capture(capture(), bucket)
        except Exception as error:
            logger.log(
                self.failure_level, "%s capture failed for %s tokens x %s sequences (max_seqlen %s, %s), eager from "
                "now on: %r", self.kind, *bucket, error,
            )  # fmt: skip
            self.capture_errors[bucket] = f"{type(error).__name__}: {error}"
            self.states[bucket] = BucketState.EAGER
            return BucketState.EAGER
        self.stats.captures += 1
        self.states[bucket] = BucketState.CAPTURED
        logger.log(
            self.capture_level, "captured a %s for %s tokens x %s sequences (max_seqlen %s, %s)", self.kind, *bucket
        )
        return BucketState.CAPTURED


ForwardFn = Callable[[ModelInputs, Callable[[ForwardContext], Any]], torch.Tensor]


class CudaGraphRunner:
    """Pads a batch to its bucket and runs it through the lazy graphs; None above the top bucket, or for a batch
    with spans or sparse rows (all run eagerly)."""

    def __init__(
        self,
        config: CudaGraphConfig,
        device: torch.device,
        backend: AttentionBackend,
        forward: ForwardFn,
        capturer: Capturer,
    ):
        assert backend.supports_cuda_graphs, f"attention backend {backend.name!r} cannot run inside a CUDA graph"
        self.buckets = GraphBuckets(config.token_buckets, config.seq_buckets)
        self.buffers = StaticBuffers(self.buckets.top, device)
        self.graphs = LazyGraphs(capturer, config.max_graphs)
        self.backend = backend
        self.forward = forward

    def run(self, batch: Batch) -> torch.Tensor | None:  # [B, dim] float32 on the device
        if batch.cu_spans is not None or batch.any_sparse:  # their rows' shapes follow the batch: eager
            return None
        if batch.pixel_values is not None:  # images are not in the static buffers: eager
            return None
        # By the batch's own longest sequence: the graph's context holds the bucket's token count instead.
        backend = self.backend.graph_backend(int(batch.seq_lens.max(initial=0)))
        bucket = self.buckets.bucket_for(batch.num_tokens, batch.num_seqs)
        if bucket is None or backend is None:
            return None
        padded = pad_batch(batch, bucket)
        bucket = bucket._replace(max_seqlen=graph_max_seqlen(padded, bucket.num_tokens), backend=backend.name)
        inputs = self.buffers.load(padded, padded_positions(padded, batch.num_tokens), bucket)
        run_on = on_backend(backend, bound=self.backend)

        def capture() -> Callable[[], torch.Tensor]:
            # Planning (FlashInfer's plan() copies and may sync) must happen before the capture, not in it.
            metadata = backend.prepare_capture(inputs.context(), bucket)
            return lambda: self.forward(inputs, run_on(lambda ctx: metadata))

        output = self.graphs.run(
            bucket,
            # The warm-up runs the backend the capture records: its first call (a JIT compile, a lazy
            # allocation) must not happen inside the capture.
            eager=lambda: self.forward(inputs, run_on(backend.prepare)),
            capture=capture,
            before_replay=lambda: backend.prepare_replay(inputs.context(), bucket),
        )
        return output[: batch.num_seqs]  # pad rows dropped


Prepare = Callable[[ForwardContext], Any]


def on_backend(backend: AttentionBackend, bound: AttentionBackend) -> Callable[[Prepare], Prepare]:
    """Wraps a forward's planning so that its layers run `backend` (one of those `bound`, the layers' own, may
    dispatch to) with the metadata it plans."""

    def wrap(prepare: Prepare) -> Prepare:
        def planned(ctx: ForwardContext) -> Any:
            ctx.backend = None if backend is bound else backend
            return prepare(ctx)

        return planned

    return wrap
