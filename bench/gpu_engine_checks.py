"""bench/gpu_check.py's engine sections: the matrix-product rate, the attention backends and their `auto` table,
and per model bfloat16 parity, graph == eager, steps in flight, eager against graph latency and saturation."""

from __future__ import annotations

import logging
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gpu_report import Report
from gpu_setup import (
    Run,
    eager_rows,
    graph_stats,
    make_engine,
    min_cosine,
    random_batch,
    release,
    step_seconds,
    sync,
)

from bouquet.engine.engine import Engine
from bouquet.layers.attention import Attention
from bouquet.layers.attention_backends import AttentionShape
from bouquet.layers.attention_backends.selection import GPU_BACKENDS, BackendTable, load_backends
from bouquet.layers.attention_backends.timing import measure_timings
from bouquet.layers.context import ForwardContext
from bouquet.layers.linear import Linear

logger = logging.getLogger("gpu_check")


def matmul(run: Run) -> None:
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    n = 8192 if not run.dry_run else 256
    a, b = torch.randn(n, n, device=run.device, dtype=dtype), torch.randn(n, n, device=run.device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(run.device)
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ b
    sync(run.device)
    tflops = 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12
    run.report.shared["matmul_tflops"] = tflops
    run.report.add(f"{dtype} matrix-product rate", f"{tflops:.3g} TFLOP/s (n^3 matmuls, this run)")


def load_attention_backends(run: Run, report: bool = True) -> None:
    """Imports only (no kernel runs, no JIT compiles): which backends this machine has, and why not the rest."""
    loaded, missing = load_backends(GPU_BACKENDS if not run.dry_run else ("sdpa",))
    run.loaded.update(loaded)
    if not report:
        return
    for name, reason in missing.items():
        run.report.add(f"backend {name}", f"NOT LOADED: {reason[:300]}")
    for name, backend in loaded.items():
        run.report.add(f"backend {name}", f"loaded: {getattr(backend, 'version', type(backend).__name__)}")


def time_backends(run: Run) -> None:
    """Per-length attention timings on Qwen3-0.6B's shape, and the `auto` table they make."""
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    shape = AttentionShape(16, 8, 128, causal=True, dtype=dtype)
    lengths = (64, 128, 256, 512, 1024, 2048, 4096, 8192) if not run.dry_run else (16, 32)
    timings = measure_timings(run.loaded, shape, torch.device(run.device), lengths)
    for length, times in timings.items():
        cells = ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in sorted(times.items(), key=lambda kv: kv[1]))
        run.report.add(f"attention, {length}-token sequences (8192 tokens)", cells or "every backend failed")
    table = BackendTable.from_timings(timings)
    (run.out_dir / "attention-table.json").write_text(table.to_json())
    run.report.shared["table_written"] = True
    run.report.note(f"auto table (written to attention-table.json): {table.rows}")


# (name, heads, kv heads, head_dim, causal, window, zero-length slots after the sequences as graph buckets have)
KERNEL_CASES = (
    ("qwen3 causal", 16, 8, 128, True, None, 2),
    ("minilm", 12, 12, 32, False, None, 2),
    ("causal window 20", 8, 2, 64, True, (20, 0), 0),
    ("window 5 each side", 8, 8, 64, False, (5, 5), 0),
)
KERNEL_SEQ_LENS = [1, 7, 40, 130, 300, 17, 512]


def kernels_vs_reference(run: Run) -> None:
    """Each loaded backend against each sequence alone through float32 SDPA with its mask written out, on the
    same inputs: causal and not, grouped-query heads, head sizes 32 to 128, sliding windows, and zero-length
    sequences after the real ones with max_seqlen the total, as a CUDA graph's bucket runs them."""
    device = torch.device(run.device)
    dtype = torch.bfloat16 if run.device == "cuda" else torch.float32
    for name, backend in run.loaded.items():
        errors = []
        for case, heads, kv_heads, head_dim, causal, window, empty in KERNEL_CASES:
            shape = AttentionShape(heads, kv_heads, head_dim, causal, dtype, windows=(window,) if window else ())
            if not backend.can_run(shape):
                continue
            empty = empty if backend.supports_cuda_graphs else 0  # only a graph pads with empty sequences
            seq_lens = KERNEL_SEQ_LENS + [0] * empty
            generator = torch.Generator().manual_seed(0)
            q, k, v = (
                torch.randn(sum(seq_lens), h, head_dim, generator=generator) * 2 for h in (heads, kv_heads, kv_heads)
            )
            backend.bind(shape)
            cu_seqlens = torch.tensor(np.cumsum([0, *seq_lens]), dtype=torch.int32, device=device)
            max_seqlen = sum(seq_lens) if empty else max(seq_lens)
            ctx = ForwardContext(cu_seqlens, max_seqlen, seq_lens)
            ctx.attn_metadata = backend.prepare(ctx)
            inputs = [t.to(device, dtype) for t in (q, k, v)]
            out = backend.forward(*inputs, ctx, causal, shape.scale, window).float()
            expected = masked_reference(*(t.to(device).float() for t in (q, k, v)), seq_lens, causal, window)
            errors.append(f"{case} {(out - expected).abs().max().item():.1e}")
        run.report.add(f"attention kernel {name} vs float32 reference", "max abs error: " + ", ".join(errors), "< 3e-2")


def masked_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: list[int], causal: bool, window: tuple[int, int] | None
) -> torch.Tensor:  # [T, H, D] float32: each sequence alone, key j seen by query i when i - left <= j <= i + right
    outs, start = [], 0
    for length in seq_lens:
        if not length:
            continue
        rows = slice(start, start + length)
        qs, ks, vs = (t[rows].transpose(0, 1)[None] for t in (q, k, v))
        positions = torch.arange(length, device=q.device)
        offset = positions[None, :] - positions[:, None]
        left, right = window or (length, length)
        allowed = (offset >= -left) & (offset <= (0 if causal else right))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=allowed, enable_gqa=True)[0].transpose(0, 1))
        start += length
    return torch.cat(outs)


class GraphEngine:
    """A model's engine with CUDA graphs, started by the first section that needs it in this process (an attempt
    resumed in a fresh process starts its own)."""

    def __init__(self, run: Run, path: Path, backend: str):
        self.run, self.path, self.backend = run, path, backend
        self.engine: Engine | None = None

    def get(self) -> Engine:
        if self.engine is None:
            self.engine = make_engine(self.path, self.run.device, "bfloat16", self.backend, graphs=True)
        return self.engine

    def close(self) -> None:
        release(self.engine)
        self.engine = None


def check_model(run: Run, name: str, path: Path) -> None:
    """Parity, then the graph engine's checks; each a section of its own."""
    run.section(f"{name}: first call on each capturable backend", partial(usable_backend, run, name, path), 180)
    backend = run.usable.get(name)
    vocab = run.vocab[name]
    mixed = [16, 33, 64, 100, 128, 200, 256, 500] if not run.dry_run else [5, 9, 16]
    run.section(f"{name}: bfloat16 parity", partial(parity, run, name, path, backend or "sdpa", mixed), 150)
    if backend is None and not run.dry_run:
        run.report.add(f"{name}: CUDA graphs", "SKIPPED: no capturable backend ran this model")
        return
    graphs = GraphEngine(run, path, backend or "sdpa")
    report = run.report
    equal = partial(graph_equals_eager, report, name, seq_lens=mixed[:5], vocab=vocab)
    run.section(f"{name}: graph == eager", lambda: equal(engine=graphs.get()), 150)
    run.section(f"{name}: steps in flight", lambda: steps_in_flight(report, name, graphs.get(), vocab), 90)
    for seqs, length in ((1, 16), (8, 64)):
        label = f"{name}: eager vs graph, {seqs} x {length} tokens"
        repeats = 3 if run.dry_run else 50
        check = partial(eager_vs_graph, report, label, (seqs, length), vocab, repeats)
        run.section(label, lambda check=check: check(graphs.get()), 90)  # type: ignore[misc]
    if name == "qwen3-0.6b":
        saturation(run, graphs)
    run.section(f"{name}: graph engine close", graphs.close, 60)


def usable_backend(run: Run, name: str, path: Path) -> None:
    """The first capturable backend that runs this model here (a kernel may lack its head size), or None."""
    run.usable[name] = None
    if run.dry_run:
        return
    for backend in ("flash_attn", "flashinfer"):
        if backend not in run.loaded:
            continue
        engine = None
        try:
            engine = make_engine(path, run.device, "bfloat16", backend, graphs=False)
            engine.embed(random_batch([16, 40], 30000))
            run.usable[name] = backend
            return
        except Exception as error:
            run.report.add(f"{name}: {backend}", f"FAILED to run: {type(error).__name__}: {str(error)[:200]}")
            logger.exception("%s on %s", backend, name)
        finally:
            release(engine)


def parity(run: Run, name: str, path: Path, backend: str, seq_lens: list[int]) -> None:
    batch = random_batch(seq_lens, run.vocab[name])
    reference = make_engine(path, run.device, "float32", "sdpa", graphs=False)
    try:
        expected = reference.embed(batch)
    finally:
        release(reference)
    engine = make_engine(path, run.device, "bfloat16", backend, graphs=False)
    try:
        cosine = min_cosine(engine.embed(batch), expected)
    finally:
        release(engine)
    run.report.add(f"{name}: bfloat16 ({backend}) vs float32 (sdpa)", f"min cosine {cosine:.5f}", ">= 0.999")


def graph_equals_eager(report: Report, name: str, engine: Engine, seq_lens: list[int], vocab: int) -> None:
    batch = random_batch(seq_lens, vocab)
    eager = engine.embed(batch)  # first hit of the bucket: eager
    start = time.perf_counter()
    engine.embed(batch)  # second: captured, then replayed
    capture_s = time.perf_counter() - start
    replayed = engine.embed(batch)
    runner = engine.runner.graphs
    if runner is not None and runner.graphs.stats.replays == 0:
        raise RuntimeError(f"no CUDA graph was replayed: {graph_stats(engine)}")
    # The same bucket with other lengths and ids: a replay must read this batch's inputs, not the captured one's.
    other = random_batch([*seq_lens[1:], seq_lens[0]], vocab, seed=3)
    other_cosine = min_cosine(engine.embed(other), eager_rows(engine, other))
    diff = np.abs(replayed - eager).max()
    summary = f"min cosine {min_cosine(replayed, eager):.6f}, max abs diff {diff:.2e}"
    summary += f"; another batch of the bucket vs unpadded eager: min cosine {other_cosine:.6f}"
    report.add(f"{name}: graph == eager", f"{summary}; {graph_stats(engine)}", "cosines >= 0.999")
    report.add(f"{name}: time to capture a bucket", f"{capture_s * 1e3:.0f} ms (capture and first replay)")


def steps_in_flight(report: Report, name: str, engine: Engine, vocab: int) -> None:
    """Steps launched before any result is read (the replica keeps two in flight) give the rows each gives alone:
    replays of one bucket rewrite its static buffers and output while earlier readbacks are still pending."""
    batches = [random_batch([17 + i, 9], vocab, seed=10 + i) for i in range(6)]  # one bucket, six batches
    batches += [random_batch([40 + i, 33, 7], vocab, seed=20 + i) for i in range(3)]  # another
    for batch in batches[:2] + batches[6:8]:  # each bucket: eager, then captured
        engine.embed(batch)
    alone = [engine.embed(batch) for batch in batches]  # replays, one at a time
    lazies = [engine.step(batch) for batch in batches]
    cosine = min(min_cosine(lazy.result(timeout=60), rows) for lazy, rows in zip(lazies, alone, strict=True))
    summary = f"{len(batches)} steps launched before any read: min cosine to each step alone {cosine:.6f}"
    report.add(f"{name}: steps in flight", f"{summary}; {graph_stats(engine)}", ">= 0.999")


def eager_vs_graph(
    report: Report, label: str, shape: tuple[int, int], vocab: int, repeats: int, engine: Engine
) -> None:
    seqs, length = shape
    batch = random_batch([length] * seqs, vocab, seed=seqs)
    for _ in range(3):  # warm-up, capture, first replay
        engine.embed(batch)
    graph_s = step_seconds(engine, batch, repeats)
    runner, engine.runner.graphs = engine.runner.graphs, None  # the same engine, eager
    try:
        eager_s = step_seconds(engine, batch, repeats)
    finally:
        engine.runner.graphs = runner
    goal = ">= 3x (Qwen3 shape)" if seqs == 1 else ""
    report.add(label, f"eager {eager_s * 1e3:.2f} ms, graph {graph_s * 1e3:.2f} ms: {eager_s / graph_s:.1f}x", goal)


def model_tflop(engine: Engine, seq_lens: list[int]) -> float:
    """Matrix-product work of one forward: 2 flop per weight per token plus attention's QK^T and PV."""
    weights = sum(m.weight.numel() for m in engine.model.modules() if isinstance(m, Linear))
    shape = engine.attn_backend.shape
    assert shape is not None
    pairs = sum(n * n * (0.5 if shape.causal else 1.0) for n in seq_lens)
    layers = sum(1 for m in engine.model.modules() if isinstance(m, Attention))
    attention = 4 * pairs * shape.num_heads * shape.head_dim * layers
    return (2 * weights * sum(seq_lens) + attention) / 1e12


def saturation(run: Run, graphs: GraphEngine) -> None:
    """Step latency and tokens/s against batch tokens, 512-token sequences; the knee at 90% of the best."""
    sizes = [512, 1024, 2048, 4096, 8192, 16384] if not run.dry_run else [32, 64]
    rates: dict[str, float] = run.report.shared.setdefault("saturation", {})  # tokens/s by size, kept on resume

    def measure(size: int) -> None:
        engine = graphs.get()
        seq_lens = [min(512, size)] * max(1, size // 512)
        batch = random_batch(seq_lens, run.vocab["qwen3-0.6b"], seed=size)
        for _ in range(3):
            engine.embed(batch)
        seconds = step_seconds(engine, batch, 2 if run.dry_run else 10)
        share = model_tflop(engine, seq_lens) / seconds / run.matmul_tflops
        rates[str(size)] = size / seconds
        summary = f"{seconds * 1e3:.1f} ms/step, {size / seconds:,.0f} tokens/s, {share:.0%} of the matmul rate"
        run.report.add(f"batch {size} tokens", summary, ">= 40% at saturation")

    for size in sizes:
        run.section(f"batch {size} tokens", partial(measure, size), 60)
    if rates:
        best = max(rates.values())
        knee = next(size for size in sizes if rates.get(str(size), 0.0) >= 0.9 * best)
        run.report.add("saturation knee", f"{knee} tokens (first size at 90% of the best {best:,.0f} tokens/s)")


def check_auto(run: Run, path: Path) -> None:
    """`auto` with the table this run wrote: the per-length choice, and rows equal to the fixed backend's."""
    table = run.out_dir / "attention-table.json"
    if not run.report.shared.get("table_written"):
        run.report.add("auto backend from the table", "SKIPPED: this run wrote no attention-table.json")
        return
    fixed = run.usable.get("qwen3-0.6b") or "sdpa"
    seq_lens = [16, 33, 64, 100, 128, 200, 256, 500] if not run.dry_run else [5, 9, 16]
    batch = random_batch(seq_lens, run.vocab["qwen3-0.6b"], seed=7)
    auto = make_engine(path, run.device, "bfloat16", "auto", graphs=not run.dry_run, table=table)
    try:
        auto.embed(batch)  # the first hit of its bucket runs eagerly, the second is captured and replayed
        got = auto.embed(batch)
        rows = getattr(auto.attn_backend, "table", None)
        choice = rows.rows if rows else auto.attn_backend.name
        stats = graph_stats(auto)
    finally:
        release(auto)
    reference = make_engine(path, run.device, "bfloat16", fixed, graphs=False)
    try:
        cosine = min_cosine(got, reference.embed(batch))
    finally:
        release(reference)
    result = f"{choice}; {stats}; min cosine vs eager {fixed} {cosine:.5f}"
    run.report.add("auto backend from the table", result, ">= 0.999")
