"""Reranking throughput: bouquet against sentence-transformers' CrossEncoder on the same (query, passage) pairs.

The model is a cross-encoder of ms-marco-MiniLM-L6-v2's shape (BertForSequenceClassification: 6 layers, hidden 384,
12 heads, intermediate 1536, one label, 512 positions) with random weights, as no reranker's weights are at hand
offline, saved by CrossEncoder beside the real MiniLM tokenizer. The pairs: the corpus's queries, each with
--documents passages (bench/corpus.py), as a reranking request holds one query and its candidates.

bouquet runs as a replica does for a /rerank request, in this process: the pairs tokenized as the model's tokenizer
pairs them (truncated to the model's limit), packed into one batch, queued on the replica's scheduler, which cuts
token-budget steps and keeps two in flight on the engine; the logits through the model's activation. With --serve,
`bouquet serve` answers TEI's /rerank over HTTP instead (one request a query, --concurrency clients at once), the
gateway's tokenizing, gRPC and HTTP included. CrossEncoder.predict runs the same pairs in the same dtype, at the
batch size it does best of 8, 16, 32 and 64. Runs interleave; medians are reported, with the largest score
difference between the two as a check that both computed the same thing.

    .venv/bin/python bench/rerank.py [--queries 8] [--documents 16] [--repeats 3] [--dtypes float32,bfloat16]
                                     [--serve] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import http.client
import json
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import corpus
import numpy as np
import torch
from family_models import TOKENIZER_FILES, spread_weights
from offline import DTYPES, matmul_ceiling

from bouquet import event_loop
from bouquet.batch import Batch, RowOptions
from bouquet.config import EngineConfig, SchedulerConfig, default_model_path
from bouquet.engine.engine import Engine
from bouquet.gateway.testing import free_port, start_serve
from bouquet.replica.scheduler import Scheduler
from bouquet.scoring import activate
from bouquet.tokenizer import TextTokenizer

MAX_LENGTH = 512  # ms-marco-MiniLM-L6-v2's
Pairs = list[tuple[str, str]]


def build_cross_encoder(root: Path) -> Path:
    """MiniLM-L6's shape as a one-label classifier, saved by CrossEncoder (the directory bouquet loads)."""
    from sentence_transformers import CrossEncoder
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536,
        max_position_embeddings=MAX_LENGTH, num_labels=1,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    spread_weights(model, seed=0, scale=0.05)
    model.save_pretrained(root / "hf")
    for name in TOKENIZER_FILES:
        shutil.copy(default_model_path() / name, root / "hf" / name)
    CrossEncoder(str(root / "hf"), device="cpu", max_length=MAX_LENGTH).save(str(root / "ms-marco-MiniLM-L6-shape"))
    return root / "ms-marco-MiniLM-L6-shape"


def rerank_pairs(queries: int, documents: int) -> Pairs:
    """Each of the first `queries` queries with `documents` passages, taken in turn from the corpus."""
    passages = corpus.documents()
    return [
        (query, passages[(index * documents + slot) % len(passages)])
        for index, query in enumerate(corpus.queries(queries))
        for slot in range(documents)
    ]


class BouquetRunner:
    """A /rerank request's work on a replica, in this process: tokenize, pack, schedule, activate."""

    def __init__(self, model_dir: Path, dtype: str, pairs: Pairs):
        self.engine = Engine(EngineConfig(model_path=model_dir, device="cpu", dtype=dtype))
        self.tokenizer = TextTokenizer(self.engine.spec.tokenizer_file, self.engine.max_seq_length)
        self.pairs = pairs
        self.scores = np.zeros(len(pairs), dtype=np.float32)

    def __call__(self) -> None:
        self.scores = event_loop.run(self._score())

    async def _score(self) -> np.ndarray:
        ids, types = self.tokenizer.encode_pairs(self.pairs)
        scheduler = Scheduler(self.engine, SchedulerConfig.for_device("cpu"))
        try:
            logits = await scheduler.embed(Batch.pack(ids, RowOptions(normalize=False), types))
        finally:
            scheduler.close()
        return activate(logits, self.engine.spec.score_activation)[:, 0]

    def close(self) -> None:
        self.engine.close()


class ServeRunner:
    """`bouquet serve` answering TEI's /rerank: one request per query, `concurrency` clients at once."""

    def __init__(self, model_dir: Path, dtype: str, pairs: Pairs, documents: int, concurrency: int):
        self.port = free_port()
        self.process = start_serve(self.port, "--model", str(model_dir), "--device", "cpu", "--dtype", dtype)
        self.process.wait_ready()
        self.requests = [pairs[start : start + documents] for start in range(0, len(pairs), documents)]
        self.concurrency = concurrency
        self.scores = np.zeros(len(pairs), dtype=np.float32)

    def __call__(self) -> None:
        results: list[list[float]] = [[] for _ in self.requests]
        threads = [threading.Thread(target=self._client, args=(i, results)) for i in range(self.concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.scores = np.concatenate(results).astype(np.float32)

    def _client(self, first: int, results: list[list[float]]) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        for index in range(first, len(self.requests), self.concurrency):
            pairs = self.requests[index]
            body = json.dumps({"query": pairs[0][0], "texts": [passage for _, passage in pairs]})
            connection.request("POST", "/rerank", body, {"Content-Type": "application/json"})
            ranks = json.loads(connection.getresponse().read())
            results[index] = [rank["score"] for rank in sorted(ranks, key=lambda rank: rank["index"])]
        connection.close()

    def close(self) -> None:
        self.process.stop()


class CrossEncoderRunner:
    def __init__(self, model_dir: Path, dtype: str, pairs: Pairs):
        from sentence_transformers import CrossEncoder

        kwargs = {"torch_dtype": DTYPES[dtype]}
        self.model = CrossEncoder(str(model_dir), device="cpu", max_length=MAX_LENGTH, model_kwargs=kwargs)
        self.pairs = pairs
        self.batch_size = self._best_batch_size()
        self.scores = np.zeros(len(pairs), dtype=np.float32)

    def _best_batch_size(self) -> int:
        sample = self.pairs[:64]
        self.model.predict(sample[:8], batch_size=8)
        timings = {
            size: _timed(lambda size=size: self.model.predict(sample, batch_size=size)) for size in (8, 16, 32, 64)
        }
        return min(timings, key=timings.__getitem__)

    def __call__(self) -> None:
        self.scores = np.asarray(self.model.predict(self.pairs, batch_size=self.batch_size), dtype=np.float32)

    def close(self) -> None:
        pass


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(model_dir: Path, pairs: Pairs, args: argparse.Namespace) -> dict[str, tuple[float, float, float]]:
    """Per dtype: bouquet's and CrossEncoder's median pairs/s, and their largest score difference."""
    results = {}
    for dtype in args.dtypes.split(","):
        if args.serve:
            ours: BouquetRunner | ServeRunner = ServeRunner(model_dir, dtype, pairs, args.documents, args.concurrency)
        else:
            ours = BouquetRunner(model_dir, dtype, pairs)
        theirs = CrossEncoderRunner(model_dir, dtype, pairs)
        print(f"{dtype}: CrossEncoder's best batch size {theirs.batch_size}")
        ours(), theirs()  # warm-up
        samples: dict[str, list[float]] = {"bouquet": [], "CrossEncoder": []}
        for _ in range(args.repeats):
            samples["bouquet"].append(_timed(ours))
            samples["CrossEncoder"].append(_timed(theirs))
        difference = float(np.abs(ours.scores - theirs.scores).max())
        ours.close()
        theirs.close()
        rates = {system: len(pairs) / statistics.median(times) for system, times in samples.items()}
        runs = {system: " ".join(f"{len(pairs) / t:.1f}" for t in times) for system, times in samples.items()}
        print(f"  bouquet {rates['bouquet']:.1f} pairs/s ({runs['bouquet']}), CrossEncoder "
              f"{rates['CrossEncoder']:.1f} ({runs['CrossEncoder']}); score difference {difference:.1e}")  # fmt: skip
        results[dtype] = (rates["bouquet"], rates["CrossEncoder"], difference)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--queries", type=int, default=8)
    parser.add_argument("--documents", type=int, default=16, help="passages per query")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--serve", action="store_true", help="bouquet serve over HTTP instead of in this process")
    parser.add_argument("--concurrency", type=int, default=4, help="HTTP clients at once, with --serve")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for dtype in args.dtypes.split(","):
        print(f"matrix-product ceiling {dtype}: {matmul_ceiling(DTYPES[dtype]):.0f} GFLOP/s")
    pairs = rerank_pairs(args.queries, args.documents)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_cross_encoder(Path(tmp))
        tokens = sum(map(len, TextTokenizer(model_dir / "tokenizer.json", MAX_LENGTH).encode_pairs(pairs)[0]))
        print(f"{len(pairs)} pairs ({args.queries} queries x {args.documents} passages), {tokens} real tokens")
        results = measure(model_dir, pairs, args)
    mode = "bouquet serve, HTTP /rerank" if args.serve else "in-process replica (scheduler + engine)"
    print(f"\n| dtype | {mode} pairs/s | CrossEncoder pairs/s | ratio | max score difference |\n|---|---|---|---|---|")
    for dtype, (ours, theirs, difference) in results.items():
        print(f"| {dtype} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {difference:.1e} |")


if __name__ == "__main__":
    main()
