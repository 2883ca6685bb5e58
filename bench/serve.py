"""`bouquet serve` over HTTP against sentence-transformers in this process, on the same texts in one run.

Documents: standard-library docstrings, --per-request (16) texts a request, --concurrency (8) clients at once,
each on its own keep-alive connection; real tokens (after truncation to the model's limit, no padding) per
second end to end, the load generator included, and request latency percentiles. Queries: one short text a
request, one request at a time; latency percentiles. Responses are asked for in base64, as the openai client
does. sentence-transformers runs the same texts in this process in the same dtype: documents in batches of
--per-request, queries one at a time. Runs interleave (server, reference, server, ...); medians are reported.

    .venv/bin/python bench/serve.py [--dtype float32|bfloat16] [--docs 512] [--queries 300] [--repeats 2]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable

import corpus
import numpy as np
import torch

from bouquet.config import default_model_path
from bouquet.gateway.testing import free_port, start_serve
from bouquet.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Client:
    """One keep-alive HTTP connection that posts /v1/embeddings and times each request."""

    def __init__(self, port: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port)

    def embed(self, texts: list[str]) -> float:
        body = json.dumps({"input": texts, "model": "all-MiniLM-L6-v2", "encoding_format": "base64"})
        start = time.perf_counter()
        self.connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
        reply = self.connection.getresponse()
        data = reply.read()
        elapsed = time.perf_counter() - start
        assert reply.status == 200, data[:300]
        return elapsed


def serve_documents(port: int, requests: list[list[str]], concurrency: int) -> tuple[float, list[float]]:
    """Wall seconds for all requests with `concurrency` clients, and each request's latency."""
    pending = iter(requests)
    lock = threading.Lock()
    latencies: list[float] = []

    def run() -> None:
        client = Client(port)
        while True:
            with lock:
                texts = next(pending, None)
            if texts is None:
                return
            latencies.append(client.embed(texts))

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start, latencies


def serve_queries(port: int, queries: list[str]) -> list[float]:
    client = Client(port)
    for query in queries[:20]:  # warm the connection and the replica's shapes
        client.embed([query])
    return [client.embed([query]) for query in queries]


def reference_documents(model, requests: list[list[str]]) -> float:
    start = time.perf_counter()
    for texts in requests:
        model.encode(texts, batch_size=len(texts), normalize_embeddings=True)
    return time.perf_counter() - start


def reference_queries(model, queries: list[str]) -> list[float]:
    return [_timed(lambda q=query: model.encode([q], normalize_embeddings=True)) for query in queries]


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def percentiles(values: list[float]) -> str:
    p50, p90, p99 = (float(np.percentile(values, q)) * 1e3 for q in (50, 90, 99))
    return f"p50 {p50:6.2f} ms  p90 {p90:6.2f} ms  p99 {p99:6.2f} ms"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--per-request", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--replicas", type=int, help="default: bouquet serve's own (1)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto", help="the replicas' (auto: cpu_varlen on the CPU)")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    path = default_model_path()
    docs, queries = corpus.documents(args.docs), corpus.queries(args.queries)
    tokenizer = TextTokenizer(path / "tokenizer.json", 256)
    doc_tokens = sum(map(len, tokenizer.encode(docs)))
    query_tokens = statistics.mean(map(len, tokenizer.encode(queries)))
    requests = [docs[i : i + args.per_request] for i in range(0, len(docs), args.per_request)]
    model = SentenceTransformer(str(path), device="cpu", model_kwargs={"torch_dtype": DTYPES[args.dtype]})
    model.encode(docs[:32], batch_size=16)

    port = free_port()
    replicas = ["--replicas", str(args.replicas)] if args.replicas else []
    serve = start_serve(
        port, "--device", "cpu", "--dtype", args.dtype, "--workers", str(args.workers),
        "--attention-backend", args.attention_backend, *replicas,
    )  # fmt: skip
    try:
        serve.wait_ready()
        serve_documents(port, requests[:8], args.concurrency)  # warm-up
        served, served_latency, reference = [], [], []
        for _ in range(args.repeats):
            seconds, latency = serve_documents(port, requests, args.concurrency)
            served.append(seconds)
            served_latency += latency
            reference.append(reference_documents(model, requests))
        query_latency, reference_latency = [], []
        for _ in range(args.repeats):
            query_latency += serve_queries(port, queries)
            reference_latency += reference_queries(model, queries)
    finally:
        serve.stop()

    served_tps, reference_tps = doc_tokens / statistics.median(served), doc_tokens / statistics.median(reference)
    print(f"bouquet serve ({args.attention_backend} attention) vs sentence-transformers, {args.dtype}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"documents: {len(docs)} texts, {doc_tokens} real tokens, {args.per_request} a request, "
          f"{args.concurrency} concurrent")  # fmt: skip
    print(f"  bouquet serve          {served_tps:9,.0f} tokens/s   request {percentiles(served_latency)}")
    print(f"  sentence-transformers  {reference_tps:9,.0f} tokens/s   (in-process, batches of {args.per_request})")
    print(f"  ratio                  {served_tps / reference_tps:9.2f}x")
    print(f"queries: one text a request ({query_tokens:.1f} tokens on average), one at a time, {len(queries)} x "
          f"{args.repeats}")  # fmt: skip
    print(f"  bouquet serve          {percentiles(query_latency)}")
    print(f"  sentence-transformers  {percentiles(reference_latency)}   (in-process)")
    ratio = statistics.median(reference_latency) / statistics.median(query_latency)
    print(f"  p50 ratio (reference / served) {ratio:.2f}x")


if __name__ == "__main__":
    main()
