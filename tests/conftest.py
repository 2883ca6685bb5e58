"""Shared fixtures: the real all-MiniLM-L6-v2, its engines in both CPU dtypes, and the reference model."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

# This checkout's own package first, in this process and in the servers the tests start: an environment installed
# (editable) from another checkout of the repository, e.g. a git worktree sharing its venv, would import that one.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [sys.path[0], os.environ.get("PYTHONPATH")]))

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.gateway import testing
from bouquet.tokenizer import TextTokenizer

# Replicas the tests start skip the start-up build of oneDNN's primitives (engine/memory.py; test_memory.py checks
# it): 0.5-1 s a start, over a hundred starts. A test's own `--cpu-warmup-tokens` overrides this.
testing.DEFAULT_ARGS.update(replica=("--cpu-warmup-tokens", "0"), serve=("--cpu-warmup-tokens", "0"))


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """An engine built with `num_threads` sets torch's count on the caller's thread; later tests (and the
    session's shared engines) must not inherit it."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_path: Path) -> TextTokenizer:
    return TextTokenizer(minilm_path / "tokenizer.json", max_length=256)


def _engine(path: Path, dtype: str) -> Iterator[Engine]:
    # As for the replicas tests start (above): no start-up build of oneDNN's primitives, 6 s of every run that uses
    # these engines (the in-process API tests serve them); steps build what they meet.
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype=dtype, cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def minilm_fp32(minilm_path: Path) -> Iterator[Engine]:
    yield from _engine(minilm_path, "float32")


@pytest.fixture(scope="session")
def minilm_bf16(minilm_path: Path) -> Iterator[Engine]:
    yield from _engine(minilm_path, "bfloat16")


@pytest.fixture(scope="session")
def sentence_transformer(minilm_path: Path):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_path), device="cpu")


@pytest.fixture
def recorder(minilm_fp32: Engine):
    """The real engine, wrapped to record (or hold) the batches a replica sends it."""
    from bouquet.replica.testing import RecordingEngine

    engine = RecordingEngine(minilm_fp32)
    yield engine
    engine.close()


@pytest.fixture
def stub(replica):
    import grpc

    from bouquet.proto import embedding_pb2_grpc

    with grpc.insecure_channel(replica.address) as channel:
        yield embedding_pb2_grpc.EmbeddingStub(channel)


def embed_ids(engine: Engine, ids: list[list[int]], normalize: bool = True, dimensions: int = 0) -> np.ndarray:
    return engine.embed(Batch.pack(ids, RowOptions(dimensions, normalize)))


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    b = b.astype(np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def per_sequence_attention(q, k, v, seq_lens: list[int], causal: bool, scale: float | None = None, dtype=None):
    """Attention references for packed [T, H, D] q, k, v: plain SDPA one sequence at a time, computed in `dtype`
    (float32 unless given: the exact reference; the inputs' bfloat16: ATen's own bfloat16 attention); float32 out."""
    import torch
    import torch.nn.functional as F

    outs, start = [], 0
    for length in seq_lens:
        qs, ks, vs = (t[start : start + length].transpose(0, 1)[None].to(dtype or torch.float32) for t in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale, enable_gqa=True)
        outs.append(out[0].transpose(0, 1))
        start += length
    return torch.cat(outs).float()


def packed_context(backend, seq_lens: list[int]):
    """The forward context of a packed batch of `seq_lens`, with the backend's plan for it."""
    import torch

    from bouquet.layers.context import ForwardContext

    cu_seqlens = torch.tensor([0, *np.cumsum(seq_lens)], dtype=torch.int32)
    ctx = ForwardContext(cu_seqlens, max(seq_lens), list(seq_lens))
    ctx.attn_metadata = backend.prepare(ctx)
    return ctx
