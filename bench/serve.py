"""`bouquet serve` over HTTP against sentence-transformers in this process (and, with --infinity, the Infinity
server over HTTP), on the same texts in one run.

Documents: standard-library docstrings, --per-request (16) texts a request, --concurrency (8) clients at once,
each on its own keep-alive connection; real tokens (after truncation to the model's limit, no padding) per
second end to end, the load generator included, and request latency percentiles. Queries: one short text a
request, one request at a time; latency percentiles. Responses are asked for in base64, as the openai client
does; --encodings measures other encoding_format values too (e.g. base64,float,int8,base64_binary: each one
its own entry, interleaved with the others, with the mean size of its answers). sentence-transformers runs the
same texts in this process in the same dtype: documents in batches of --per-request, queries one at a time.
With --infinity (after `make peers`), Infinity serves the same model in the same dtype on its defaults and gets
the same requests (in base64); its embeddings are checked against bouquet's. Runs interleave (bouquet,
reference, Infinity, bouquet, ...); medians are reported.

    .venv/bin/python bench/serve.py [--dtype float32|bfloat16] [--docs 512] [--queries 300] [--repeats 2]
                                    [--encodings base64,int8,binary] [--infinity [PYTHON]]
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import corpus
import numpy as np
import peers
import torch

from bouquet.config import default_model_path
from bouquet.gateway.testing import free_port, start_serve
from bouquet.tokenizer import TextTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Client:
    """One keep-alive HTTP connection that posts /v1/embeddings in one encoding_format and times each request;
    `extra` goes into every body (what a peer needs told to do what bouquet does by default, e.g. vLLM's
    truncation). A 429 is retried after its Retry-After, as the openai client does, and counted in
    `Client.retried` (all clients together): a request's latency includes its waits."""

    retried = 0
    _retried_lock = threading.Lock()

    def __init__(self, port: int, encoding_format: str = "base64", extra: dict[str, object] | None = None):
        self.connection = http.client.HTTPConnection("127.0.0.1", port)
        self.encoding_format = encoding_format
        self.extra = extra or {}
        self.answer_bytes: list[int] = []

    def embed(self, texts: list[str]) -> float:
        start = time.perf_counter()
        self.answer_bytes.append(len(self._post(texts)))
        return time.perf_counter() - start

    def vectors(self, texts: list[str]) -> np.ndarray:
        rows = json.loads(self._post(texts))["data"]
        return np.stack([np.frombuffer(base64.b64decode(row["embedding"]), dtype="<f4") for row in rows])

    def _post(self, texts: list[str]) -> bytes:
        fields = {"input": texts, "model": peers.SERVED_MODEL_NAME, "encoding_format": self.encoding_format}
        body = json.dumps({**fields, **self.extra})
        while True:
            self.connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            reply = self.connection.getresponse()
            data = reply.read()
            if reply.status != 429:
                break
            with Client._retried_lock:
                Client.retried += 1
            time.sleep(float(reply.getheader("Retry-After") or 1))
        assert reply.status == 200, data[:300]
        return data


def serve_documents(
    port: int,
    requests: list[list[str]],
    concurrency: int,
    encoding_format: str = "base64",
    sizes: list[int] | None = None,
    extra: dict[str, object] | None = None,
) -> tuple[float, list[float]]:
    """Wall seconds for all requests with `concurrency` clients, and each request's latency; each answer's size
    in bytes goes to `sizes`."""
    pending = iter(requests)
    lock = threading.Lock()
    latencies: list[float] = []

    def run() -> None:
        client = Client(port, encoding_format, extra)
        while True:
            with lock:
                texts = next(pending, None)
            if texts is None:
                break
            latencies.append(client.embed(texts))
        if sizes is not None:
            sizes.extend(client.answer_bytes)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if len(latencies) != len(requests):  # a client thread failed (its traceback is above): the rate would be wrong
        raise RuntimeError(f"{len(requests) - len(latencies)} of {len(requests)} requests failed")
    return time.perf_counter() - start, latencies


def serve_queries(
    port: int, queries: list[str], encoding_format: str = "base64", extra: dict[str, object] | None = None
) -> list[float]:
    client = Client(port, encoding_format, extra)
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


@dataclass
class Served:
    """One HTTP server under test, asked in one encoding_format, and what was measured of it."""

    name: str
    port: int
    encoding_format: str = "base64"
    answer_bytes: list[int] = field(default_factory=list)  # of the document requests' answers
    document_seconds: list[float] = field(default_factory=list)
    request_latency: list[float] = field(default_factory=list)
    query_latency: list[float] = field(default_factory=list)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES))
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--per-request", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--encodings", default="base64", help="encoding_format values for bouquet, comma-separated")
    parser.add_argument("--replicas", type=int, help="default: bouquet serve's own (1)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--attention-backend", default="auto", help="the replicas' (auto: cpu_varlen on the CPU)")
    parser.add_argument(
        "--infinity", nargs="?", const=peers.PEERS_PYTHON, type=Path, metavar="PYTHON",
        help=f"also measure Infinity, run by this Python (default {peers.PEERS_PYTHON}, from `make peers`)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.infinity:
        peers.require(args.infinity, "infinity_emb")  # before anything starts

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
    encodings = args.encodings.split(",")
    processes, servers = [], [Served(f"bouquet serve [{name}]", port, name) for name in encodings]
    replicas = ["--replicas", str(args.replicas)] if args.replicas else []
    try:
        processes.append(start_serve(
            servers[0].port, "--device", "cpu", "--dtype", args.dtype, "--workers", str(args.workers),
            "--attention-backend", args.attention_backend, *replicas,
        ))  # fmt: skip
        processes[0].wait_ready()
        if args.infinity:
            servers.append(Served("infinity", free_port()))
            processes.append(peers.start_infinity(args.infinity, path, servers[-1].port, args.dtype))
        reference, reference_latency = measure(servers, model, requests, queries, args)
        agreement = [agree(servers[0], other, docs[: args.per_request]) for other in servers[len(encodings) :]]
    finally:
        for process in processes:
            process.stop()
    report(servers, reference, reference_latency, agreement, doc_tokens, query_tokens, len(docs), args)


def measure(
    servers: list[Served], model, requests: list[list[str]], queries: list[str], args: argparse.Namespace
) -> tuple[list[float], list[float]]:
    """Documents then queries, each round every server then the in-process reference; returns the reference's
    document seconds and query latencies (the servers' go into their Served)."""
    for server in servers:
        serve_documents(server.port, requests[:8], args.concurrency, server.encoding_format)  # warm-up
    reference: list[float] = []
    for _ in range(args.repeats):
        for server in servers:
            seconds, latency = serve_documents(
                server.port, requests, args.concurrency, server.encoding_format, server.answer_bytes
            )
            server.document_seconds.append(seconds)
            server.request_latency += latency
        reference.append(reference_documents(model, requests))
    reference_latency: list[float] = []
    for _ in range(args.repeats):
        for server in servers:
            server.query_latency += serve_queries(server.port, queries, server.encoding_format)
        reference_latency += reference_queries(model, queries)
    return reference, reference_latency


def agree(ours: Served, peer: Served, texts: list[str]) -> float:
    """The minimum cosine between the two servers' embeddings of the same texts: both must compute one thing."""
    return peers.min_cosine(Client(ours.port).vectors(texts), Client(peer.port).vectors(texts))


def report(
    servers: list[Served],
    reference: list[float],
    reference_latency: list[float],
    agreement: list[float],
    doc_tokens: int,
    query_tokens: float,
    doc_count: int,
    args: argparse.Namespace,
) -> None:
    """`servers`: bouquet in each of --encodings first (the first one is "bouquet serve" in the ratios), then
    the peers."""
    count = len(args.encodings.split(","))
    ours, peers_measured = servers[:count], servers[count:]
    reference_tps = doc_tokens / statistics.median(reference)
    ours_tps = [doc_tokens / statistics.median(server.document_seconds) for server in ours]
    peer_names = ", ".join(["sentence-transformers (in-process)", *(server.name for server in peers_measured)])
    print(f"bouquet serve ({args.attention_backend} attention) vs {peer_names}, {args.dtype}, "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    for peer, cosine in zip(peers_measured, agreement, strict=True):
        print(f"  {peer.name} embeddings against bouquet's: min cosine {cosine:.7f}")
    print(f"documents: {doc_count} texts, {doc_tokens} real tokens, {args.per_request} a request, "
          f"{args.concurrency} concurrent")  # fmt: skip
    for server in servers:
        tps = doc_tokens / statistics.median(server.document_seconds)
        size = f"   answer {statistics.mean(server.answer_bytes) / 1024:7.1f} KiB" if server.answer_bytes else ""
        print(f"  {server.name:30} {tps:9,.0f} tokens/s   request {percentiles(server.request_latency)}{size}")
    batches = f"(in-process, batches of {args.per_request})"
    print(f"  {'sentence-transformers':30} {reference_tps:9,.0f} tokens/s   {batches}")
    for server, tps in zip(ours, ours_tps, strict=True):
        print(f"  {'ratio':30} {tps / reference_tps:9.2f}x sentence-transformers ({server.name})")
    for server, tps in zip(ours[1:], ours_tps[1:], strict=True):
        print(f"  {'ratio':30} {tps / ours_tps[0]:9.2f}x {ours[0].name} ({server.name})")
    for peer in peers_measured:
        peer_tps = doc_tokens / statistics.median(peer.document_seconds)
        print(f"  {'ratio':30} {ours_tps[0] / peer_tps:9.2f}x {peer.name}")
    print(f"queries: one text a request ({query_tokens:.1f} tokens on average), one at a time, "
          f"{len(ours[0].query_latency) // args.repeats} x {args.repeats}")  # fmt: skip
    for server in servers:
        print(f"  {server.name:30} {percentiles(server.query_latency)}")
    print(f"  {'sentence-transformers':30} {percentiles(reference_latency)}   (in-process)")
    ours_p50 = statistics.median(ours[0].query_latency)
    others = [("sentence-transformers", reference_latency)] + [(s.name, s.query_latency) for s in servers[1:]]
    for name, latency in others:
        print(f"  p50 ratio ({name} / {ours[0].name}) {statistics.median(latency) / ours_p50:.2f}x")


if __name__ == "__main__":
    main()
