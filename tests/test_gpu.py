"""GPU checks: graph == eager, replays with new data in a bucket, backends against SDPA. Skipped without CUDA."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import row_cosines
from random_models import write_sentence_transformers_files

from bouquet.batch import Batch
from bouquet.config import CudaGraphConfig, EngineConfig
from bouquet.engine.engine import Engine
from bouquet.layers.attention_backends import AttentionShape, BackendUnavailableError, create_attention_backend
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.layers.context import ForwardContext

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GRAPH_BACKENDS = ["flash_attn", "flashinfer"]


def _backend_or_skip(name: str):
    try:
        return create_attention_backend(name)
    except BackendUnavailableError as error:
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """A small random Qwen3 with head_dim 128, which every GPU backend supports. The tokenizer is the bundled
    MiniLM's where that package is installed, else a minimal one (the GPU machine has not got it)."""
    from gpu_setup import tokenizer_dir
    from transformers import Qwen3Config, Qwen3Model

    path = tmp_path_factory.mktemp("qwen3_gpu")
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=30522, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
    )  # fmt: skip
    Qwen3Model(config).save_pretrained(path)
    write_sentence_transformers_files(path, tokenizer_dir(tmp_path_factory.mktemp("tokenizer")), "lasttoken", 4096)
    return path


def _engine(path: Path, backend: str, graphs: bool) -> Engine:
    _backend_or_skip(backend)
    config = EngineConfig(path, "cuda", "bfloat16", attention_backend=backend, cuda_graphs=CudaGraphConfig(graphs))
    return Engine(config)


def _batch(seq_lens: list[int], seed: int) -> Batch:
    ids = np.random.default_rng(seed).integers(1000, 30000, sum(seq_lens))
    return Batch.from_packed(ids, np.concatenate([[0], np.cumsum(seq_lens)]))


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_graph_equals_eager_and_replays_new_batches(qwen3_dir: Path, backend: str) -> None:
    graphs, eager = _engine(qwen3_dir, backend, graphs=True), _engine(qwen3_dir, backend, graphs=False)
    # Same bucket (64 tokens, 4 sequences: pad sequence plus an empty slot, max_seqlen 32) with different lengths
    # and ids.
    batches = [_batch([20, 30], 0), _batch([20, 30], 0), _batch([25, 25], 1), _batch([31, 19], 2)]
    for batch in batches:
        got, expected = graphs.embed(batch), eager.embed(batch)
        assert row_cosines(got, expected).min() > 0.9999
    stats = graphs.runner.graphs.graphs.stats
    assert (stats.eager, stats.captures, stats.replays) == (1, 1, 3)
    graphs.close()
    eager.close()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_steps_overlap_and_complete_in_order(qwen3_dir: Path, backend: str) -> None:
    engine = _engine(qwen3_dir, backend, graphs=True)
    batches = [_batch([16 + i, 9], i) for i in range(6)]
    expected = [engine.embed(b) for b in batches]
    lazies = [engine.step(b) for b in batches]  # all launched before any result is read
    for lazy, rows in zip(lazies, expected, strict=True):
        np.testing.assert_allclose(lazy.result(timeout=60), rows, atol=2e-2)
    engine.close()


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("seq_lens", [[1, 17, 64, 200, 3], [512, 512], [2048]])
def test_backend_matches_sdpa(backend: str, causal: bool, seq_lens: list[int]) -> None:
    torch.manual_seed(0)
    shape = AttentionShape(16, 8, 128, causal, torch.bfloat16)
    total = sum(seq_lens)
    q = torch.randn(total, 16, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(seq_lens)]), dtype=torch.int32, device="cuda")
    outs = []
    for attention in (_backend_or_skip(backend), SdpaBackend()):
        attention.bind(shape)
        ctx = ForwardContext(cu_seqlens, max(seq_lens), seq_lens)
        ctx.attn_metadata = attention.prepare(ctx)
        outs.append(attention.forward(q, k, v, ctx, causal, shape.scale).float())
    torch.testing.assert_close(outs[0], outs[1], atol=2e-2, rtol=2e-2)


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory) -> Path:
    """A tiny random CLIP (tests/test_clip.py's) with a tokenizer.json beside it; steps here send token ids."""
    from gpu_setup import tokenizer_dir
    from test_clip import _clip

    path = tmp_path_factory.mktemp("clip_gpu")
    torch.manual_seed(0)
    _clip(eos_token_id=102).save_pretrained(path)
    shutil.copy(tokenizer_dir(tmp_path_factory.mktemp("tokenizer")) / "tokenizer.json", path / "tokenizer.json")
    return path


def test_a_step_of_clip_texts_and_images_gives_their_rows_apart(clip_dir: Path) -> None:
    """Texts beside images on CUDA (tests/test_two_tower_steps.py on the CPU): each tower in a forward context of
    its own on the bound backend, while a step of texts alone may replay a graph."""
    from test_clip import IMAGE_TOKENS, _images, _texts

    engine = Engine(EngineConfig(clip_dir, "cuda", "bfloat16"))
    try:
        texts, images = Batch.pack(_texts()), Batch.pack_images(_images(3), IMAGE_TOKENS)
        apart = np.concatenate([engine.embed(texts), engine.embed(images), engine.embed(texts)])
        mixed = engine.embed(Batch.concat([texts, images, texts]))
    finally:
        engine.close()
    assert row_cosines(mixed, apart).min() > 0.999
