"""Qwen3-VL's images on the wire: token sequences holding images of any size (EmbedRequest.image_grid_thw) through
a real replica (gRPC on loopback, the scheduler) against the engine's own rows; the scheduler packs text-only and
image sequences into one step under the token budget, an image counting its tokens and the vision tower's patches;
malformed requests are InvalidInput and never reach the engine."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from qwen3_vl_models import IMAGE_TOKEN, image_tokens, images, preprocess, save_qwen3_vl
from test_qwen3_vl import _batch, _engine, _mixed_sequences, _words

from bouquet.batch import Batch, RowOptions
from bouquet.config import SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.proto import embedding_pb2
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.replica.testing import RecordingEngine, ReplicaThread


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory, minilm_path: Path) -> Iterator[Engine]:
    path = tmp_path_factory.mktemp("qwen3_vl") / "hf"
    save_qwen3_vl(path, minilm_path)
    engine = _engine(path, "float32")
    yield engine
    engine.close()


@pytest.fixture
def recorder(vl_engine: Engine) -> Iterator[RecordingEngine]:
    recorder = RecordingEngine(vl_engine)
    yield recorder
    recorder.close()


@pytest.fixture
def replica(recorder: RecordingEngine) -> Iterator[ReplicaThread]:
    server = ReplicaThread(recorder, SchedulerConfig(max_batch_tokens=64, max_batch_seqs=8))
    yield server
    server.stop()


def test_info_says_the_model_takes_images_of_any_size(stub) -> None:
    info = stub.Info(embedding_pb2.InfoRequest(), timeout=30)
    assert info.image_patch_dim == 3 * 2 * 8 * 8 and info.image_tokens == 0 and not info.image_shape
    assert '"merge_size": 2' in info.image_processor_json


def test_texts_and_images_share_steps_through_a_replica(stub, recorder: RecordingEngine, vl_engine: Engine) -> None:
    """A mixed request, a text request and another mixed one at once: each gets the engine's rows; with a 64-token
    budget their sequences are cut into steps that mix texts and images."""
    import torch

    generator = torch.Generator().manual_seed(5)
    batches = [
        _batch(*_mixed_sequences(seed=2)),
        Batch.pack([_words(generator, n) for n in (4, 30, 9)]),
        _batch(*_mixed_sequences(seed=3)).slice(1, 5),
    ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda b: response_rows(stub.Embed(embed_request(b), timeout=120)), batches))
    for batch, rows in zip(batches, results, strict=True):
        np.testing.assert_allclose(rows, vl_engine.embed(batch), rtol=1e-4, atol=2e-5)
    steps = recorder.batches
    assert all(step.budget_tokens <= 64 or step.num_seqs == 1 for step in steps)
    mixed = [s for s in steps if s.cu_images is not None and (np.diff(s.cu_images) == 0).any()]
    assert mixed, "no step held a text-only sequence beside an image sequence"


def test_a_step_counts_the_vision_towers_patches_in_its_budget(
    stub, replica: ReplicaThread, recorder: RecordingEngine, vl_engine: Engine
) -> None:
    """Five sequences of 43 tokens, which by tokens alone fit one 64-token step; their 56 patches (4 for each image
    token, before the 2 x 2 merger) count too, so the scheduler cuts two steps, each within 64 of tokens and patches
    together."""
    import torch

    generator = torch.Generator().manual_seed(7)
    (small, small_grid), (wide, wide_grid) = (preprocess(picture) for picture in images([(32, 32), (48, 32)]))
    assert small_grid.tolist() == [1, 4, 4] and wide_grid.tolist() == [1, 4, 6]  # 16 and 24 patches
    sequences = [
        [*_words(generator, 2), *image_tokens(small_grid), *_words(generator, 1)],  # 9 tokens + 16 patches
        _words(generator, 10),
        [*_words(generator, 1), *image_tokens(wide_grid), *_words(generator, 1)],  # 10 tokens + 24 patches
        _words(generator, 6),
        [*_words(generator, 1), *image_tokens(small_grid), *_words(generator, 1)],  # 8 tokens + 16 patches
    ]
    batch = Batch.pack(sequences).with_patch_images(
        np.concatenate([small, wide, small]), np.stack([small_grid, wide_grid, small_grid]), [1, 0, 1, 0, 1]
    )
    assert batch.num_tokens == 43 and batch.budget_tokens == 43 + 56
    rows = response_rows(stub.Embed(embed_request(batch), timeout=120))
    np.testing.assert_allclose(rows, vl_engine.embed(batch), rtol=1e-4, atol=2e-5)
    steps = recorder.batches
    assert [step.num_seqs for step in steps] == [2, 3]  # 25 + 10 = 35, then 34 + 6 + 24 = 64
    assert [step.num_tokens + len(step.pixel_values) for step in steps] == [35, 64]
    assert [step.budget_tokens for step in steps] == [35, 64]
    assert replica.scheduler.metrics.value("bouquet_batch_tokens_sum") == 99  # the step metrics count alike


def _message(**change) -> embedding_pb2.EmbedRequest:
    patches, grid = preprocess(images([(40, 24)])[0])
    batch = Batch.pack([[5, *image_tokens(grid), 6], [7, 8]], RowOptions())
    message = embed_request(batch.with_patch_images(patches, grid[None], [1, 0]))
    for name, value in change.items():
        if name == "image_shape":
            message.image_shape.extend(value)
        else:
            setattr(message, name, value)
    return message


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (dict(image_grid_thw=np.array([1, 2, 2, 9], "<i4").tobytes()), "not \\(frames, rows, columns\\)"),
        (dict(image_grid_thw=np.array([2, 2, 4], "<i4").tobytes()), "must be \\(1, rows, columns\\)"),
        (dict(image_grid_thw=np.array([1, 3, 4], "<i4").tobytes()), "multiples of 2"),
        (dict(image_grid_thw=np.array([1, 4, 6], "<i4").tobytes()), "pixel_values has"),
        (dict(cu_images=np.array([0, 1], "<i4").tobytes()), "cu_images must go from 0 to 1 in 3 values"),
        (dict(cu_images=np.array([0, 0, 1], "<i4").tobytes()), "sequence 0 has 4 image tokens; its images make 0"),
        (dict(pixel_values=b"\0" * 12), "pixel_values has 12 bytes"),
        (dict(image_shape=[3, 32, 32]), "not image_shape"),
        (dict(key_lens=np.array([3, 2], "<i4").tobytes()), "no token_type_ids, spans, key_lens"),
        (dict(sparse=True), "no sparse rows"),
    ],
)
def test_malformed_image_requests_are_invalid_input(vl_engine: Engine, change: dict, error: str) -> None:
    limits = Limits.from_engine(vl_engine)
    assert decode_request(_message(), limits).num_tokens == 1 + 6 + 1 + 2  # the unchanged message is accepted
    with pytest.raises(InvalidInput, match=error):
        decode_request(_message(**change), limits)


def test_placeholder_tokens_without_images_are_refused(vl_engine: Engine, minilm_fp32: Engine) -> None:
    """A text request holding the placeholder token would make a step with images miscount its image tokens."""
    limits = Limits.from_engine(vl_engine)
    with pytest.raises(InvalidInput, match="placeholder token comes only with images"):
        decode_request(embed_request(Batch.pack([[5, IMAGE_TOKEN, 6]])), limits)
    with pytest.raises(InvalidInput, match="takes no images of varying size"):
        decode_request(_message(), Limits.from_engine(minilm_fp32))
