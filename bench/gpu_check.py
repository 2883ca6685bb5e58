"""One-call GPU check: parity, graph == eager, latency and throughput, attention backends; writes
docs/gpu-results.md and docs/attention-table.json (the `auto` backend's table).

    python bench/gpu_check.py              # on the GPU machine: about 5 minutes on one H200, more while kernels
                                           # JIT-compile, never past --hard-limit-s (470 s); no network
    python bench/gpu_check.py --dry-run    # on the CPU: tiny shapes, SDPA, no graphs, output to a temp dir

Every section is guarded: a failure is recorded in the table and the run goes on, so a lent GPU is never
lost to one error. The GPU machine has torch with CUDA, transformers, tokenizers and safetensors but no
registry. Its `flash_attn` backend needs no wheel: without flash-attn installed it runs PyTorch's built-in
varlen FlashAttention 2. flash-attn-4 and FlashInfer can only travel as wheels, and they do not fit: a device
call carries at most 64 MiB, and flash-attn-4's CuTe DSL libraries for CUDA 13
(nvidia-cutlass-dsl-libs-cu13 4.8.1) weigh 92 MB, flashinfer-python 0.7.4 101 MB (checked 2026-12-01). So
they are reported as not loaded unless a way to bring them appears; the wheel recipe, for Python 3.12 on
manylinux x86_64 (the dependencies without torch, which would fetch a second, multi-GB torch):

    P="--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
       --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d wheels/"
    pip download $P --no-deps flash-attn-4 flashinfer-python
    for w in wheels/*.whl; do unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist'; done
    pip download $P --no-deps <each requirement listed above but torch, e.g. nvidia-cutlass-dsl>

On the GPU machine: `pip install --no-index --no-deps wheels/*.whl`, then `python3 bench/gpu_check.py --out-dir
DIR`. The project itself is not installed there: this script puts `src/` on the path (`pip install -e .` would
need setuptools from the network, and the project pins Python 3.11 while that machine runs 3.12). A backend
that does not load is named in the table with the reason. The report is rewritten after every row, and a
watchdog ends the run at --hard-limit-s with what it has, so a run stopped from outside still leaves one.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

# Runs from a checkout: the project need not be installed (on the GPU machine it is not).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
from random_models import write_sentence_transformers_files

from bouquet.batch import Batch
from bouquet.config import CudaGraphConfig, EngineConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.layers.attention import Attention
from bouquet.layers.attention_backends import AttentionBackend, AttentionShape
from bouquet.layers.attention_backends.selection import GPU_BACKENDS, BackendTable, load_backends
from bouquet.layers.attention_backends.timing import measure_timings
from bouquet.layers.linear import Linear

ROOT = Path(__file__).resolve().parent.parent
QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151669)  # fmt: skip
QWEN3_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=128, vocab_size=30522)  # fmt: skip
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
BERT_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


@dataclass
class Report:
    path: Path | None = None  # rewritten after every row, so a run stopped from outside still leaves its rows
    header: list[str] = field(default_factory=list)
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    deadline: float = float("inf")
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, check: str, result: str, goal: str = "") -> None:
        with self.lock:
            self.rows.append((check, result, goal))
            print(f"| {check} | {result} | {goal} |", flush=True)
            self.write()

    def note(self, text: str) -> None:
        with self.lock:
            self.notes.append(text)
            self.write()

    def write(self) -> None:
        if self.path is not None:
            self.path.write_text(self.markdown(self.header))

    def run(self, name: str, check: Callable[[], None]) -> None:
        """Runs one check; past the time budget it is skipped, and a failure is recorded, not raised."""
        if time.monotonic() > self.deadline:
            self.add(name, "SKIPPED: time budget spent")
            return
        try:
            check()
        except Exception as error:
            self.add(name, f"FAILED: {type(error).__name__}: {str(error)[:200]}")
            traceback.print_exc()

    def markdown(self, header: list[str]) -> str:
        lines = [*header, "", "| check | result | goal |", "| --- | --- | --- |"]
        lines += [f"| {c} | {r} | {g} |" for c, r, g in self.rows]
        return "\n".join([*lines, "", *[f"- {n}" for n in self.notes], ""])

    def start_watchdog(self, seconds: float) -> None:
        """Past `seconds`, records the stop, writes the report and ends the process (a section may hang in a
        JIT compile or a kernel; the lent machine's command limit would otherwise end it with nothing)."""

        def stop() -> None:
            time.sleep(seconds)
            self.add("run", f"ABORTED: hard time limit of {seconds:.0f} s reached (--hard-limit-s)")
            os._exit(3)

        threading.Thread(target=stop, name="gpu-check-watchdog", daemon=True).start()


def make_qwen3(path: Path, shape: dict[str, int]) -> Path:
    """A random-weight Qwen3 embedder (causal, last-token pooling) in the sentence-transformers layout."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False)
    Qwen3Model(config).save_pretrained(path)  # transformers' own init: std 0.02, stable over 28 layers
    write_sentence_transformers_files(path, tokenizer_dir(path.parent), "lasttoken", max_len=32768)
    return path


def tokenizer_dir(tmp: Path) -> Path:
    """The bundled MiniLM's tokenizer.json, or a minimal valid one: loading only needs the file, and the
    MiniLM package (88 MB) is too big to travel to the GPU machine."""
    try:
        return default_model_path()
    except FileNotFoundError:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel

        Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp / "tokenizer.json"))
        return tmp


def minilm_dir(tmp: Path) -> tuple[str, Path]:
    """all-MiniLM-L6-v2 from its package, else a random-weight BERT of its shape (6 x 384, 12 heads)."""
    try:
        return "minilm", default_model_path()
    except FileNotFoundError:
        from transformers import BertConfig, BertModel

        path = tmp / "minilm-shaped"
        torch.manual_seed(0)
        config = BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
        BertModel(config, add_pooling_layer=False).save_pretrained(path)
        write_sentence_transformers_files(path, tokenizer_dir(tmp), "mean", max_len=512)
        return "minilm-shaped (random weights: the MiniLM package is not installed here)", path


def make_bert(path: Path, shape: dict[str, int]) -> Path:
    """A random-weight BERT encoder (mean pooling) in the sentence-transformers layout."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(**shape), add_pooling_layer=False).save_pretrained(path)
    write_sentence_transformers_files(path, tokenizer_dir(path.parent), "mean", max_len=512)
    return path


def make_engine(path: Path, device: str, dtype: str, backend: str, graphs: bool, table: Path | None = None) -> Engine:
    config = CudaGraphConfig(enabled=graphs)
    return Engine(EngineConfig(path, device, dtype, backend, cuda_graphs=config, attention_table=table))


def random_batch(seq_lens: list[int], vocab: int, seed: int = 0) -> Batch:
    ids = np.random.default_rng(seed).integers(1000, vocab, sum(seq_lens))
    return Batch.from_packed(ids, np.concatenate([[0], np.cumsum(seq_lens)]))


def step_seconds(engine: Engine, batch: Batch, repeats: int) -> float:
    """Median wall time of a synchronous step (launch, readback, the waiter's completion)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        engine.embed(batch)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(((a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))).min())


def matmul_tflops(device: str, dtype: torch.dtype, n: int) -> float:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    start, repeats = time.perf_counter(), 20
    for _ in range(repeats):
        a @ b
    sync(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start) / 1e12


def model_tflop(engine: Engine, seq_lens: list[int]) -> float:
    """Matrix-product work of one forward: 2 flop per weight per token plus attention's QK^T and PV."""
    weights = sum(m.weight.numel() for m in engine.model.modules() if isinstance(m, Linear))
    shape = engine.attn_backend.shape
    assert shape is not None
    pairs = sum(n * n * (0.5 if shape.causal else 1.0) for n in seq_lens)
    layers = sum(1 for m in engine.model.modules() if isinstance(m, Attention))
    attention = 4 * pairs * shape.num_heads * shape.head_dim * layers
    return (2 * weights * sum(seq_lens) + attention) / 1e12


def graph_stats(engine: Engine) -> str:
    """The engine's graph counters and capture errors; 'eager (no CUDA graphs)' on the CPU or without them."""
    runner = engine.runner.graphs
    if runner is None:
        return "eager (no CUDA graphs)"
    stats, errors = runner.graphs.stats, runner.graphs.capture_errors
    summary = f"{stats.eager} eager, {stats.captures} captured, {stats.replays} replayed"
    return summary + "".join(f"; capture of {b.num_tokens}x{b.num_seqs} failed: {e[:150]}" for b, e in errors.items())


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def usable_backend(report: Report, name: str, path: Path, args: argparse.Namespace, loaded: list[str]) -> str | None:
    """The first capturable backend that runs this model here (a kernel may lack its head size), or None."""
    if args.dry_run:
        return None
    for backend in ("flash_attn", "flashinfer"):
        if backend not in loaded:
            continue
        try:
            engine = make_engine(path, args.device, "bfloat16", backend, graphs=False)
        except Exception as error:
            report.add(f"{name}: {backend}", f"FAILED to start: {type(error).__name__}: {str(error)[:200]}")
            continue
        try:
            engine.embed(random_batch([16, 40], 30000))
            return backend
        except Exception as error:
            report.add(f"{name}: {backend}", f"FAILED to run (first call): {type(error).__name__}: {str(error)[:200]}")
            traceback.print_exc()
        finally:
            engine.close()
    return None


def check_model(report: Report, name: str, path: Path, args: argparse.Namespace, loaded: list[str]) -> None:
    backend = usable_backend(report, name, path, args, loaded)
    args.usable[name] = backend
    vocab = args.vocab[name]
    mixed = [16, 33, 64, 100, 128, 200, 256, 500] if not args.dry_run else [5, 9, 16]

    def parity() -> None:
        reference = make_engine(path, args.device, "float32", "sdpa", graphs=False)
        engine = make_engine(path, args.device, "bfloat16", backend or "sdpa", graphs=False)
        cosine = min_cosine(engine.embed(random_batch(mixed, vocab)), reference.embed(random_batch(mixed, vocab)))
        report.add(f"{name}: bfloat16 ({backend or 'sdpa'}) vs float32", f"min cosine {cosine:.5f}", ">= 0.999")
        reference.close()
        engine.close()

    report.run(f"{name}: bfloat16 parity", parity)
    if backend is None and not args.dry_run:
        report.add(f"{name}: CUDA graphs", "SKIPPED: no capturable backend loaded (flash-attn-4, flashinfer-python)")
        return
    # The dry run goes through every section with an eager SDPA engine, so the script itself is tested.
    engine = make_engine(path, args.device, "bfloat16", backend or "sdpa", graphs=not args.dry_run)
    report.run(f"{name}: graph == eager", lambda: graph_equals_eager(report, name, engine, mixed[:5], vocab))
    for seqs, length in ((1, 16), (8, 64)):
        label = f"{name}: eager vs graph, {seqs} x {length} tokens"
        repeats = 3 if args.dry_run else 50
        run = partial(eager_vs_graph, report, label, engine, (seqs, length), vocab, repeats)
        report.run(label, run)
    if name == "qwen3-0.6b":
        saturation(report, engine, args)
    engine.close()


def check_auto(report: Report, path: Path, args: argparse.Namespace) -> None:
    """`auto` with the table this run wrote: the per-length choice, and rows equal to the fixed backend's."""
    table = args.out_dir / "attention-table.json"
    if not args.table_written:
        report.add("auto backend from the table", "SKIPPED: this run wrote no attention-table.json")
        return
    fixed = args.usable.get("qwen3-0.6b") or "sdpa"
    seq_lens = [16, 33, 64, 100, 128, 200, 256, 500] if not args.dry_run else [5, 9, 16]
    batch = random_batch(seq_lens, args.vocab["qwen3-0.6b"], seed=7)
    auto = make_engine(path, args.device, "bfloat16", "auto", graphs=not args.dry_run, table=table)
    try:
        auto.embed(batch)  # the first hit of its bucket runs eagerly, the second is captured and replayed
        got = auto.embed(batch)
        rows = getattr(auto.attn_backend, "table", None)
        choice = rows.rows if rows else auto.attn_backend.name
        stats = graph_stats(auto)
    finally:
        auto.close()
    reference = make_engine(path, args.device, "bfloat16", fixed, graphs=False)
    try:
        cosine = min_cosine(got, reference.embed(batch))
    finally:
        reference.close()
    report.add(
        "auto backend from the table", f"{choice}; {stats}; min cosine vs eager {fixed} {cosine:.5f}", ">= 0.999"
    )


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


def eager_rows(engine: Engine, batch: Batch) -> np.ndarray:
    """`batch` through the same engine with its graphs set aside: the unpadded eager path."""
    runner, engine.runner.graphs = engine.runner.graphs, None
    try:
        return engine.embed(batch)
    finally:
        engine.runner.graphs = runner


def eager_vs_graph(
    report: Report, label: str, engine: Engine, shape: tuple[int, int], vocab: int, repeats: int
) -> None:
    seqs, length = shape
    batch = random_batch([length] * seqs, vocab, seed=seqs)
    for _ in range(3):  # warm-up, capture, first replay
        engine.embed(batch)
    graph_s = step_seconds(engine, batch, repeats)
    runner, engine.runner.graphs = engine.runner.graphs, None  # the same engine, eager (None on the CPU anyway)
    try:
        eager_s = step_seconds(engine, batch, repeats)
    finally:
        engine.runner.graphs = runner
    goal = ">= 3x (Qwen3 shape)" if seqs == 1 else ""
    report.add(label, f"eager {eager_s * 1e3:.2f} ms, graph {graph_s * 1e3:.2f} ms: {eager_s / graph_s:.1f}x", goal)


def saturation(report: Report, engine: Engine, args: argparse.Namespace) -> None:
    """Step latency and tokens/s against batch tokens, 512-token sequences; the knee at 90% of the best."""
    sizes = [512, 1024, 2048, 4096, 8192, 16384] if not args.dry_run else [32, 64]
    results: list[tuple[int, float]] = []

    def measure(size: int) -> None:
        seq_lens = [min(512, size)] * max(1, size // 512)
        batch = random_batch(seq_lens, args.vocab["qwen3-0.6b"], seed=size)
        for _ in range(3):
            engine.embed(batch)
        seconds = step_seconds(engine, batch, 2 if args.dry_run else 10)
        share = model_tflop(engine, seq_lens) / seconds / args.matmul_tflops
        results.append((size, size / seconds))
        summary = f"{seconds * 1e3:.1f} ms/step, {size / seconds:,.0f} tokens/s, {share:.0%} of the matmul rate"
        report.add(f"batch {size} tokens", summary, ">= 40% at saturation")

    for size in sizes:
        report.run(f"batch {size} tokens", lambda size=size: measure(size))
    if results:
        best = max(rate for _, rate in results)
        knee = next(size for size, rate in results if rate >= 0.9 * best)
        report.add("saturation knee", f"{knee} tokens (first size at 90% of the best {best:,.0f} tokens/s)")


def replica_throughput(report: Report, path: Path, args: argparse.Namespace, backend: str) -> None:
    """One replica process's tokens/s at saturation: many concurrent gRPC requests of 50-token inputs into its
    scheduler and engine (the published record: 1.6M tokens/s on one H200 from 32 vLLM copies), beside the bare
    engine's tokens/s on batches of the scheduler's budget."""
    import asyncio

    import grpc

    from bouquet.config import SchedulerConfig
    from bouquet.proto import embedding_pb2_grpc
    from bouquet.replica.client import embed_request
    from bouquet.replica.testing import ReplicaThread

    engine = make_engine(path, args.device, "bfloat16", backend, graphs=not args.dry_run)
    replica = ReplicaThread(engine, SchedulerConfig.for_device(args.device, 4096 if not args.dry_run else 512))
    clients, per_request, seconds = (128, 16, 15.0) if not args.dry_run else (4, 4, 1.0)
    requests = [embed_request(Batch.pack(random_ids(per_request, 50, seed))) for seed in range(clients)]

    async def client(stub: embedding_pb2_grpc.EmbeddingStub, request: object, stop_at: float) -> int:
        sent = 0
        while time.monotonic() < stop_at:
            await stub.Embed(request, timeout=60)
            sent += 1
        return sent

    async def drive() -> tuple[int, float]:
        async with grpc.aio.insecure_channel(replica.address) as channel:
            stub = embedding_pb2_grpc.EmbeddingStub(channel)
            await stub.Embed(requests[0], timeout=120)  # warm-up: kernels, first buckets
            started = time.monotonic()
            counts = await asyncio.gather(*(client(stub, r, started + seconds) for r in requests))
            return sum(counts), time.monotonic() - started

    try:
        calls, elapsed = asyncio.run(drive())
        served = calls * per_request * 50 / elapsed
        batch = random_batch([50] * (replica.config.max_batch_tokens // 50), args.vocab_bert)
        for _ in range(3):
            engine.embed(batch)
        bare = batch.num_tokens / step_seconds(engine, batch, 3 if args.dry_run else 20)
    finally:
        replica.stop()
        engine.close()
    summary = f"{served:,.0f} tokens/s from {clients} concurrent clients ({calls} requests of {per_request} x 50)"
    report.add("bert-base: one replica, 50-token inputs", f"{summary}; bare engine {bare:,.0f} tokens/s", "")


def random_ids(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[101, *rng.integers(1000, 30000, length - 2).tolist(), 102] for _ in range(count)]


def load_attention_backends(report: Report, args: argparse.Namespace) -> dict[str, AttentionBackend]:
    """Imports only (no kernel runs, no JIT compiles): which backends this machine has, and why not the rest."""
    loaded, missing = load_backends(GPU_BACKENDS if not args.dry_run else ("sdpa",))
    for name, reason in missing.items():
        report.add(f"backend {name}", f"NOT LOADED: {reason[:300]}")
    for name, backend in loaded.items():
        report.add(f"backend {name}", f"loaded: {getattr(backend, 'version', type(backend).__name__)}")
    return loaded


def time_backends(report: Report, args: argparse.Namespace, loaded: dict[str, AttentionBackend]) -> None:
    """Per-length attention timings on Qwen3-0.6B's shape, and the `auto` table they make."""
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    shape = AttentionShape(16, 8, 128, causal=True, dtype=dtype)
    lengths = (64, 128, 256, 512, 1024, 2048, 4096, 8192) if not args.dry_run else (16, 32)
    timings = measure_timings(loaded, shape, torch.device(args.device), lengths)
    for length, times in timings.items():
        cells = ", ".join(f"{n} {t * 1e6:.0f} us" for n, t in sorted(times.items(), key=lambda kv: kv[1]))
        report.add(f"attention, {length}-token sequences (8192 tokens)", cells or "every backend failed")
    table = BackendTable.from_timings(timings)
    (args.out_dir / "attention-table.json").write_text(table.to_json())
    args.table_written = True
    report.note(f"auto table (written to attention-table.json): {table.rows}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, SDPA, no graphs, temp output")
    parser.add_argument("--out-dir", type=Path, help="where gpu-results.md goes (default docs/, temp on dry run)")
    parser.add_argument("--budget-s", type=float, default=390.0, help="sections past this many seconds are skipped")
    parser.add_argument("--hard-limit-s", type=float, default=470.0, help="the run ends here, report written")
    args = parser.parse_args()
    args.device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device: run with --dry-run on the CPU")
    args.out_dir = args.out_dir or (Path(tempfile.mkdtemp()) if args.dry_run else ROOT / "docs")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    args.usable, args.table_written = {}, False
    started = time.monotonic()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (dry run)"
    cuda = f", CUDA {torch.version.cuda}" if args.device == "cuda" else ""
    header = ["# GPU check", "", f"Device: {device_name}; torch {torch.__version__}{cuda}; bench/gpu_check.py"]
    report = Report(args.out_dir / "gpu-results.md", header, deadline=time.monotonic() + args.budget_s)
    report.write()
    report.start_watchdog(args.hard_limit_s)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.matmul_tflops = float("nan")

    def matmul() -> None:
        args.matmul_tflops = matmul_tflops(args.device, dtype, 8192 if not args.dry_run else 256)
        report.add(f"{dtype} matrix-product rate", f"{args.matmul_tflops:.3g} TFLOP/s (n^3 matmuls, this run)")

    report.run("matrix-product rate", matmul)
    loaded = load_attention_backends(report, args)
    with tempfile.TemporaryDirectory() as tmp:
        qwen3 = make_qwen3(Path(tmp) / "qwen3", QWEN3_TINY if args.dry_run else QWEN3_06B)
        minilm_name, minilm = minilm_dir(Path(tmp))
        args.vocab = {"qwen3-0.6b": (QWEN3_TINY if args.dry_run else QWEN3_06B)["vocab_size"], minilm_name: 30522}
        # Most valuable first: the Qwen3 checks, then the backend timings (they may JIT-compile FlashInfer's
        # kernels when its prebuilt cache did not travel) and `auto`, then the small BERT (head_dim 32, the
        # shape the kernels support least).
        report.run("qwen3-0.6b", lambda: check_model(report, "qwen3-0.6b", qwen3, args, list(loaded)))
        report.run("attention backends", lambda: time_backends(report, args, loaded))
        report.run("auto backend from the table", lambda: check_auto(report, qwen3, args))
        report.run(minilm_name, lambda: check_model(report, minilm_name, minilm, args, list(loaded)))
        bert = make_bert(Path(tmp) / "bert-base", BERT_TINY if args.dry_run else BERT_BASE)
        args.vocab_bert = 30522
        bert_backend = (args.usable.get("qwen3-0.6b") or "sdpa") if not args.dry_run else "sdpa"
        report.run("bert-base replica", lambda: replica_throughput(report, bert, args, bert_backend))
    report.add("run", f"finished in {time.monotonic() - started:.0f} s")
    print(f"wrote {report.path}")


if __name__ == "__main__":
    main()
