"""SigLIP 2's images on the wire: each image a sequence of its own (Batch.pack_image_sequences; EmbedRequest's
image_grid_thw and cu_images with InfoResponse.image_sequences) through a real replica (gRPC on loopback, the
scheduler) against the engine's own rows; texts and images of several sizes share steps under the token budget, an
image counting its patches; malformed requests are InvalidInput and never reach the engine."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from siglip2_models import image, processed, save_siglip2

from bouquet.batch import Batch
from bouquet.config import EngineConfig, SchedulerConfig
from bouquet.engine.engine import Engine
from bouquet.models.siglip2 import MAX_IMAGE_PATCHES
from bouquet.proto import embedding_pb2
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.request import InvalidInput, Limits, decode_request
from bouquet.replica.testing import RecordingEngine, ReplicaThread

SIZES = [(50, 80), (300, 120), (32, 32), (17, 9), (9, 300)]  # (width, height)


@pytest.fixture(scope="module")
def siglip2_engine(tmp_path_factory, minilm_path: Path) -> Iterator[Engine]:
    path = tmp_path_factory.mktemp("siglip2") / "hf"
    save_siglip2(path, minilm_path)
    engine = Engine(EngineConfig(model_path=path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def images(siglip2_engine: Engine) -> Batch:
    patches, grids, _ = processed(siglip2_engine.spec.tokenizer_file.parent, [image(w, h, s) for s, (w, h) in
                                                                           enumerate(SIZES)])  # fmt: skip
    return Batch.pack_image_sequences(np.concatenate(patches), grids)


@pytest.fixture
def recorder(siglip2_engine: Engine) -> Iterator[RecordingEngine]:
    recorder = RecordingEngine(siglip2_engine)
    yield recorder
    recorder.close()


@pytest.fixture
def replica(recorder: RecordingEngine) -> Iterator[ReplicaThread]:
    server = ReplicaThread(recorder, SchedulerConfig(max_batch_tokens=64, max_batch_seqs=8))
    yield server
    server.stop()


def test_info_says_each_image_is_a_sequence_of_its_own(stub) -> None:
    info = stub.Info(embedding_pb2.InfoRequest(), timeout=30)
    assert info.image_patch_dim == 3 * 8 * 8 and info.image_sequences and info.image_tokens == 0
    assert not info.image_shape and not info.chat_template and '"max_num_patches": 48' in info.image_processor_json
    assert info.image_max_patches == MAX_IMAGE_PATCHES  # the bound the replica refuses over (the gateway's too)
    assert info.HasField("logit_scale") and info.HasField("logit_bias")  # the checkpoint's, for zero-shot scores


def test_texts_and_images_share_steps_through_a_replica(
    stub, recorder: RecordingEngine, siglip2_engine: Engine, images: Batch
) -> None:
    """A request mixing texts and images, a text request and an image request at once: each gets the engine's rows;
    with a 64-token budget, where an image counts its patches (40 each here), their sequences are cut into steps,
    some mixing texts and images."""
    texts = Batch.pack([[101, *range(2000, 2000 + n), 102] for n in (4, 30, 9, 0)])
    mixed = Batch.concat([texts.slice(0, 1), images.slice(0, 1), texts.slice(1, 4), images.slice(1, 5)])
    batches = [mixed, texts, images.slice(1, 4)]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(lambda b: response_rows(stub.Embed(embed_request(b), timeout=120)), batches))
    for batch, rows in zip(batches, results, strict=True):
        np.testing.assert_allclose(rows, siglip2_engine.embed(batch), rtol=1e-4, atol=2e-5)
    steps = recorder.batches
    assert all(step.num_tokens <= 64 or step.num_seqs == 1 for step in steps)
    assert all(step.budget_tokens == step.num_tokens for step in steps)
    assert any(step.cu_images is not None and (np.diff(step.cu_images) == 0).any() for step in steps), "no mix"


def _message(images: Batch, **change) -> embedding_pb2.EmbedRequest:
    mixed = Batch.concat([images.slice(0, 2), Batch.pack([[101, 0, 7, 102]])])  # a text may hold id 0 (a pad)
    message = embed_request(mixed)
    for name, value in change.items():
        setattr(message, name, value)
    return message


def _int32s(*values: int) -> bytes:
    return np.array(values, "<i4").tobytes()


_BIG = np.zeros((20000 + 40) * 3 * 8 * 8, "<f4").tobytes()


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (dict(cu_images=_int32s(0, 2, 2, 2)), "sequence 0 holds 2 images"),
        (dict(cu_images=_int32s(0, 0, 1, 2)), "image 1 has 40 patches in a sequence of 4 tokens"),
        (dict(image_grid_thw=_int32s(1, 4, 9, 1, 4, 11)), "image 0 has 36 patches in a sequence of 40 tokens"),
        (dict(image_grid_thw=_int32s(1, 1000, 20, 1, 4, 10), pixel_values=_BIG), "20000 patches; at most 16384"),
        (dict(input_ids=_int32s(*[0] * 4, 3, *[0] * 75, 101, 0, 7, 102)), "holds only zeros"),
        (dict(image_grid_thw=_int32s(1, 8, 5, 1, 4, 10, 1, 1, 1)), "cu_images must go from 0 to 3"),
    ],
)
def test_malformed_image_requests_are_invalid_input(siglip2_engine: Engine, images: Batch, change, error) -> None:
    limits = Limits.from_engine(siglip2_engine)
    assert images.image_grid_thw[:2, 1:].tolist() == [[8, 5], [4, 10]]  # what the changes above assume
    assert decode_request(_message(images), limits).num_tokens == 40 + 40 + 4  # the unchanged message is accepted
    with pytest.raises(InvalidInput, match=error):
        decode_request(_message(images, **change), limits)


def test_texts_keep_the_text_limit_beside_longer_images(siglip2_engine: Engine, images: Batch) -> None:
    """An image of 40 patches is fine beside texts; a text of 65 tokens is over the model's 64 even then."""
    limits = Limits.from_engine(siglip2_engine)
    long_text = Batch.concat([images.slice(1, 2), Batch.pack([[5] * 65])])
    with pytest.raises(InvalidInput, match="sequence 1 has 65 tokens; this model takes at most 64"):
        decode_request(embed_request(long_text), limits)
    assert decode_request(embed_request(Batch.pack([[101, 0, 0, 102]])), limits).num_tokens == 4
