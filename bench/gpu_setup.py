"""What bench/gpu_check.py's sections run on: random-weight checkpoints of the checked shapes, engines, batches,
and for the CPU rehearsal (--dry-run) a stand-in for CUDA-graph capture with CUDA graphs' semantics."""

from __future__ import annotations

import gc
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gpu_report import Report
from random_models import write_sentence_transformers_files

from bouquet.batch import Batch
from bouquet.config import CudaGraphConfig, EngineConfig, default_model_path
from bouquet.engine.cuda_graphs import Bucket, CudaGraphRunner
from bouquet.engine.engine import Engine
from bouquet.layers.attention_backends import AttentionBackend
from bouquet.layers.attention_backends.cpu_varlen import CpuVarlenBackend
from bouquet.layers.context import ForwardContext

QWEN3_06B = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                 head_dim=128, intermediate_size=3072, vocab_size=151669)  # fmt: skip
QWEN3_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=32, intermediate_size=128, vocab_size=30522)  # fmt: skip
BERT_BASE = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072)
BERT_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
MINILM = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)


def make_qwen3(path: Path, shape: dict[str, int]) -> Path:
    """A random-weight Qwen3 embedder (causal, last-token pooling) in the sentence-transformers layout, saved in
    bfloat16 as the released checkpoint is (half the bytes to read at each engine's start)."""
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    config = Qwen3Config(**shape, max_position_embeddings=32768, tie_word_embeddings=False)
    # transformers' own init: std 0.02, stable over 28 layers
    Qwen3Model(config).to(torch.bfloat16).save_pretrained(path)
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
        path = make_bert(tmp / "minilm-shaped", MINILM)
        return "minilm-shaped (random weights)", path  # the MiniLM package is not installed here


def make_bert(path: Path, shape: dict[str, int]) -> Path:
    """A random-weight BERT encoder (mean pooling) in the sentence-transformers layout."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    BertModel(BertConfig(**shape), add_pooling_layer=False).save_pretrained(path)
    write_sentence_transformers_files(path, tokenizer_dir(path.parent), "mean", max_len=512)
    return path


def make_engine(path: Path, device: str, dtype: str, backend: str, graphs: bool, table: Path | None = None) -> Engine:
    """An engine; on the CPU with `graphs` (the dry run), cpu_varlen and CUDA graphs' logic through `CpuGraphs`,
    on one worker thread as on CUDA (the static buffers are the launching thread's alone)."""
    if device == "cpu" and graphs:
        engine = Engine(EngineConfig(path, device, dtype, "cpu_varlen", cpu_workers=1))
        install_cpu_graphs(engine)
        return engine
    config = CudaGraphConfig(enabled=graphs)
    return Engine(EngineConfig(path, device, dtype, backend, cuda_graphs=config, attention_table=table))


def release(*engines: Engine | None) -> None:
    """Closes engines and frees them now, not at a garbage collection in the middle of another's capture."""
    for engine in engines:
        if engine is not None:
            engine.close()
    gc.collect()


class CpuGraphs:
    """The dry run's stand-in for CudaCapturer, with CUDA graphs' semantics: a replay runs the recorded function
    again and writes into the output tensor the capture returned."""

    computes = False  # as a CUDA capture: the capturing step replays, so the dry run exercises that path

    def fits(self, bucket: Bucket) -> bool:
        return True  # as CudaCapturer: one pool, bounded by the count of graphs

    def capture(self, fn: Callable[[], torch.Tensor], bucket: Bucket) -> tuple[_CpuReplay, torch.Tensor]:
        output = fn()
        return _CpuReplay(fn, output), output


class _CpuReplay:
    def __init__(self, fn: Callable[[], torch.Tensor], output: torch.Tensor):
        self.fn, self.output = fn, output

    def replay(self) -> None:
        self.output.copy_(self.fn())


class CpuGraphRunner(CudaGraphRunner):
    """The CPU engine hands rows back through `.numpy()`, which shares their memory: a replayed graph's rows are
    copied, as CUDA's pinned readback copies them, or the next replay would rewrite the caller's rows."""

    def run(self, batch: Batch) -> torch.Tensor | None:
        rows = super().run(batch)
        return None if rows is None else rows.clone()


class CapturableCpuVarlen(CpuVarlenBackend):
    """cpu_varlen's metadata is the batch's cu_seqlens tensor (a static buffer's view in a graph) and the
    bucket's token count: planned once at capture, it serves every replay of the bucket."""

    supports_cuda_graphs = True  # type: ignore[misc]

    def prepare_capture(self, ctx: ForwardContext, key: object) -> Any:
        return self.prepare(ctx)

    def prepare_replay(self, ctx: ForwardContext, key: object) -> None:
        pass


def install_cpu_graphs(engine: Engine) -> None:
    shape = engine.attn_backend.shape
    assert shape is not None, "the engine binds its backend at load"
    backend = CapturableCpuVarlen()
    backend.bind(shape)
    engine.attn_backend = backend  # bound to the model's layers
    runner = engine.runner
    runner.graphs = CpuGraphRunner(CudaGraphConfig(), engine.device, backend, runner.forward, CpuGraphs())


def random_batch(seq_lens: list[int], vocab: int, seed: int = 0) -> Batch:
    ids = np.random.default_rng(seed).integers(1000, vocab, sum(seq_lens))
    return Batch.from_packed(ids, np.concatenate([[0], np.cumsum(seq_lens)]))


def random_ids(count: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[101, *rng.integers(1000, 30000, length - 2).tolist(), 102] for _ in range(count)]


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


def graph_stats(engine: Engine) -> str:
    """The engine's graph counters and capture errors; 'eager (no CUDA graphs)' without graphs."""
    runner = engine.runner.graphs
    if runner is None:
        return "eager (no CUDA graphs)"
    stats, errors = runner.graphs.stats, runner.graphs.capture_errors
    summary = f"{stats.eager} eager, {stats.captures} captured, {stats.replays} replayed"
    return summary + "".join(f"; capture of {b.num_tokens}x{b.num_seqs} failed: {e[:150]}" for b, e in errors.items())


def eager_rows(engine: Engine, batch: Batch) -> np.ndarray:
    """`batch` through the same engine with its graphs set aside: the unpadded eager path."""
    runner, engine.runner.graphs = engine.runner.graphs, None
    try:
        return engine.embed(batch)
    finally:
        engine.runner.graphs = runner


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cuda_healthy() -> bool:
    """Whether the device still runs work: after an illegal address or a device-side assert every call fails."""
    if not torch.cuda.is_available():
        return True
    try:
        return torch.ones(1, device="cuda").add_(1).item() == 2.0
    except Exception:
        return False


class Run:
    """What the sections share: the options, the report, and what earlier sections found, kept in the report's
    state (`shared`) so that an attempt resumed in a fresh process has it too."""

    def __init__(self, dry_run: bool, out_dir: Path, models_dir: Path, report: Report, crash_in: str = ""):
        self.dry_run, self.out_dir, self.models_dir, self.report = dry_run, out_dir, models_dir, report
        self.device = "cpu" if dry_run else "cuda"
        self.crash_in = crash_in  # a section that kills the process: the rehearsal of a crash
        self.loaded: dict[str, AttentionBackend] = {}  # imported in this process
        for key, empty in (("usable", {}), ("paths", {}), ("vocab", {})):
            report.shared.setdefault(key, empty)

    def section(self, name: str, check: Callable[[], None], limit_s: float) -> bool:
        return self.report.run(name, os.abort if name == self.crash_in else check, limit_s)

    @property
    def usable(self) -> dict[str, str | None]:
        """Model name -> the capturable backend that ran it (None: none did)."""
        return self.report.shared["usable"]

    @property
    def paths(self) -> dict[str, str]:
        """Model name -> its checkpoint directory."""
        return self.report.shared["paths"]

    @property
    def vocab(self) -> dict[str, int]:
        return self.report.shared["vocab"]

    @property
    def matmul_tflops(self) -> float:
        return float(self.report.shared.get("matmul_tflops", "nan"))
