"""The saturation curve: step latency and tokens/s against batch tokens, on the current device.

Each batch is real documents (standard-library docstrings, truncated to the model's limit) packed end to end
up to exactly N tokens, the last sequence cut short to fit. The engine gets as many copies of the batch at
once as it has workers (one on CUDA, two on a 2-core CPU: as a busy replica keeps it), so step latency is
each step's time with its peers running and tokens/s counts all of them. Medians of --repeats are reported,
sizes interleaved within each repetition so the shared machine's noise hits every size alike. The knee is the
smallest batch within --knee of the best tokens/s: past it a bigger batch buys latency, not throughput, so it
is the scheduler's default max_batch_tokens for this device.

    .venv/bin/python bench/saturation.py [--dtype float32] [--device auto] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import corpus

from bouquet.batch import Batch
from bouquet.config import create_engine_config
from bouquet.engine.engine import Engine
from bouquet.tokenizer import TextTokenizer

SIZES = [32 * 2**i for i in range(9)]  # 32 .. 8192 tokens


def batch_of(sequences: list[list[int]], num_tokens: int) -> Batch:
    """Whole sequences in order until `num_tokens`, the last one cut to land on it exactly."""
    taken: list[list[int]] = []
    left = num_tokens
    for seq in sequences:
        taken.append(seq[:left])
        left -= len(taken[-1])
        if left == 0:
            break
    assert left == 0, f"corpus too small for {num_tokens} tokens"
    return Batch.pack(taken)


def timed_step(engine: Engine, batch: Batch) -> float:
    """Seconds for `engine.workers` copies of `batch` submitted at once."""
    start = time.perf_counter()
    for lazy in [engine.step(batch) for _ in range(engine.workers)]:
        lazy.result()
    return time.perf_counter() - start


def knee(sizes: list[int], tokens_per_s: list[float], fraction: float) -> int:
    best = max(tokens_per_s)
    return next(size for size, rate in zip(sizes, tokens_per_s, strict=True) if rate >= fraction * best)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--knee", type=float, default=0.95, help="fraction of the best tokens/s that counts as saturated"
    )
    args = parser.parse_args()
    engine = Engine(create_engine_config(args.model, args.device, args.dtype))
    tokenizer = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length)
    sequences = tokenizer.encode(corpus.documents())
    batches = [batch_of(sequences, size) for size in SIZES]
    for batch in batches:  # warm-up: first calls allocate
        timed_step(engine, batch)
    times: list[list[float]] = [[] for _ in SIZES]
    for _ in range(args.repeats):
        for index, batch in enumerate(batches):
            times[index].append(timed_step(engine, batch))
    latencies = [statistics.median(t) for t in times]
    rates = [engine.workers * size / latency for size, latency in zip(SIZES, latencies, strict=True)]
    config = engine.config
    print(f"# {engine.spec.name} on {config.device} in {config.dtype}, {engine.workers} worker(s) x "
          f"{engine.threads_per_worker} thread(s), median of {args.repeats}")  # fmt: skip
    print(f"{'batch tokens':>12} {'step ms':>10} {'tokens/s':>10} {'of best':>8}")
    for size, latency, rate in zip(SIZES, latencies, rates, strict=True):
        print(f"{size:>12} {latency * 1e3:>10.1f} {rate:>10.0f} {rate / max(rates):>8.0%}")
    print(f"knee (smallest batch at >= {args.knee:.0%} of the best tokens/s): {knee(SIZES, rates, args.knee)} tokens")
    engine.close()


if __name__ == "__main__":
    main()
