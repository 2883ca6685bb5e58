"""Qwen3-VL-Embedding's engine path in-process against transformers' on the same inputs: a random-weight
Qwen3VLForConditionalGeneration of reduced size (no real weights on this machine; speed does not depend on their
values), conversations of one image (JPEG-sized photos, resized by transformers' smart_resize within 448 x 448
pixels) and a short text, embedded as one step by bouquet's engine and as one padded batch by transformers'
Qwen3VLModel with Qwen3-VL-Embedding's pooling (right padding, the last real token, L2 normalisation: its
embedder's). Prints images/s of each (median of the rounds), their ratio, and the rows' agreement.

    PYTHONPATH=src .venv/bin/python bench/qwen3_vl.py [--images 8] [--rounds 3] [--dtype float32]
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

START, END, PAD_IMAGE, PAD = 1, 2, 3, 0  # the bench's own token ids: vision start and end, image placeholder, pad
MERGE = 2


def build(path: Path):
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=2000, hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=64, intermediate_size=1536, max_position_embeddings=4096,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=6, hidden_size=384, num_heads=6, intermediate_size=1536, patch_size=16,
                           out_hidden_size=512, num_position_embeddings=2304, deepstack_visual_indexes=[1, 3, 5]),
        image_token_id=PAD_IMAGE, video_token_id=4, vision_start_token_id=START, vision_end_token_id=END,
    )  # fmt: skip
    model = Qwen3VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    size = {"shortest_edge": 4096, "longest_edge": 448 * 448}
    processor = Qwen2VLImageProcessorPil(
        patch_size=16, merge_size=MERGE, size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor.save_pretrained(path)
    (path / "tokenizer.json").write_text(_word_level_tokenizer())
    return model, processor


def _word_level_tokenizer() -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(2000)}, unk_token="w5"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return tokenizer.to_str()


def inputs(processor, count: int):
    """Token sequences (text, the image's placeholders, text), the images' patches and grids."""
    rng = np.random.default_rng(1)
    out = processor(images=[image(*SIZES[i % len(SIZES)], i) for i in range(count)], return_tensors="np")
    grids = np.asarray(out["image_grid_thw"], np.int32)
    sequences = []
    for grid in grids:
        text = rng.integers(10, 2000, 12).tolist()
        sequences.append([*text[:6], START, *[PAD_IMAGE] * (int(grid.prod()) // MERGE**2), END, *text[6:]])
    return sequences, np.asarray(out["pixel_values"], np.float32), grids


def transformers_rows(model, sequences, patches, grids) -> np.ndarray:
    longest = max(map(len, sequences))
    ids = torch.tensor([s + [PAD] * (longest - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in sequences])
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=mask, pixel_values=torch.from_numpy(patches),
                             image_grid_thw=torch.from_numpy(grids).long(),
                             mm_token_type_ids=(ids == PAD_IMAGE).int()).last_hidden_state  # fmt: skip
    last = mask.sum(1) - 1
    return torch.nn.functional.normalize(hidden[torch.arange(len(sequences)), last], dim=-1).numpy()


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

    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory)
        model, processor = build(path)
        sequences, patches, grids = inputs(processor, args.images)
        tokens = sum(map(len, sequences))
        print(f"{args.images} conversations, {tokens} tokens ({len(patches)} patches), torch threads "
              f"{torch.get_num_threads()}")  # fmt: skip
        engine = Engine(EngineConfig(path, "cpu", args.dtype))
        try:
            batch = Batch.pack(sequences).with_patch_images(patches, grids, [1] * len(sequences))
            ours, rows = timed(lambda: engine.embed(batch), args.rounds)
        finally:
            engine.close()
        theirs, expected = timed(lambda: transformers_rows(model, sequences, patches, grids), args.rounds)
    cosines = (rows * expected).sum(1) / np.linalg.norm(rows, axis=1)
    print(f"bouquet engine ({args.dtype}): {args.images / ours:.2f} images/s ({ours * 1000:.0f} ms a step)")
    print(f"transformers (float32, padded batch): {args.images / theirs:.2f} images/s ({theirs * 1000:.0f} ms)")
    print(f"ratio {theirs / ours:.2f}x; rows' min cosine {cosines.min():.7f}")


if __name__ == "__main__":
    main()
