"""Pooling as sentence-transformers computes it, over packed sequences: the methods (concatenated when a model
names several), the prompt's tokens left out when the model says so, its Dense modules, then the head that
truncates each row to its requested dimensions and L2-normalises it when asked.

Every op is capturable (no host reads), so the same `Pooler` runs eagerly and inside a CUDA graph. Pooling
accumulates in float32 whatever the activations' dtype.

Span rows (several rows from one sequence: late chunking's chunks, TEI's /embed_all tokens) are the mean of their
tokens' states whatever the model's own pooling, then its Dense modules (unless raw) and the head. Their shapes
depend on the spans, so batches with spans run eagerly, never in a graph.

Token vectors (ColBERT's per-token rows, docs/late-interaction.md) are span rows of one token each that go through
the model's multi-vector projection (`token_head`) instead of its Dense modules, then the head; `/embed_all`'s raw
rows and they share every step of the way but that projection.

bge-m3's three outputs from one forward (Batch.all_outputs): a sequence's pooled row, then its span rows (token
vectors, spans of one token), each with its token's weight from the token-weight sparse head put before its values,
so that the weight's column is the first whatever width the step's rows are padded to.

Sparse rows (layers/sparse.py) take the place of the embedding of each sequence that asks for one; a model whose
only output is sparse (SPLADE: no pooling methods) gives nothing else. They too run eagerly only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bouquet.layers.sparse import SparseInputs, place_sparse_rows
from bouquet.model_dir import DenseSpec, PoolingMethod, PoolingSpec

# st_layout.DENSE_ACTIVATIONS (the torch.nn class names a Dense module may save), to the function.
_DENSE_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "Identity": lambda x: x,
    "Tanh": torch.tanh,
    "ReLU": F.relu,
    "GELU": F.gelu,
    "Sigmoid": torch.sigmoid,
    "SiLU": F.silu,
}


@dataclass
class PoolingInputs:
    """Where each sequence's pooled span lies: sequence i is rows cu_seqlens[i]:cu_seqlens[i + 1] of the
    hidden states, of which the first `skip[i]` (its prompt, when the model leaves prompts out) are not pooled."""

    cu_seqlens: torch.Tensor  # [B + 1] int32
    skip: torch.Tensor | None  # [B] int; None: every token is pooled

    def seq_lens(self) -> torch.Tensor:  # [B] int64
        return self.cu_seqlens.diff().long()

    def skipped(self) -> torch.Tensor:  # [B] int64, at most each sequence's length
        seq_lens = self.seq_lens()
        return torch.zeros_like(seq_lens) if self.skip is None else torch.minimum(self.skip.long(), seq_lens)

    def token_layout(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(sequence index, position within the sequence) of every token: [T] int64 each."""
        seq_lens = self.seq_lens()
        # output_size: without it repeat_interleave reads the total back from the device, which a graph forbids.
        seq_ids = torch.repeat_interleave(
            torch.arange(len(seq_lens), device=seq_lens.device), seq_lens, output_size=num_tokens
        )
        positions = torch.arange(num_tokens, device=seq_lens.device) - self.cu_seqlens.long()[seq_ids]
        return seq_ids, positions


# Zero-length sequences (CUDA-graph padding slots) start at T and end before 0: the clamps keep their
# indices in bounds; their rows are dropped afterwards.
def pool_cls(hidden: torch.Tensor, spans: PoolingInputs) -> torch.Tensor:
    """The first pooled token: past the prompt when the prompt is left out and anything follows it."""
    skipped = spans.skipped()
    offset = torch.where(spans.seq_lens() > skipped, skipped, 0)
    first = (spans.cu_seqlens[:-1].long() + offset).clamp(max=hidden.shape[0] - 1)
    return hidden[first].float()


def pool_last(hidden: torch.Tensor, spans: PoolingInputs) -> torch.Tensor:
    last = hidden[(spans.cu_seqlens[1:].long() - 1).clamp(min=0)].float()
    if spans.skip is None:
        return last
    return last * (spans.seq_lens() > spans.skipped()).unsqueeze(1)  # a sequence all prompt pools to zeros


def _masked_sums(hidden: torch.Tensor, spans: PoolingInputs, weight_by_position: bool) -> tuple[torch.Tensor, ...]:
    """Per sequence, the sum of pooled token states and of their weights (1, or the 1-based position)."""
    seq_ids, positions = spans.token_layout(hidden.shape[0])
    weights = hidden.new_ones(hidden.shape[0], dtype=torch.float32)
    if weight_by_position:
        weights = (positions + 1).float()
    if spans.skip is not None:
        weights = weights * (positions >= spans.skipped()[seq_ids])
    num_seqs = len(spans.cu_seqlens) - 1
    sums = hidden.new_zeros(num_seqs, hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, seq_ids, hidden.float() * weights.unsqueeze(1))
    totals = weights.new_zeros(num_seqs).index_add_(0, seq_ids, weights)
    return sums, totals.unsqueeze(1).clamp(min=1e-9)


def pool_mean(hidden: torch.Tensor, spans: PoolingInputs) -> torch.Tensor:
    if spans.skip is None and len(spans.cu_seqlens) == 2 and hidden.shape[0] > 0:
        return hidden.float().mean(0, keepdim=True)  # a lone sequence, in one op
    sums, counts = _masked_sums(hidden, spans, weight_by_position=False)
    return sums / counts


def pool_mean_sqrt_len(hidden: torch.Tensor, spans: PoolingInputs) -> torch.Tensor:
    sums, counts = _masked_sums(hidden, spans, weight_by_position=False)
    return sums / counts.sqrt()


def pool_weighted_mean(hidden: torch.Tensor, spans: PoolingInputs) -> torch.Tensor:
    sums, weights = _masked_sums(hidden, spans, weight_by_position=True)
    return sums / weights


def pool_max(hidden: torch.Tensor, spans: PoolingInputs) -> torch.Tensor:
    seq_ids, positions = spans.token_layout(hidden.shape[0])
    states = hidden.float()
    if spans.skip is not None:
        pooled = (positions >= spans.skipped()[seq_ids]).unsqueeze(1)
        states = states.masked_fill(~pooled, float("-inf"))
    maxima = states.new_full((len(spans.cu_seqlens) - 1, hidden.shape[1]), float("-inf"))
    return maxima.scatter_reduce_(0, seq_ids.unsqueeze(1).expand_as(states), states, "amax")


@dataclass
class SpanInputs:
    """A batch's spans as the pooler reads them (engine/inputs.py builds them from the host arrays): span j is the
    mean of hidden rows token_index[k] over every k with span_index[k] == j."""

    token_index: torch.Tensor  # [L] int64: the hidden row of each token of each span, span after span
    span_index: torch.Tensor  # [L] int64: the span that token belongs to
    lengths: torch.Tensor  # [S] float32: tokens in each span
    dimensions: torch.Tensor  # [S] int: its sequence's
    normalize: torch.Tensor  # [S] bool: its sequence's
    raw: torch.Tensor  # [S] bool: no Dense modules (its sequence's raw_spans)
    order: torch.Tensor  # [R] int64: output row r is row order[r] of cat(sequence rows [B], span rows [S])
    any_raw: bool  # host copies of raw.any() and raw.all()
    all_raw: bool
    token_vectors: torch.Tensor | None = None  # [S] bool: through the multi-vector projection; None: no span is
    all_token_vectors: bool = False  # host copy of token_vectors.all()
    weighted: torch.Tensor | None = None  # [S] bool: its token's weight put first (Batch.all_outputs); None: none


def pool_span_means(hidden: torch.Tensor, spans: SpanInputs) -> torch.Tensor:  # [S, hidden] float32
    sums = hidden.new_zeros(len(spans.lengths), hidden.shape[1], dtype=torch.float32)
    sums.index_add_(0, spans.span_index, hidden[spans.token_index].float())
    return sums / spans.lengths.unsqueeze(1)


def _pad_columns(rows: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(rows, (0, width - rows.shape[1]))


POOLING_METHODS: dict[PoolingMethod, Callable[[torch.Tensor, PoolingInputs], torch.Tensor]] = {
    PoolingMethod.CLS: pool_cls,
    PoolingMethod.MAX: pool_max,
    PoolingMethod.MEAN: pool_mean,
    PoolingMethod.MEAN_SQRT_LEN: pool_mean_sqrt_len,
    PoolingMethod.WEIGHTED_MEAN: pool_weighted_mean,
    PoolingMethod.LAST: pool_last,
}


class Dense(nn.Module):
    """sentence-transformers' Dense module, in float32 on pooled rows; parameter names as it saves them."""

    def __init__(self, spec: DenseSpec):
        super().__init__()
        self.activation = _DENSE_ACTIVATIONS[spec.activation]
        self.linear = nn.Linear(spec.in_features, spec.out_features, bias=spec.bias)
        self.use_residual = spec.residual
        if spec.residual and spec.in_features != spec.out_features:
            self.residual = nn.Linear(spec.in_features, spec.out_features, bias=False)

    def forward(self, rows: torch.Tensor) -> torch.Tensor:  # [B, in] -> [B, out] float32
        out = self.activation(self.linear(rows))
        if not self.use_residual:
            return out
        return out + (self.residual(rows) if hasattr(self, "residual") else rows)


def embedding_head(
    rows: torch.Tensor,  # [B, D] float32
    dimensions: torch.Tensor,  # [B] int, 0 keeps all D
    normalize: torch.Tensor,  # [B] bool
) -> torch.Tensor:  # [B, D] float32; row i is zero beyond dimensions[i]
    width = rows.shape[1]
    keep = torch.where(dimensions > 0, dimensions, width)
    columns = torch.arange(width, device=rows.device)
    truncated = rows * (columns[None, :] < keep[:, None])
    normalized = F.normalize(truncated, p=2.0, dim=1)
    return torch.where(normalize[:, None], normalized, truncated)


class Pooler(nn.Module):
    """Token states to finished rows: the pooling methods, the Dense modules or a score model's head (its raw
    logits are the rows), then the per-request head (truncation, normalisation); sparse rows where asked."""

    def __init__(
        self,
        spec: PoolingSpec,  # no methods: a sparse-only model (SPLADE)
        hidden_size: int,
        dense: tuple[DenseSpec, ...] = (),
        score_head: nn.Module | None = None,  # the model's own classifier, [B, hidden] -> [B, labels]
        sparse_head: nn.Module | None = None,  # (hidden [T, hidden], SparseInputs) -> [S, vocab]
        token_head: tuple[DenseSpec, ...] = (),  # the multi-vector (ColBERT) projection of each token's state
        task: str | None = None,  # "multi_vector": the model's rows are its token vectors (PyLate, HF_ColBERT)
    ):
        super().__init__()
        assert spec.methods or sparse_head is not None, "a pooler without pooling methods needs a sparse head"
        self.spec = spec
        self.task = "embed" if score_head is None else "score"
        self.score_head = score_head
        self.sparse_head = sparse_head
        self.sparse_dimension = 0 if sparse_head is None else sparse_head.vocab_size  # a sparse row's width
        self.methods = [POOLING_METHODS[method] for method in spec.methods]
        self.dimension = hidden_size * len(spec.methods)  # the pooled width; each Dense module then sets it
        for index, layer in enumerate(dense):
            if layer.in_features != self.dimension:
                raise ValueError(
                    f"Dense module {index} ({layer.weight_files[0].parent}) takes {layer.in_features} features, "
                    f"but what comes before it gives {self.dimension}"
                )
            self.dimension = layer.out_features
        self.dense = nn.ModuleList(Dense(layer) for layer in dense)
        if score_head is not None:
            self.dimension = score_head.num_labels
        if not spec.methods:
            self.task, self.dimension = "sparse", self.sparse_dimension
        self.token_head = nn.ModuleList(Dense(layer) for layer in token_head)
        self.token_dimension = token_head[-1].out_features if token_head else 0  # a token vector's width
        if task == "multi_vector":
            self.task = task

    @property
    def name(self) -> str:
        """The pooling's name, for logs: its methods', or a sparse-only model's head's."""
        return self.spec.name or getattr(self.sparse_head, "name", "")

    def forward(
        self,
        hidden: torch.Tensor,  # [T, hidden]
        cu_seqlens: torch.Tensor,  # [B + 1] int32
        prompt_lens: torch.Tensor,  # [B] int: leading prompt tokens of each sequence
        dimensions: torch.Tensor,  # [B] int
        normalize: torch.Tensor,  # [B] bool
        uniform_normalize: bool | None = None,  # the caller knows every row keeps its width and normalises so
        spans: SpanInputs | None = None,  # eager only
        sparse: SparseInputs | None = None,  # eager only
    ) -> torch.Tensor:  # [B, dimension] float32; with spans [R, max(dimension, span rows' width)]; with sparse
        # rows, as wide as the widest row
        if sparse is not None and sparse.every_row:
            return self.sparse_head(hidden, sparse)
        assert self.spec.methods, "a sparse-only model's rows are all sparse"
        rows = self._finish(self._pool(hidden, cu_seqlens, prompt_lens), dimensions, normalize, uniform_normalize)
        if spans is not None:
            span_rows = self.pool_spans(hidden, spans)
            width = max(rows.shape[1], span_rows.shape[1])
            rows = torch.cat([_pad_columns(rows, width), _pad_columns(span_rows, width)])[spans.order]
        return rows if sparse is None else place_sparse_rows(rows, self.sparse_head(hidden, sparse), sparse)

    def _pool(self, hidden: torch.Tensor, cu_seqlens: torch.Tensor, prompt_lens: torch.Tensor) -> torch.Tensor:
        spans = PoolingInputs(cu_seqlens, None if self.spec.include_prompt else prompt_lens)
        pooled = [method(hidden, spans) for method in self.methods]
        rows = pooled[0] if len(pooled) == 1 else torch.cat(pooled, dim=1)
        for layer in self.dense:
            rows = layer(rows)
        return rows if self.score_head is None else self.score_head(rows)

    def _finish(
        self, rows: torch.Tensor, dimensions: torch.Tensor, normalize: torch.Tensor, uniform_normalize: bool | None
    ) -> torch.Tensor:
        if uniform_normalize is None:
            return embedding_head(rows, dimensions, normalize)
        # The eager path knows the batch's options on the host: skip the ops no row asks for (each op after a
        # forward runs from cold caches; docs/benchmarks.md).
        return F.normalize(rows, p=2.0, dim=1) if uniform_normalize else rows

    def pool_spans(self, hidden: torch.Tensor, spans: SpanInputs) -> torch.Tensor:  # [S, width] float32
        """Each span's mean, then the Dense modules for rows that are not raw, then the head. A raw row is the
        model's hidden width; the others are `dimension` wide; mixed, the narrower are padded with zeros."""
        means = pool_span_means(hidden, spans)
        rows = means
        if self.dense and not spans.all_raw and not spans.all_token_vectors:
            for layer in self.dense:
                rows = layer(rows)
            if spans.any_raw:
                rows = _choose(spans.raw, means, rows)
        if spans.token_vectors is not None:
            vectors = means
            for layer in self.token_head:
                vectors = layer(vectors)
            rows = vectors if spans.all_token_vectors else _choose(spans.token_vectors, vectors, rows)
        rows = embedding_head(rows, spans.dimensions, spans.normalize)
        if spans.weighted is None:
            return rows
        weights = self.sparse_head.token_weights(means)[:, None]  # the replica checked the head is TokenWeightHead
        weighted = torch.cat([weights, rows], 1)
        return torch.where(spans.weighted[:, None], weighted, _pad_columns(rows, weighted.shape[1]))


def _choose(where: torch.Tensor, rows: torch.Tensor, others: torch.Tensor) -> torch.Tensor:  # [S, widest]
    """`rows` where `where` ([S] bool), else `others`, the narrower padded with zeros."""
    width = max(rows.shape[1], others.shape[1])
    return torch.where(where[:, None], _pad_columns(rows, width), _pad_columns(others, width))
