"""CPU engine workers: one step at a time on all intra-op threads against steps computed at once, each on its
share of the threads, in one run.

Real documents (standard-library docstrings) cut into --batch-tokens batches, all submitted at once (so each
engine keeps every worker busy) and waited for; the two engines alternate run by run and medians are reported.
This is the measurement behind `EngineConfig.cpu_workers`' default (docs/benchmarks.md, "Engine workers").

    .venv/bin/python bench/engine_workers.py [--dtype float32] [--workers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import corpus
import torch
from replica import budget_batches

from bouquet.batch import Batch
from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.tokenizer import TextTokenizer


def tokens_per_second(engine: Engine, batches: list[Batch], tokens: int) -> float:
    start = time.perf_counter()
    for lazy in [engine.step(batch) for batch in batches]:
        lazy.result()
    return tokens / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--workers", type=int, default=2, help="workers of the second engine")
    parser.add_argument("--docs", type=int, default=300)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    threads = torch.get_num_threads()
    # No lone-step borrowing: both engines live in this process, and the lead's wider OpenMP team beside the
    # one-worker engine's would throttle both (engine/cpu_threads.py). This measures steps computed at once.
    engines = {
        workers: Engine(
            EngineConfig(default_model_path(), "cpu", args.dtype, cpu_workers=workers, cpu_lone_step_tokens=0)
        )
        for workers in (1, args.workers)
    }
    spec = engines[1].spec
    sequences = sorted(
        TextTokenizer(spec.tokenizer_file, spec.max_seq_length).encode(corpus.documents(args.docs)), key=len
    )
    tokens = sum(map(len, sequences))
    batches = list(budget_batches(sequences, args.batch_tokens))
    rates: dict[int, list[float]] = {workers: [] for workers in engines}
    for engine in engines.values():
        tokens_per_second(engine, batches[:4], tokens)  # warm-up
    for _ in range(args.repeats):
        for workers, engine in engines.items():
            rates[workers].append(tokens_per_second(engine, batches, tokens))
    for engine in engines.values():
        engine.close()
    print(f"# {spec.name}, {args.dtype}, {threads} threads; {len(sequences)} documents, {tokens} tokens, "
          f"batches of {args.batch_tokens} tokens, all submitted at once")  # fmt: skip
    for workers, engine in engines.items():
        runs = ", ".join(f"{rate:,.0f}" for rate in rates[workers])
        print(f"{workers} worker(s) x {engine.threads_per_worker} thread(s): "
              f"{statistics.median(rates[workers]):8,.0f} tokens/s ({runs})")  # fmt: skip
    ratio = statistics.median(rates[args.workers]) / statistics.median(rates[1])
    print(f"{args.workers} workers / 1 worker: {ratio:.2f}x")


if __name__ == "__main__":
    main()
