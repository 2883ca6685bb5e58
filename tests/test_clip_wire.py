"""Images on the wire: an EmbedRequest's pixel_values through a real replica (gRPC on loopback, the scheduler) to
a CLIP engine, against the engine's own rows (steps mixing texts and images: test_two_tower_steps.py); malformed
image requests are InvalidInput."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_clip import IMAGE_TOKENS, _clip, _engine, _images, _save, _texts

from bouquet.batch import Batch, RowOptions
from bouquet.config import SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.proto import embedding_pb2
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.replica.testing import RecordingEngine, ReplicaThread


@pytest.fixture(scope="module")
def clip_engine(tmp_path_factory, minilm_path: Path) -> Iterator[Engine]:
    path = tmp_path_factory.mktemp("clip") / "hf"
    _save(_clip(eos_token_id=102), path, minilm_path)
    engine = _engine(path, "float32")
    yield engine
    engine.close()


@pytest.fixture
def clip_recorder(clip_engine: Engine) -> Iterator[RecordingEngine]:
    recorder = RecordingEngine(clip_engine)
    yield recorder
    recorder.close()


@pytest.fixture
def replica(clip_recorder: RecordingEngine) -> Iterator[ReplicaThread]:
    server = ReplicaThread(clip_recorder, SchedulerConfig(max_batch_tokens=40, max_batch_seqs=8))
    yield server
    server.stop()


def test_info_says_which_images_the_model_takes(stub) -> None:
    info = stub.Info(embedding_pb2.InfoRequest(), timeout=30)
    assert list(info.image_shape) == [3, 32, 32] and info.image_tokens == IMAGE_TOKENS
    assert info.HasField("logit_scale") and not info.HasField("logit_bias")  # CLIP's scale, and no bias


def test_images_and_texts_through_a_replica(stub, clip_recorder: RecordingEngine, clip_engine: Engine) -> None:
    """Image and text requests at once: each gets the engine's rows; a step (40 tokens) holds two images at most."""
    batches = [
        Batch.pack_images(_images(5), IMAGE_TOKENS),
        Batch.pack(_texts()),
        Batch.pack_images(_images(2, seed=1), IMAGE_TOKENS, RowOptions(dimensions=16, normalize=False)),
    ]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda b: response_rows(stub.Embed(embed_request(b), timeout=120)), batches))
    for batch, rows in zip(batches, results, strict=True):
        expected = clip_engine.embed(batch)[:, : batch.width(48)]
        np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=2e-5)
    steps = clip_recorder.batches
    assert all(b.pixel_values is None or len(b.pixel_values) <= 2 for b in steps)  # the five images were split


def _limits(engine: Engine) -> Limits:
    return Limits.from_engine(engine)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(image_shape=[3, 64, 64]), r"image_shape \[3, 64, 64\]; this model takes images of shape \[3, 32, 32\]"),
        (dict(pixel_values=b"\0" * 100), "pixel_values has 100 bytes"),
        (dict(input_ids=b"\0" * 4), "no token ids"),
        (dict(sparse=True), "no token ids"),
        (dict(dimensions=49), r"dimensions must be in \[0, 48\]"),
    ],
)
def test_malformed_image_requests_are_invalid_input(clip_engine: Engine, change: dict, message: str) -> None:
    request = embed_request(Batch.pack_images(_images(2), IMAGE_TOKENS))
    for field, value in change.items():
        if field == "image_shape":
            del request.image_shape[:]
            request.image_shape.extend(value)
        else:
            setattr(request, field, value)
    with pytest.raises(InvalidInput, match=message):
        decode_request(request, _limits(clip_engine))


def test_a_text_model_refuses_images_on_the_wire(clip_engine: Engine) -> None:
    limits = replace(_limits(clip_engine), image_shape=(), image_tokens=0)
    with pytest.raises(InvalidInput, match="takes no images"):
        decode_request(embed_request(Batch.pack_images(_images(1), IMAGE_TOKENS)), limits)


def test_an_image_request_decodes_to_the_batch_sent(clip_engine: Engine) -> None:
    batch = Batch.pack_images(_images(3), IMAGE_TOKENS, RowOptions(dimensions=8))
    decoded = decode_request(embed_request(batch), _limits(clip_engine))
    np.testing.assert_array_equal(decoded.pixel_values, batch.pixel_values)
    np.testing.assert_array_equal(decoded.cu_seqlens, batch.cu_seqlens)
    assert decoded.options() == batch.options()
