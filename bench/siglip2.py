"""SigLIP 2's (NaFlex) image path in-process against transformers' on the same images: a random-weight Siglip2Model
of reduced size (no real weights on this machine; speed does not depend on their values), photos of several aspect
ratios (JPEG-sized, and two panoramas) through transformers' own Siglip2ImageProcessorPil at its default 256 patches.
bouquet's engine runs them as one packed step, each image as long as its own patches; transformers as its processor
hands them over, every image padded to `max_num_patches` with the pixel attention mask. Prints images/s of each
(median of the rounds), their ratio, the patches each computes, and the rows' agreement.

    PYTHONPATH=src:bench .venv/bin/python bench/siglip2.py [--images 8] [--rounds 3] [--dtype float32]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from image_models import SIZES, image

PANORAMAS = [(1600, 400), (300, 1200)]  # (width, height): far from square, where padding costs most


def build(path: Path):
    from transformers import Siglip2Config, Siglip2ImageProcessorPil, Siglip2Model

    torch.manual_seed(0)
    tower = dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=6, intermediate_size=1536)
    config = Siglip2Config(
        text_config=dict(tower, vocab_size=2000, max_position_embeddings=64),
        vision_config=dict(tower, patch_size=16, num_patches=256),
    )
    model = Siglip2Model(config).eval()
    model.save_pretrained(path)
    processor = Siglip2ImageProcessorPil(patch_size=16, max_num_patches=256)
    processor.save_pretrained(path)
    (path / "tokenizer.json").write_text(_word_level_tokenizer())
    return model, processor


def _word_level_tokenizer() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(2000)}, unk_token="w5"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


def timed(run, rounds: int) -> tuple[float, np.ndarray]:
    rows = run()  # warm-up
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        rows = run()
        times.append(time.perf_counter() - start)
    return statistics.median(times), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    from bouquet.batch import Batch
    from bouquet.config import EngineConfig
    from bouquet.engine.engine import Engine

    sizes = [*PANORAMAS, *SIZES]
    pictures = [image(*sizes[i % len(sizes)], i) for i in range(args.images)]
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        model, processor = build(path)
        inputs = processor(images=pictures, return_tensors="pt")
        shapes = inputs["spatial_shapes"].numpy()
        patches = np.concatenate([inputs["pixel_values"][i, : r * c].numpy() for i, (r, c) in enumerate(shapes)])
        grids = np.concatenate([np.ones((len(shapes), 1), np.int32), shapes.astype(np.int32)], axis=1)
        print(f"{args.images} images, {len(patches)} patches (transformers pads them to "
              f"{inputs['pixel_values'].shape[0] * inputs['pixel_values'].shape[1]}), torch threads "
              f"{torch.get_num_threads()}")  # fmt: skip
        engine = Engine(EngineConfig(path, "cpu", args.dtype))
        try:
            batch = Batch.pack_image_sequences(patches, grids)
            ours, rows = timed(lambda: engine.embed(batch), args.rounds)
        finally:
            engine.close()

        def reference() -> np.ndarray:
            with torch.no_grad():
                return model.get_image_features(**inputs).pooler_output.numpy()

        theirs, expected = timed(reference, args.rounds)
    cosines = (rows * expected).sum(1) / np.linalg.norm(rows, axis=1) / np.linalg.norm(expected, axis=1)
    print(f"bouquet engine ({args.dtype}): {args.images / ours:.2f} images/s ({ours * 1000:.0f} ms a step)")
    print(f"transformers (float32, padded batch): {args.images / theirs:.2f} images/s ({theirs * 1000:.0f} ms)")
    print(f"ratio {theirs / ours:.2f}x; rows' min cosine {cosines.min():.7f}")


if __name__ == "__main__":
    main()
