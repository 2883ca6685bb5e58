"""What a CPU image step at a patch count the replica has not met costs, against the same step again: a reduced
random-weight SigLIP 2 (NaFlex: each image as many patches as its grid, so a step's vision tokens take any count)
behind bouquet's engine with its serving defaults (the text buckets' primitives built at start-up, up to 1,024
tokens). One image a step, grids of 300-1,000 patches: counts that are not a text bucket's (run exactly, oneDNN
builds the vision tower's primitives for them at the step; padded to a bucket, it has them) and counts that are
one. Prints, per kind, the median of first call minus the median of three repeats, and the repeat itself; the
resident memory that `--sweep` more steps at new counts of each kind add (oneDNN keeps every primitive it builds);
and what the padding costs: the off-bucket steps' repeats padded against exact, interleaved.

    PYTHONPATH=src:bench .venv/bin/python bench/image_step_shapes.py [--layers 2] [--width 768] [--counts 12]
        [--sweep 200]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.engine import Engine
from bouquet.engine.memory import bucket_tokens

PATCH = 16


def build(path: Path, layers: int, width: int) -> None:
    from siglip2 import _word_level_tokenizer
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model

    torch.manual_seed(0)
    tower = dict(hidden_size=width, num_hidden_layers=layers, num_attention_heads=width // 64,
                 intermediate_size=4 * width)  # fmt: skip
    config = Siglip2Config(
        text_config=dict(tower, vocab_size=2000, max_position_embeddings=64),
        vision_config=dict(tower, patch_size=PATCH, num_patches=256),
    )
    Siglip2Model(config).eval().save_pretrained(path)
    Siglip2ImageProcessorPil(patch_size=PATCH, max_num_patches=1024).save_pretrained(path)
    (path / "tokenizer.json").write_text(_word_level_tokenizer())


def grids(bucketed: bool, per_doubling: int, low: int = 300, high: int = 1000) -> dict[int, tuple[int, int]]:
    """A grid (rows, columns) for each count of `low`-`high` patches on a text bucket, or off one, the squarest."""
    found: dict[int, tuple[int, int]] = {}
    for patches in range(low, high + 1):
        if (bucket_tokens(patches, per_doubling) == patches) == bucketed:
            rows = max(r for r in range(1, int(patches**0.5) + 1) if patches % r == 0)
            found[patches] = (rows, patches // rows)
    return found


def spread(found: dict[int, tuple[int, int]], count: int) -> list[tuple[int, int]]:
    chosen = sorted(found)[:: max(1, len(found) // count)][:count]
    return [found.pop(patches) for patches in chosen]


def resident_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def step_seconds(engine: Engine, grid: tuple[int, int], rng: np.random.Generator) -> tuple[float, float]:
    """(first call, median of three repeats) of a step of one image of this grid."""
    rows, columns = grid
    patches = rng.standard_normal((rows * columns, 3 * PATCH * PATCH)).astype(np.float32)
    batch = Batch.pack_image_sequences(patches, np.array([[1, rows, columns]], np.int32))
    times = []
    for _ in range(4):
        start = time.perf_counter()
        engine.step(batch).result()
        times.append(time.perf_counter() - start)
    return times[0], statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--counts", type=int, default=12)
    parser.add_argument("--sweep", type=int, default=200)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as directory:
        build(Path(directory), args.layers, args.width)
        start = time.perf_counter()
        engine = Engine(EngineConfig(Path(directory), "cpu", "float32"))
        print(f"engine loaded, primitives built: {time.perf_counter() - start:.1f} s")
        per_doubling = engine.config.cpu_token_buckets
        step_seconds(engine, (20, 20), rng)  # the first step's own one-off costs, outside the figures
        kinds = {bucketed: grids(bucketed, per_doubling) for bucketed in (False, True)}
        for bucketed, found in kinds.items():
            results = [step_seconds(engine, grid, rng) for grid in spread(found, args.counts)]
            extra = statistics.median(first - repeat for first, repeat in results)
            repeat = statistics.median(repeat for _, repeat in results)
            print(f"{len(results)} counts {_kind(bucketed)}: first call +{1e3 * extra:.1f} ms over a repeat of "
                  f"{1e3 * repeat:.1f} ms ({args.layers} layers of width {args.width} a tower)")  # fmt: skip
        for bucketed, found in kinds.items():
            sweep = spread(found, args.sweep)
            before = resident_mb()
            for grid in sweep:
                patches = rng.standard_normal((grid[0] * grid[1], 3 * PATCH * PATCH)).astype(np.float32)
                engine.step(Batch.pack_image_sequences(patches, np.array([[1, *grid]], np.int32))).result()
            grown = resident_mb() - before
            print(f"{len(sweep)} more counts {_kind(bucketed)}: resident memory +{grown:.0f} MB "
                  f"({grown / len(sweep):.2f} MB a count)")  # fmt: skip
        padded, exact = [], []
        for grid in spread(grids(False, per_doubling), args.counts):
            step_seconds(engine, grid, rng)  # built, if it runs exactly
            for buckets, times in ((per_doubling, padded), (0, exact)):
                engine.runner.token_buckets = buckets
                times.append(step_seconds(engine, grid, rng)[1])
        engine.runner.token_buckets = per_doubling
        print(f"padding's cost on {len(exact)} counts off the buckets: repeats {1e3 * statistics.median(padded):.1f} "
              f"ms padded, {1e3 * statistics.median(exact):.1f} ms exact")  # fmt: skip
        engine.close()


def _kind(bucketed: bool) -> str:
    return "on a text bucket" if bucketed else "off the text buckets"


if __name__ == "__main__":
    main()
