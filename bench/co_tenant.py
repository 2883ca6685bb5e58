"""A lone query's latency with another process holding a core: borrowing every thread as measured (the engine's
default) against always borrowing (before the measurement) and never borrowing, in one run.

The engine runs in this process on its defaults (one worker a thread, a lone short step may borrow every thread:
engine/cpu_threads.py), on the bundled model or --model; with --image, each step is one image (random pixels) of a
model that takes images (e.g. bench/image_models.py's CLIP). A co-tenant is --co-tenants processes that spin in
pure Python, one core's worth each.
Each round measures each policy for --queries one-at-a-time queries, first with the machine as it is, then with
the co-tenants running; the policies take turns so that the VM's minute-to-minute swings fall on all of them.
Medians of the rounds' p50 and p99 are reported, with the ratio of each policy's p50 to the measured choice's.

    .venv/bin/python bench/co_tenant.py [--dtype float32] [--rounds 3] [--queries 200] [--co-tenants 1]
                                        [--model DIR --image]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bouquet.batch import Batch
from bouquet.config import EngineConfig, default_model_path
from bouquet.engine.borrow_choice import BorrowChoice
from bouquet.engine.engine import Engine
from bouquet.tokenizer import TextTokenizer

QUERY = "what is the capital city of france and why is it famous"
SPIN = "while True: pass"


class Fixed(BorrowChoice):
    """Borrows always or never, as a fixed setting would."""

    def __init__(self, borrow: bool) -> None:
        super().__init__()
        self.borrow = borrow

    def should_borrow(self, num_tokens: int) -> bool:
        return self.borrow

    def borrowing(self, num_tokens: int) -> bool:
        return self.borrow


def latencies(engine: Engine, batch: Batch, queries: int) -> np.ndarray:
    for _ in range(5):
        engine.embed(batch)
    seconds = []
    for _ in range(queries):
        start = time.perf_counter()
        engine.embed(batch)
        seconds.append(time.perf_counter() - start)
    return np.array(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--co-tenants", type=int, default=1)
    parser.add_argument("--model", type=Path, default=default_model_path())
    parser.add_argument("--image", action="store_true", help="a step of one image, not one query")
    args = parser.parse_args()
    engine = Engine(EngineConfig(args.model, "cpu", args.dtype))
    threads = engine._step_threads
    if threads is None:
        sys.exit("this engine never borrows threads (one thread, or no OpenMP setter): nothing to compare")
    spec = engine.spec
    if args.image:
        pixels = np.random.default_rng(0).standard_normal((1, *engine.image_shape)).astype(np.float32)
        batch = Batch.pack_images(pixels, engine.image_tokens)
    else:
        batch = Batch.pack(TextTokenizer(spec.tokenizer_file, spec.max_seq_length).encode([QUERY]))
    policies = {"measured": BorrowChoice(), "always borrow": Fixed(True), "never borrow": Fixed(False)}
    results: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for round_ in range(args.rounds):
        for machine in ("as it is", f"{args.co_tenants} co-tenant(s)"):
            spinners = [
                subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(args.co_tenants * (machine != "as it is"))
            ]
            try:
                time.sleep(0.5 if spinners else 0)
                for name, policy in policies.items():
                    threads.choice = policy
                    seconds = latencies(engine, batch, args.queries)
                    results.setdefault((machine, name), []).append(
                        (float(np.percentile(seconds, 50)), float(np.percentile(seconds, 99)))
                    )
                    p50, p99 = results[(machine, name)][-1]
                    print(f"round {round_ + 1}, {machine:16} {name:14} p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms"
                          f"  load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
            finally:
                for spinner in spinners:
                    spinner.kill()
                    spinner.wait()
    engine.close()
    what = "image" if args.image else "query"
    print(f"# {spec.name}, {args.dtype}, {engine.num_threads} threads, a {batch.num_tokens}-token {what} one at a "
          f"time; medians of {args.rounds} rounds of {args.queries}")  # fmt: skip
    for machine in ("as it is", f"{args.co_tenants} co-tenant(s)"):
        measured = statistics.median(p50 for p50, _ in results[(machine, "measured")])
        for name in policies:
            p50 = statistics.median(p50 for p50, _ in results[(machine, name)])
            p99 = statistics.median(p99 for _, p99 in results[(machine, name)])
            print(f"  {machine:16} {name:14} p50 {p50 * 1e3:7.2f} ms  p99 {p99 * 1e3:7.2f} ms  "
                  f"p50 / measured's {p50 / measured:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
