"""Two `bouquet serve` configurations against each other, interleaved in one run: documents and single queries.

Both servers are started at once (each idles while the other is measured) and run alternately, A, B, A, B,
so that this VM's minute-to-minute swings fall on both; medians are reported with B / A ratios. The workload
is bench/serve.py's: documents --per-request (16) at a time from --concurrency (8) clients, then queries one
at a time. Used to choose defaults such as the number of CPU replicas (docs/benchmarks.md).

    .venv/bin/python bench/serve_configs.py --a "--replicas 1" --b "--replicas 2" [--dtype float32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import shlex
import statistics

import corpus
from serve import serve_documents, serve_queries

from bouquet.config import default_model_path
from bouquet.gateway.testing import Process, free_port, start_serve
from bouquet.tokenizer import TextTokenizer


def start(extra: str, dtype: str) -> tuple[Process, int]:
    port = free_port()
    serve = start_serve(port, "--device", "cpu", "--dtype", dtype, *shlex.split(extra))
    serve.wait_ready()
    return serve, port


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", default="--replicas 1", help="extra `bouquet serve` arguments of configuration A")
    parser.add_argument("--b", default="--replicas 2", help="extra `bouquet serve` arguments of configuration B")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--per-request", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    docs, queries = corpus.documents(args.docs), corpus.queries(args.queries)
    doc_tokens = sum(map(len, TextTokenizer(default_model_path() / "tokenizer.json", 256).encode(docs)))
    requests = [docs[i : i + args.per_request] for i in range(0, len(docs), args.per_request)]
    servers = {name: start(extra, args.dtype) for name, extra in (("A", args.a), ("B", args.b))}
    rates: dict[str, list[float]] = {"A": [], "B": []}
    p50s: dict[str, list[float]] = {"A": [], "B": []}
    try:
        for _, port in servers.values():
            serve_documents(port, requests[:8], args.concurrency)  # warm-up
        for _ in range(args.repeats):
            for name, (_, port) in servers.items():
                seconds, _ = serve_documents(port, requests, args.concurrency)
                rates[name].append(doc_tokens / seconds)
                p50s[name].append(statistics.median(serve_queries(port, queries)))
    finally:
        for serve, _ in servers.values():
            serve.stop()
    print(f"# {args.dtype}; A: bouquet serve {args.a}; B: bouquet serve {args.b}")
    print(f"# documents: {len(docs)} texts, {doc_tokens} tokens, {args.per_request} a request, {args.concurrency} "
          f"concurrent; queries: {len(queries)} one at a time; {args.repeats} rounds")  # fmt: skip
    for name in servers:
        runs = ", ".join(f"{rate:,.0f}" for rate in rates[name])
        queries_ms = ", ".join(f"{p * 1e3:.2f}" for p in p50s[name])
        print(f"{name}: documents {statistics.median(rates[name]):8,.0f} tokens/s ({runs}); query p50 "
              f"{statistics.median(p50s[name]) * 1e3:.2f} ms ({queries_ms})")  # fmt: skip
    ratio = statistics.median(rates["B"]) / statistics.median(rates["A"])
    latency = statistics.median(p50s["B"]) / statistics.median(p50s["A"])
    print(f"B / A: documents {ratio:.2f}x tokens/s, query p50 {latency:.2f}x")


if __name__ == "__main__":
    main()
