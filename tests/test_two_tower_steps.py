"""Texts and images of one CLIP or SigLIP model in one step (issue 29's scheduling item): each tower runs on its own
sequences, and every row is the row the same input gets in a step of its own kind, whatever the order, with each
request's own options; through a real replica, the scheduler cuts such a step when texts and images wait together,
as the steps the engine is handed show (tiny random-weight models saved by transformers, float32)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from test_clip import _clip, _save
from test_clip import _texts as clip_texts
from test_siglip import save_siglip

from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig, SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.engine.memory import bucket_tokens, pad_to_bucket
from bouquet.proto import embedding_pb2_grpc
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.testing import RecordingEngine, ReplicaThread, wait_until

IMAGE_SIZE = 32  # both tiny models': patch 8, so CLIP's image is 17 tokens (its class token), SigLIP's 16


@pytest.fixture(scope="module", params=["clip", "siglip"])
def engine(request, tmp_path_factory, minilm_path: Path) -> Iterator[Engine]:
    path = tmp_path_factory.mktemp(request.param) / "hf"
    _save(_clip(eos_token_id=102), path, minilm_path) if request.param == "clip" else save_siglip(path, minilm_path)
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    yield engine
    engine.close()


def _texts() -> list[list[int]]:
    """Texts of several lengths, one with its EOS inside (CLIP pools there), within SigLIP's 64 positions: 155
    tokens, which a step pads to a bucket's 160 (engine/memory.py)."""
    return [*(text[:60] for text in clip_texts(seed=3)), [101, 2000, 102]]


def _images(count: int, seed: int = 0) -> np.ndarray:  # [N, 3, S, S] float32
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator).numpy()


def _close(rows: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=2e-5)


def test_a_step_of_texts_and_images_gives_each_its_own_kinds_row(engine: Engine) -> None:
    """Images first, between texts, last; an image request's own dimensions and normalisation kept."""
    texts, images, tokens = _texts(), _images(4), engine.image_tokens
    cut = RowOptions(dimensions=16, normalize=False)
    parts = [
        Batch.pack_images(images[:1], tokens), Batch.pack(texts[:3]), Batch.pack_images(images[1:3], tokens, cut),
        Batch.pack(texts[3:]), Batch.pack_images(images[3:], tokens),
    ]  # fmt: skip
    step = Batch.concat(parts)
    assert step.fixed_images and not step.all_images and step.cu_images is not None
    assert np.diff(step.cu_images).tolist() == [1, 0, 0, 0, 1, 1, *[0] * (len(texts) - 3), 1]
    rows = engine.embed(step)
    alone = [engine.embed(part) for part in parts]
    _close(rows[:, :16], np.concatenate([part[:, :16] for part in alone]))
    width = engine.dimension
    full = [0, 1, 2, 3, *range(6, step.num_seqs)]  # the rows of full width
    _close(rows[full], np.concatenate([alone[0], alone[1], alone[3], alone[4]]))
    assert step.slice(1, 4).pixel_values is not None and not len(step.slice(1, 4).pixel_values)
    _close(engine.embed(step.slice(3, 7)), np.concatenate([alone[1][2:], alone[2], alone[3][:1]])[:, :width])


def test_a_mixed_steps_texts_are_padded_to_a_bucket_its_images_never(engine: Engine) -> None:
    """On the CPU the text tower meets only the buckets' token counts (engine/memory.py), as a step of texts does;
    the pad text is the last sequence, its row dropped (the steps above ran so: `_texts`)."""
    assert engine.runner.token_buckets == 16
    texts, tokens = _texts(), engine.image_tokens
    step = Batch.concat([Batch.pack(texts), Batch.pack_images(_images(2), tokens)])
    text_tokens = sum(map(len, texts))
    assert text_tokens == 155 and bucket_tokens(text_tokens, 16) == 160
    padded = pad_to_bucket(step, 16)
    assert padded.num_seqs == step.num_seqs + 1 and padded.num_tokens == step.num_tokens + 5
    assert np.diff(padded.cu_images).tolist() == [0] * len(texts) + [1, 1, 0]
    np.testing.assert_array_equal(padded.pixel_values, step.pixel_values)


def test_the_scheduler_puts_waiting_texts_and_images_in_one_step(engine: Engine) -> None:
    """Both steps in flight held, an image request and a text request queue behind them; the next step cut holds
    both, and each request gets the rows it gets alone."""
    recorder = RecordingEngine(engine)
    replica = ReplicaThread(recorder, SchedulerConfig(max_batch_tokens=512, max_batch_seqs=64))
    images, texts = Batch.pack_images(_images(3, seed=1), engine.image_tokens), Batch.pack(_texts())
    try:
        with grpc.insecure_channel(replica.address) as channel:
            stub = embedding_pb2_grpc.EmbeddingStub(channel)
            recorder.hold()
            calls = []
            for count in (1, 2):  # both steps in flight, held: what comes after them queues
                calls.append(stub.Embed.future(embed_request(Batch.pack(_texts()[count:]))))
                wait_until(lambda count=count: len(recorder.batches) == count)
            for batch in (images, texts):
                queued = replica.scheduler.queued_seqs
                calls.append(stub.Embed.future(embed_request(batch)))
                wait_until(lambda queued=queued: replica.scheduler.queued_seqs > queued)
            recorder.release()
            rows = [response_rows(call.result(timeout=120)) for call in calls[2:]]
    finally:
        replica.stop()
        recorder.close()
    assert len(recorder.batches) == 3
    mixed = recorder.batches[2]
    assert mixed.fixed_images and mixed.num_seqs == images.num_seqs + texts.num_seqs and not mixed.all_images
    _close(rows[0], engine.embed(images))
    _close(rows[1], engine.embed(texts))
