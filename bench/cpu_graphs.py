"""CPU graphs on and off (engine/cpu_graphs.py), in one run: lone short queries through `Engine.embed`, per dtype,
the two engines alternated round by round; medians. Rows are checked equal (graphs replay the same kernels on the
same values). A dtype whose layers run torch's own ops (float32 on a CPU without AVX2 and FMA, where its short-step
kernel does not run) shows no graph, and says so.

    .venv/bin/python bench/cpu_graphs.py [--dtypes int8,bfloat16] [--queries 200] [--rounds 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import corpus
import numpy as np
import torch

from bouquet.batch import Batch
from bouquet.config import create_engine_config, default_model_path
from bouquet.cpu_features import cpu_features
from bouquet.engine.engine import Engine
from bouquet.tokenizer import TextTokenizer


def lone_queries(engine: Engine, batches: list[Batch]) -> list[float]:
    seconds = []
    for batch in batches:
        start = time.perf_counter()
        engine.embed(batch)
        seconds.append(time.perf_counter() - start)
    return seconds


def bench_dtype(dtype: str, batches: list[Batch], rounds: int) -> None:
    config = dataclasses.replace(create_engine_config(default_model_path(), device="cpu", dtype=dtype))
    engines = {on: Engine(dataclasses.replace(config, cpu_graphs=on)) for on in (True, False)}
    try:
        for engine in engines.values():  # warm: each shape eager, then captured where it can be
            for batch in batches * 2:
                engine.embed(batch)
        same = all(np.array_equal(engines[True].embed(b), engines[False].embed(b)) for b in batches[:20])
        medians: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(rounds):
            for on, engine in engines.items():
                medians[on].append(statistics.median(lone_queries(engine, batches)) * 1e3)
        on, off = statistics.median(medians[True]), statistics.median(medians[False])
        runs = " / ".join(f"{a:.2f} vs {b:.2f}" for a, b in zip(medians[True], medians[False], strict=True))
        print(f"{dtype}: lone query p50 with graphs {on:.2f} ms, without {off:.2f} ms: {off / on:.2f}x "
              f"(rounds {runs}); rows equal: {same}")  # fmt: skip
    finally:
        for engine in engines.values():
            engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", default="int8,bfloat16,float32")
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    tokenizer = TextTokenizer(default_model_path() / "tokenizer.json", 256)
    batches = [Batch.pack([ids]) for ids in tokenizer.encode(corpus.queries(args.queries))]
    print(f"CPU: {cpu_features().describe()}; {torch.get_num_threads()} threads; {len(batches)} queries a round")
    for dtype in args.dtypes.split(","):
        bench_dtype(dtype, batches, args.rounds)


if __name__ == "__main__":
    main()
