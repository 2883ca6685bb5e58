"""Ways of running SDPA over packed variable-length sequences on the CPU, measured on the whole model.

The SDPA backend groups sequences into padded batches whose attention efficiency (real work over padded
work) stays above `min_efficiency`. Its two ends are the other designs: 0 puts the whole batch in one
padded call (a block-diagonal mask in effect, with padding), above 1 gives every sequence its own call.
Batches are cut from real documents two ways: length-sorted (what `bouquet embed` does) and in arrival
order (what the replica's first come, first served queue gives). Runs are interleaved; medians reported.

    .venv/bin/python bench/attention.py [--dtype bfloat16] [--batch-tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import corpus
import numpy as np

from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.batch import Batch
from bouquet.engine.engine import Engine
from bouquet.layers.attention_backends.sdpa import SdpaBackend
from bouquet.offline.embed import split_by_token_budget
from bouquet.tokenizer import TextTokenizer, pack

STRATEGIES = {"one padded call": 0.0, "grouped (0.5)": 0.5, "grouped (0.8)": 0.8, "per sequence": 1.01}


def batches_of(ids: list[list[int]], batch_tokens: int) -> list[Batch]:
    batches = []
    for run in split_by_token_budget([len(seq) for seq in ids], batch_tokens):
        packed = pack(ids[run])
        batches.append(Batch.from_packed(packed.input_ids, packed.cu_seqlens))
    return batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    engine = Engine(EngineConfig(default_model_path(), "cpu", args.dtype))
    ids = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length).encode(corpus.documents())
    tokens = sum(map(len, ids))
    orders = {"length-sorted": sorted(ids, key=len), "arrival order": ids}
    print(f"{len(ids)} documents, {tokens} tokens, {args.dtype}, batches of {args.batch_tokens} tokens")
    for order, sequences in orders.items():
        batches = batches_of(sequences, args.batch_tokens)
        samples: dict[str, list[float]] = {name: [] for name in STRATEGIES}
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, min_efficiency in STRATEGIES.items():
                engine.attn_backend = SdpaBackend(min_efficiency)
                start = time.perf_counter()
                for batch in batches:
                    engine.embed(batch)
                samples[name].append(time.perf_counter() - start)
        for name, times in samples.items():
            rate = tokens / statistics.median(times[1:])
            print(f"{order:<15}{name:<18}{rate:>8.0f} tokens/s   runs {np.round(tokens / np.array(times[1:]))}")
    engine.close()


if __name__ == "__main__":
    main()
