"""The engine against ONNX Runtime, the CPU runtime behind text-embeddings-inference's ONNX backend and
Infinity's optimum engine, offline on the same texts in the same batches, float32, interleaved in one run.

ONNX Runtime runs in the peers' environment (`make peers`; bench/ort_worker.py): the model exported and fused
by onnxruntime's BERT optimizer, each batch padded to its longest text, on all threads. bouquet runs the same
batches through its engine in this process: packed without padding, the steps submitted at once to its CPU
workers. Both sides time tokenization, the forward and pooling. Workloads: documents in arrival order, 16 a
batch (what a server cutting requests of 16 gets); documents sorted by length, 32 a batch (an offline job's
best case for padding); and one query a batch, one at a time.

    .venv/bin/python bench/ort.py [--docs 512] [--queries 300] [--repeats 3] [--peers-python PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import corpus
import numpy as np
import peers
import replica
import torch

from bouquet.batch import Batch
from bouquet.config import create_engine_config, default_model_path
from bouquet.engine.engine import Engine
from bouquet.tokenizer import TextTokenizer

WORKER = Path(__file__).resolve().parent / "ort_worker.py"
MAX_LENGTH = 256


def workloads(docs: list[str], queries: list[str], tokenizer: TextTokenizer) -> dict[str, list[list[str]]]:
    lengths = dict(zip(docs, map(len, tokenizer.encode(docs)), strict=True))
    by_length = sorted(docs, key=lengths.__getitem__)
    return {
        "documents, arrival order, 16 a batch": [docs[i : i + 16] for i in range(0, len(docs), 16)],
        "documents, length-sorted, 32 a batch": [by_length[i : i + 32] for i in range(0, len(by_length), 32)],
        "one query at a time": [[query] for query in queries],
    }


def bouquet_round(engine: Engine, tokenizer: TextTokenizer, batches: list[list[str]]) -> tuple[float, list[float]]:
    """Wall seconds for all batches (steps submitted as they are tokenized, then awaited), or, for one-text
    batches, each one's seconds awaited before the next: a query's latency."""
    if all(len(texts) == 1 for texts in batches):
        latencies = []
        for texts in batches:
            start = time.perf_counter()
            engine.step(_batch(tokenizer, texts)).result()
            latencies.append(time.perf_counter() - start)
        return sum(latencies), latencies
    start = time.perf_counter()
    lazies = [engine.step(_batch(tokenizer, texts)) for texts in batches]
    for lazy in lazies:
        lazy.result()
    return time.perf_counter() - start, []


def _batch(tokenizer: TextTokenizer, texts: list[str]) -> Batch:
    return replica.batch_of(tokenizer.encode(texts))


def ort_round(python: Path, onnx: Path, workload: Path) -> dict:
    command = [str(python), str(WORKER), "run", str(onnx), str(default_model_path() / "tokenizer.json"), str(workload)]
    return json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)


@dataclass
class Sides:
    """Seconds per round for each workload, and each query's latency, for bouquet and ONNX Runtime."""

    ours: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    theirs: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    latency: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    agreement: float = float("nan")  # min cosine between the two sides' embeddings of the first batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peers-python", type=Path, default=peers.PEERS_PYTHON)
    args = parser.parse_args()

    peers.require(args.peers_python, "onnxruntime")
    model_dir = default_model_path()
    tokenizer = TextTokenizer(model_dir / "tokenizer.json", MAX_LENGTH)
    batches = workloads(corpus.documents(args.docs), corpus.queries(args.queries), tokenizer)
    engine = Engine(create_engine_config(str(model_dir), device="cpu", dtype="float32"))
    try:
        with tempfile.TemporaryDirectory() as scratch:
            onnx, workload = Path(scratch) / "model.onnx", Path(scratch) / "workload.json"
            export = [str(args.peers_python), str(WORKER), "export", str(model_dir), str(onnx)]
            counts = json.loads(
                subprocess.run(export, check=True, capture_output=True, text=True).stdout.splitlines()[-1]
            )
            fused = ", ".join(f"{count} {op}" for op, count in counts.items() if count)
            workload.write_text(json.dumps({"threads": torch.get_num_threads(), "max_length": MAX_LENGTH,
                                            "batches": batches}))  # fmt: skip
            sides = measure(engine, tokenizer, batches, lambda: ort_round(args.peers_python, onnx, workload), args)
    finally:
        engine.close()
    report(sides, batches, tokenizer, fused, args.repeats)


def measure(engine: Engine, tokenizer: TextTokenizer, batches: dict[str, list[list[str]]], peer_round, args) -> Sides:
    """Rounds of every workload on bouquet, then one ONNX Runtime process doing the same."""
    for group in batches.values():
        bouquet_round(engine, tokenizer, group[:4])  # warm-up
    sides = Sides()
    for _ in range(args.repeats):
        for name, group in batches.items():
            seconds, each = bouquet_round(engine, tokenizer, group)
            sides.ours[name].append(seconds)
            sides.latency["bouquet"] += each
        peer = peer_round()
        for name, result in peer["results"].items():
            sides.theirs[name].append(sum(result["seconds"]))
            if len(batches[name][0]) == 1:
                sides.latency["onnxruntime"] += result["seconds"]
    first_batch = next(iter(batches.values()))[0]
    sides.agreement = peers.min_cosine(np.array(peer["first"]), engine.embed(_batch(tokenizer, first_batch)))
    return sides


def report(sides: Sides, batches: dict[str, list[list[str]]], tokenizer: TextTokenizer, fused: str, repeats: int):
    print(f"bouquet engine vs ONNX Runtime (fused: {fused}), float32, {torch.get_num_threads()} threads, "
          f"{repeats} rounds")  # fmt: skip
    print(f"  first batch's embeddings, ONNX Runtime against bouquet: min cosine {sides.agreement:.7f}")
    for name, group in batches.items():
        tokens = sum(map(len, tokenizer.encode([text for texts in group for text in texts])))
        ours, theirs = (tokens / statistics.median(runs) for runs in (sides.ours[name], sides.theirs[name]))
        print(f"  {name:38} bouquet {ours:7,.0f} tokens/s   onnxruntime {theirs:7,.0f}   ratio {ours / theirs:.2f}x")
    p50 = {side: statistics.median(values) * 1e3 for side, values in sides.latency.items()}
    print(f"  one query p50: bouquet {p50['bouquet']:.2f} ms, onnxruntime {p50['onnxruntime']:.2f} ms "
          f"(ratio {p50['onnxruntime'] / p50['bouquet']:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
