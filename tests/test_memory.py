"""engine/memory.py: CPU steps' token counts rounded up to a bounded set of sizes, the rows unchanged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import bouquet
from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.engine.memory import bucket_tokens, pad_to_bucket


def test_counts_are_exact_up_to_twice_per_doubling_and_never_rounded_down() -> None:
    assert [bucket_tokens(n, 16) for n in range(1, 33)] == list(range(1, 33))
    for n in range(1, 5000):
        padded = bucket_tokens(n, 16)
        assert n <= padded < n + n / 16


def test_bounded_number_of_counts() -> None:
    assert len({bucket_tokens(n, 16) for n in range(1, 1025)}) == 112
    assert len({bucket_tokens(n, 8) for n in range(1, 1025)}) == 64
    assert [bucket_tokens(n, 0) for n in (1, 33, 1000)] == [1, 33, 1000]


def test_pad_adds_one_sequence_of_pad_tokens() -> None:
    batch = Batch.pack([[5] * 30, [6] * 9], RowOptions(dimensions=8, normalize=False))  # 39 tokens -> 40
    padded = pad_to_bucket(batch, 16)
    assert padded.num_tokens == 40 and padded.num_seqs == 3
    np.testing.assert_array_equal(padded.input_ids[:39], batch.input_ids)
    np.testing.assert_array_equal(padded.cu_seqlens[:3], batch.cu_seqlens)
    assert pad_to_bucket(Batch.pack([[5] * 40]), 16).num_seqs == 1  # already a bucket: as it was


def test_engine_rows_are_the_same_with_and_without_buckets(minilm_fp32, minilm_tokenizer) -> None:
    assert EngineConfig.cpu_token_buckets == minilm_fp32.runner.token_buckets == 16
    texts = [f"text {i} " + "about embeddings " * (3 * i) for i in range(9)]
    while pad_to_bucket(batch := Batch.pack(minilm_tokenizer.encode(texts)), 16) is batch:
        texts[-1] += " more"  # until the count is not a bucket's, so the batch is padded
    mixed = Batch(**{**batch.__dict__, "dimensions": np.arange(9, dtype=np.int32) % 2 * 64})
    bucketed = [minilm_fp32.embed(batch), minilm_fp32.embed(mixed)]
    minilm_fp32.runner.token_buckets = 0
    try:
        exact = [minilm_fp32.embed(batch), minilm_fp32.embed(mixed)]
    finally:
        minilm_fp32.runner.token_buckets = 16
    for got, want in zip(bucketed, exact, strict=True):
        assert got.shape == want.shape == (9, 384)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_pad_sequence_longer_than_the_position_table_runs(tmp_path: Path, minilm_path: Path) -> None:
    """SigLIP's 64 positions: a step of 2,100 tokens is padded to 2,176 by a pad sequence of 76 tokens, which sit at
    position 0 (as in a CUDA graph's buffers), not past the table; the rows are the exact count's."""
    from test_siglip import save_siglip

    save_siglip(tmp_path, minilm_path)
    batch = Batch.pack([[101, *range(1000 + i, 1058 + i), 102] for i in range(35)])
    assert pad_to_bucket(batch, 16).num_tokens - batch.num_tokens == 76
    engine = Engine(EngineConfig(model_path=tmp_path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    try:
        bucketed = engine.embed(batch)
        engine.runner.token_buckets = 0
        np.testing.assert_allclose(bucketed, engine.embed(batch), rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


@pytest.mark.parametrize("value", [-1])
def test_negative_buckets_refused(minilm_path, value: int) -> None:
    with pytest.raises(ValueError, match="cpu_token_buckets"):
        EngineConfig(minilm_path, "cpu", "float32", cpu_token_buckets=value)


# In a fresh process (oneDNN reads its settings at its first primitive): load the engine, then run steps of
# random sizes with two in flight, as a replica does, and report through oneDNN's own log whether any step built
# a primitive. The marker goes through C's stdio, as oneDNN's lines do, so the two stay in order.
_STEPS_AFTER_LOAD = """
import ctypes, random, sys
from bouquet.batch import Batch
from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.engine import Engine

engine = Engine(EngineConfig(default_model_path(), "cpu", "float32", cpu_warmup_tokens=int(sys.argv[1])))
libc = ctypes.CDLL(None)
libc.puts(b"=== loaded")
rng = random.Random(0)
steps = []
for _ in range(60):
    sizes = [rng.randint(1, 256) for _ in range(rng.choice([1, 1, 2, 4]))]
    steps.append(engine.step(Batch.pack([[rng.randrange(1000, 30000) for _ in range(n)] for n in sizes])))
    if len(steps) > 2:
        steps.pop(0).result()
for step in steps:
    step.result()
libc.fflush(None)
"""


def _primitives_built_by_steps(warmup_tokens: int) -> int:
    return _primitives_built(_STEPS_AFTER_LOAD, str(warmup_tokens))


def _primitives_built(script: str, *args: str, probe: str | None = None) -> int:
    env = {**os.environ, "ONEDNN_VERBOSE": "2", "PYTHONPATH": str(Path(bouquet.__file__).parents[1])}
    if probe is not None:
        env["BOUQUET_CPU_FEATURES"] = probe
    env.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    done = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    after_load = done.stdout.split("=== loaded", 1)[1]
    return sum("cache_miss" in line and "inner_product" in line for line in after_load.splitlines())


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.process
def test_steps_build_no_primitive_after_the_warmup() -> None:
    """Every bucketed count up to `cpu_warmup_tokens` is built at load, on both team sizes, and kept: the cache
    is sized for them (its default 1,024 evicted them and steps rebuilt them, memory creeping up)."""
    assert _primitives_built_by_steps(1024) == 0
    assert _primitives_built_by_steps(0) > 20  # without it: what the steps meet is built as they go


# The same for a CLIP model's image steps: whole images, never padded, so its vision tower is warmed at whole
# images' counts (`image_modules`), not at the text buckets, which it never meets.
_IMAGE_STEPS_AFTER_LOAD = """
import ctypes, random, sys
from pathlib import Path
import numpy as np
from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.engine.engine import Engine

engine = Engine(EngineConfig(Path(sys.argv[1]), "cpu", "float32", cpu_warmup_tokens=int(sys.argv[2])))
libc = ctypes.CDLL(None)
libc.puts(b"=== loaded")
rng = np.random.default_rng(0)
steps = []
for count in [1, 5, 2, 8, 3, 1, 7, 4, 6]:
    images = rng.standard_normal((count, *engine.image_shape)).astype(np.float32)
    steps.append(engine.step(Batch.pack_images(images, engine.image_tokens)))
    if len(steps) > 2:
        steps.pop(0).result()
for step in steps:
    step.result()
libc.fflush(None)
"""


def _save_clip(path: Path, tokenizer_dir: Path) -> int:
    from test_clip import IMAGE_TOKENS, _clip, _save

    _save(_clip(eos_token_id=102), path, tokenizer_dir)
    return IMAGE_TOKENS


def _save_siglip(path: Path, tokenizer_dir: Path) -> int:
    from test_siglip import IMAGE_TOKENS, save_siglip

    save_siglip(path, tokenizer_dir)
    return IMAGE_TOKENS


@pytest.mark.long
@pytest.mark.process
@pytest.mark.parametrize("save", [_save_clip, _save_siglip], ids=["clip", "siglip"])
def test_image_steps_build_no_primitive_after_the_warmup(save, tmp_path, minilm_path) -> None:
    """A patch embedding at the images' patches, a pooling head at one row an image or one probe row, the rest of
    the tower at its tokens: each is built for 1 to 8 images at load."""
    image_tokens = save(tmp_path, minilm_path)
    assert _primitives_built(_IMAGE_STEPS_AFTER_LOAD, str(tmp_path), str(8 * image_tokens)) == 0
    # A probe without AVX2 and FMA: every linear on oneDNN (with them, steps as short as these tiny towers' run on
    # layers/f32_short.py's kernel, which builds nothing)
    on_onednn = "sse4_1,avx,f16c"
    assert _primitives_built(_IMAGE_STEPS_AFTER_LOAD, str(tmp_path), str(8 * image_tokens), probe=on_onednn) == 0
    assert _primitives_built(_IMAGE_STEPS_AFTER_LOAD, str(tmp_path), "0", probe=on_onednn) >= 8  # built as met


def test_image_sequences_pad_with_one_pad_image() -> None:
    """SigLIP 2's step: its images' patches (75, beside a text) rounded up to a bucket (76) by one more sequence, a
    pad image of one row of patches of zeros; the sequences before it unchanged; exact counts left as they are."""
    rng = np.random.default_rng(0)
    grids = np.array([[1, 5, 7], [1, 4, 10]], np.int32)
    images = Batch.pack_image_sequences(rng.standard_normal((75, 12)).astype(np.float32), grids)
    batch = Batch.concat([Batch.pack([[101, 7, 102]]), images])
    padded = pad_to_bucket(batch, 16)
    assert padded.num_seqs == 4 and padded.num_tokens == 3 + 76 and len(padded.pixel_values) == 76
    assert padded.image_grid_thw.tolist() == [[1, 5, 7], [1, 4, 10], [1, 1, 1]] and padded.image_sequences
    np.testing.assert_array_equal(padded.pixel_values[:75], batch.pixel_values)
    assert not padded.pixel_values[75:].any() and padded.cu_images.tolist() == [0, 0, 1, 2, 3]
    np.testing.assert_array_equal(padded.cu_seqlens[:4], batch.cu_seqlens)
    assert pad_to_bucket(batch, 0) is batch
    on_bucket = Batch.pack_image_sequences(np.zeros((76, 12), np.float32), np.array([[1, 4, 19]], np.int32))
    assert pad_to_bucket(on_bucket, 16) is on_bucket


def test_siglip2_rows_are_the_same_with_and_without_buckets(tmp_path: Path, minilm_path: Path) -> None:
    """Texts and images of several grids in one step, its patches off the buckets: padded with a pad image, the
    rows are those of the exact count."""
    from siglip2_models import image, processed, save_siglip2

    save_siglip2(tmp_path, minilm_path)
    patches, grids, _ = processed(tmp_path, [image(w, h, s) for s, (w, h) in enumerate([(50, 80), (17, 9), (9, 300)])])
    images = Batch.pack_image_sequences(np.concatenate(patches), grids)
    batch = Batch.concat([Batch.pack([[101, *range(2000, 2009), 102]]), images, Batch.pack([[101, 2500, 102]])])
    assert pad_to_bucket(batch, 16) is not batch  # the step is padded
    engine = Engine(EngineConfig(model_path=tmp_path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    try:
        bucketed = engine.embed(batch)
        engine.runner.token_buckets = 0
        exact = engine.embed(batch)
    finally:
        engine.close()
    assert bucketed.shape == exact.shape == (5, 64)
    np.testing.assert_allclose(bucketed, exact, rtol=1e-5, atol=1e-6)


# SigLIP 2's image steps: patch counts of any value, padded to the text buckets' counts by a pad image, so the
# start-up build covers them too.
_NAFLEX_STEPS_AFTER_LOAD = """
import ctypes, sys
from pathlib import Path
import numpy as np
from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

engine = Engine(EngineConfig(Path(sys.argv[1]), "cpu", "float32", cpu_warmup_tokens=int(sys.argv[2])))
patch_dim = engine.image_patches[0]
libc = ctypes.CDLL(None)
libc.puts(b"=== loaded")
rng = np.random.default_rng(0)
steps = []
for _ in range(24):
    grids = np.array([[1, *rng.integers(1, 13, 2)] for _ in range(rng.integers(1, 5))], np.int32)
    pixels = rng.standard_normal((int(grids.prod(1).sum()), patch_dim)).astype(np.float32)
    steps.append(engine.step(Batch.pack_image_sequences(pixels, grids)))
    if len(steps) > 2:
        steps.pop(0).result()
for step in steps:
    step.result()
libc.fflush(None)
"""


@pytest.mark.long
@pytest.mark.process
def test_siglip2_image_steps_build_no_primitive_after_the_warmup(tmp_path: Path, minilm_path: Path) -> None:
    """Steps of 1 to 4 images of random grids (1 to 144 patches each): every count padded to a bucket built at
    load, so none builds a primitive; without the build, the steps build them as they go."""
    from siglip2_models import save_siglip2

    save_siglip2(tmp_path, minilm_path)
    assert _primitives_built(_NAFLEX_STEPS_AFTER_LOAD, str(tmp_path), "1024") == 0
    assert _primitives_built(_NAFLEX_STEPS_AFTER_LOAD, str(tmp_path), "0") >= 8


def test_patch_images_pad_with_one_sequence_holding_a_pad_image() -> None:
    """Qwen3-VL's step: 132 patches (merge 2) and 70 decoder tokens; one pad sequence, a pad image of 2 x 2 patches
    (136, a bucket) with its one placeholder, then pad tokens to the decoder's bucket (72); the rest unchanged."""
    placeholder, merge = 9, 2
    grids = np.array([[1, 6, 8], [1, 4, 12], [1, 6, 6]], np.int32)  # 48, 48 and 36 patches: 12, 12 and 9 tokens
    sequences = [[5] * 20 + [placeholder] * 12 + [6] * 3, [7] * 4, [8] * 2 + [placeholder] * 21 + [5] * 8]
    batch = Batch.pack(sequences).with_patch_images(np.ones((132, 24), np.float32), grids, [1, 0, 2])
    padded = pad_to_bucket(batch, 16, (merge, placeholder))
    assert (padded.num_seqs, padded.num_tokens, len(padded.pixel_values)) == (4, 72, 136)
    assert padded.input_ids[70:].tolist() == [placeholder, 0] and padded.image_grid_thw[3].tolist() == [1, 2, 2]
    assert padded.cu_images.tolist() == [0, 1, 1, 3, 4] and not padded.pixel_values[132:].any()
    np.testing.assert_array_equal(padded.input_ids[:70], batch.input_ids)
    np.testing.assert_array_equal(padded.pixel_values[:132], batch.pixel_values)
    assert pad_to_bucket(batch, 0, (merge, placeholder)) is batch


def test_qwen3_vl_rows_are_the_same_with_and_without_buckets(tmp_path: Path, minilm_path: Path) -> None:
    """Texts and images in one step, patches and tokens off the buckets: padded by a sequence holding a pad image,
    the rows are those of the exact counts."""
    from qwen3_vl_models import IMAGE_TOKEN, MERGE, image_tokens, images, preprocess, save_qwen3_vl

    save_qwen3_vl(tmp_path, minilm_path)
    processed = [preprocess(picture) for picture in images([(64, 48), (100, 33), (44, 44)])]
    sequences = [[1000, *image_tokens(processed[0][1]), 1001], [1002, 1003, 1004],
                 [*image_tokens(processed[1][1]), 1005, *image_tokens(processed[2][1])]]  # fmt: skip
    patches = np.concatenate([values for values, _ in processed])
    batch = Batch.pack(sequences).with_patch_images(patches, np.stack([grid for _, grid in processed]), [1, 0, 2])
    padded = pad_to_bucket(batch, 16, (MERGE, IMAGE_TOKEN))
    assert len(padded.pixel_values) > len(patches) and padded.num_tokens > batch.num_tokens  # both counts padded
    engine = Engine(EngineConfig(model_path=tmp_path, device="cpu", dtype="float32", cpu_warmup_tokens=0))
    try:
        bucketed = engine.embed(batch)
        engine.runner.token_buckets = 0
        exact = engine.embed(batch)
    finally:
        engine.close()
    assert bucketed.shape == exact.shape == (3, 64)
    np.testing.assert_allclose(bucketed, exact, rtol=1e-5, atol=1e-6)


# Qwen3-VL's steps: texts with images of random grids inside them, both the vision tower's patches and the
# decoder's tokens padded to the buckets' counts by a sequence holding a pad image. Lone steps are off: whether a
# short step widens its team depends on timings, and one run with them built the merger's few rows (benchmarks.md).
_QWEN3_VL_STEPS_AFTER_LOAD = """
import ctypes, sys
from pathlib import Path
import numpy as np
from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine

engine = Engine(EngineConfig(Path(sys.argv[1]), "cpu", "float32", cpu_warmup_tokens=int(sys.argv[2]),
                             cpu_lone_step_tokens=0))
patch_dim, merge, placeholder, _, _ = engine.image_patches
libc = ctypes.CDLL(None)
libc.puts(b"=== loaded")
rng = np.random.default_rng(0)
steps = []
for _ in range(24):
    grids = np.array([[1, *(merge * rng.integers(1, 7, 2))] for _ in range(rng.integers(1, 4))], np.int32)
    sequences = [[*rng.integers(1000, 29000, rng.integers(1, 30)), *[placeholder] * (int(g.prod()) // merge**2)]
                 for g in grids]
    pixels = rng.standard_normal((int(grids.prod(1).sum()), patch_dim)).astype(np.float32)
    steps.append(engine.step(Batch.pack(sequences).with_patch_images(pixels, grids, [1] * len(grids))))
    if len(steps) > 2:
        steps.pop(0).result()
for step in steps:
    step.result()
libc.fflush(None)
"""


@pytest.mark.long
@pytest.mark.process
def test_qwen3_vl_steps_build_no_primitive_after_the_warmup(tmp_path: Path, minilm_path: Path) -> None:
    """Steps of 1 to 3 texts each holding an image of a random grid: the decoder's tokens, the vision tower's
    patches and the merger's rows all land on counts built at load."""
    from qwen3_vl_models import save_qwen3_vl

    save_qwen3_vl(tmp_path, minilm_path)
    assert _primitives_built(_QWEN3_VL_STEPS_AFTER_LOAD, str(tmp_path), "1024") == 0
    assert _primitives_built(_QWEN3_VL_STEPS_AFTER_LOAD, str(tmp_path), "0") >= 8
