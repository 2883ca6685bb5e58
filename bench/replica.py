"""The replica against the bare engine, in one run: throughput under concurrent clients, and added latency.

Throughput: the same real documents (standard-library docstrings, truncated to the model's limit) go through
(a) the offline engine in this process, batches cut first come, first served by the same token budget and all
steps submitted at once, and (b) a `bouquet replica` subprocess, sent by --clients concurrent gRPC clients,
--seqs-per-request documents a call. Requests are built before the clock starts, as a gateway has them
tokenized already. Latency: one short query as a bare `engine.step()` and as a unary Embed call, in
alternating blocks. Runs interleave (offline, replica, offline, ...) and medians are reported.

    .venv/bin/python bench/replica.py [--dtype float32] [--clients 8] [--docs 200] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import corpus
import grpc

from bouquet.batch import Batch
from bouquet.config import SchedulerConfig, create_engine_config
from bouquet.engine.engine import Engine
from bouquet.proto import embedding_pb2, embedding_pb2_grpc
from bouquet.replica.client import embed_request
from bouquet.tokenizer import TextTokenizer


def budget_batches(sequences: list[list[int]], max_tokens: int) -> Iterator[Batch]:
    """Sequences in order, a batch cut when the next one would pass max_tokens: the scheduler's rule."""
    taken: list[list[int]] = []
    tokens = 0
    for seq in sequences:
        if taken and tokens + len(seq) > max_tokens:
            yield batch_of(taken)
            taken, tokens = [], 0
        taken.append(seq)
        tokens += len(seq)
    if taken:
        yield batch_of(taken)


def batch_of(sequences: list[list[int]]) -> Batch:
    """Token sequences packed into one engine batch (default options: full width, normalised)."""
    return Batch.pack(sequences)


def offline_seconds(engine: Engine, batches: list[Batch]) -> float:
    start = time.perf_counter()
    lazies = [engine.step(batch) for batch in batches]
    for lazy in lazies:
        lazy.result()
    return time.perf_counter() - start


async def _replica_seconds(address: str, requests: list[embedding_pb2.EmbedRequest], clients: int) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = embedding_pb2_grpc.EmbeddingStub(channel)
        pending = iter(requests)

        async def client() -> None:
            for request in pending:  # clients share one iterator: each takes the next request when free
                await stub.Embed(request)

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        return time.perf_counter() - start


def replica_seconds(address: str, requests: list[embedding_pb2.EmbedRequest], clients: int) -> float:
    return asyncio.run(_replica_seconds(address, requests, clients))


def start_replica(args: argparse.Namespace, max_batch_tokens: int) -> tuple[subprocess.Popen[str], str]:
    command = [sys.executable, "-m", "bouquet.cli", "replica", "--listen", "127.0.0.1:0", "--dtype", args.dtype,
               "--device", args.device, "--max-batch-tokens", str(max_batch_tokens)]  # fmt: skip
    if args.cpu_workers:
        command += ["--cpu-workers", str(args.cpu_workers)]
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=os.environ | args.replica_env)
    assert process.stderr is not None
    for line in process.stderr:
        match = re.search(r"serving .* on port (\d+)", line)
        if match:
            return process, f"127.0.0.1:{match.group(1)}"
    raise RuntimeError(f"bouquet replica exited with {process.wait()}")


def latencies(
    engine: Engine, stub: embedding_pb2_grpc.EmbeddingStub, query: list[int], rounds: int, calls: int
) -> tuple[float, float, float, float, list[float]]:
    """Seconds of a bare engine step on one short query, of an Embed call on it, and of an Info call (gRPC's
    own round trip, no engine), hot (back to back) and cold (each after idling as long as a bare step, as the
    replica's threads idle while the engine computes): in each round `calls` of each, one kind after the other
    (in blocks, so that one process's idle OpenMP threads do not spin while the other computes), and the
    median over rounds of each round's medians; and each round's added seconds (Embed minus bare)."""
    batch, request, info = batch_of([query]), embed_request(batch_of([query])), embedding_pb2.InfoRequest()
    bare, served, floor, cold = [], [], [], []
    for _ in range(rounds):
        bare.append(_median_seconds(lambda: engine.step(batch).result(), calls))
        served.append(_median_seconds(lambda: stub.Embed(request), calls))
        floor.append(_median_seconds(lambda: stub.Info(info), calls))
        cold.append(_median_seconds(lambda: stub.Info(info), calls, idle=bare[-1]))
    added = [s - b for s, b in zip(served, bare, strict=True)]
    medians = (statistics.median(times) for times in (bare, served, floor, cold))
    return (*medians, added)


def _median_seconds(call: Callable[[], object], calls: int, idle: float = 0.0) -> float:
    times = []
    for _ in range(calls):
        time.sleep(idle)
        times.append(_timed(call))
    return statistics.median(times)


def _timed(call: Callable[[], object]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-batch-tokens", type=int, help="default: the device's default budget")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seqs-per-request", type=int, default=8)
    parser.add_argument("--docs", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--latency-rounds", type=int, default=7)
    parser.add_argument("--latency-calls", type=int, default=40, help="calls of each kind per round")
    parser.add_argument("--cpu-workers", type=int, help="engine workers, both sides (default: the engine's)")
    parser.add_argument("--replica-env", nargs="*", default=[], help="NAME=VALUE for the replica process only")
    args = parser.parse_args()
    args.replica_env = dict(item.split("=", 1) for item in args.replica_env)
    engine_config = create_engine_config(None, args.device, args.dtype, cpu_workers=args.cpu_workers)
    max_tokens = SchedulerConfig.for_device(engine_config.device, args.max_batch_tokens).max_batch_tokens
    engine = Engine(engine_config)
    tokenizer = TextTokenizer(engine.spec.tokenizer_file, engine.max_seq_length)
    sequences = tokenizer.encode(corpus.documents(args.docs))
    num_tokens = sum(len(seq) for seq in sequences)
    batches = list(budget_batches(sequences, max_tokens))
    step = args.seqs_per_request
    requests = [embed_request(batch_of(sequences[i : i + step])) for i in range(0, len(sequences), step)]
    process, address = start_replica(args, max_tokens)
    try:
        offline_seconds(engine, batches[:2])  # warm-up, both sides
        replica_seconds(address, requests[:4], args.clients)
        offline, served = [], []
        for _ in range(args.repeats):
            offline.append(num_tokens / offline_seconds(engine, batches))
            served.append(num_tokens / replica_seconds(address, requests, args.clients))
        query = tokenizer.encode(corpus.queries(1))[0]
        with grpc.insecure_channel(address) as channel:
            stub = embedding_pb2_grpc.EmbeddingStub(channel)
            bare, call, floor, cold, added = latencies(engine, stub, query, args.latency_rounds, args.latency_calls)
    finally:
        process.terminate()
        process.wait(timeout=120)
        engine.close()
    offline_rate, served_rate = statistics.median(offline), statistics.median(served)
    print(f"# {engine.spec.name} on {engine_config.device} in {engine_config.dtype}, max_batch_tokens {max_tokens}")
    print(f"# {len(sequences)} documents, {num_tokens} tokens; {args.clients} clients x {step} documents a call")
    print(f"offline engine  {offline_rate:>8.0f} tokens/s  (runs: {', '.join(f'{r:.0f}' for r in offline)})")
    print(f"replica (gRPC)  {served_rate:>8.0f} tokens/s  (runs: {', '.join(f'{r:.0f}' for r in served)})")
    print(f"replica / offline: {served_rate / offline_rate:.1%}")
    print(f"one short query ({len(query)} tokens), median of {args.latency_rounds} rounds of {args.latency_calls}:")
    print(f"  bare engine step {bare * 1e3:.2f} ms, Embed call {call * 1e3:.2f} ms, added {(call - bare) * 1e3:.2f} ms")
    print(f"  added by round: {', '.join(f'{a * 1e3:.2f}' for a in added)} ms")
    print(f"  a gRPC round trip (Info call, no engine): {floor * 1e3:.2f} ms back to back, {cold * 1e3:.2f} ms each")
    print("    after idling as long as one bare step (the state the replica's threads wake from)")


if __name__ == "__main__":
    main()
