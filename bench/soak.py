"""Soak: `bouquet serve` under a steady mixed load at twice its capacity, the memory of every process sampled.

Not a test: a run of --seconds (default 600). The load is a mix of one-text queries and document requests of
16 to 64 standard-library docstrings (a few words to past the model's 256-token limit). First the capacity is
measured: --capacity-clients closed-loop clients for --capacity-seconds, in requests a second. Then requests
arrive open-loop at --overload (2) times that rate, each taken by one of --clients keep-alive connections; an
arrival that finds every connection busy is not sent (counted as "not sent": the pool is bounded, so the
client never queues without limit). Every --sample-every seconds the resident memory (VmRSS, and its
anonymous part) of the gateway and of each replica is read from /proc.

Printed: the memory table over time, whether each process stayed flat after --warmup (spread within
--flat of its post-warm-up minimum), latency percentiles of the admitted (200) requests, the share of 429s,
and every other error (there must be none).

    .venv/bin/python bench/soak.py [--seconds 600] [--replicas 1] [--clients 64] [--serve-arg=--dtype=bfloat16]
"""

from __future__ import annotations

import argparse
import http.client
import queue
import random
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import corpus
import numpy as np
import orjson

from bouquet.gateway.testing import Process, free_port, start_serve

MODEL = "all-MiniLM-L6-v2"  # the name `bouquet serve` gives its bundled model


@dataclass(frozen=True)
class Outcome:
    """One request: when it ended (seconds since the load started), how long it took, its status (0: no reply),
    and the tokens it counted."""

    end: float
    latency: float
    status: int
    tokens: int = 0
    error: str = ""


class Workload:
    """The mix: a query with probability `query_share`, else 16-64 documents from a random place in the corpus."""

    def __init__(self, query_share: float, min_texts: int, max_texts: int, seed: int = 0):
        self.queries = corpus.queries()
        self.documents = corpus.documents()
        self.query_share = query_share
        self.min_texts, self.max_texts = min_texts, max_texts
        self.random = random.Random(seed)
        self.lock = threading.Lock()

    def next(self) -> list[str]:
        with self.lock:
            if self.random.random() < self.query_share:
                return [self.random.choice(self.queries)]
            count = self.random.randint(self.min_texts, self.max_texts)
            start = self.random.randrange(len(self.documents))
            return [self.documents[(start + i) % len(self.documents)] for i in range(count)]


class Client:
    """One keep-alive connection that posts /v1/embeddings (base64, as the openai client asks)."""

    def __init__(self, port: int):
        self.port = port
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)

    def post(self, texts: list[str], started: float) -> Outcome:
        body = orjson.dumps({"input": texts, "model": MODEL, "encoding_format": "base64"})
        start = time.perf_counter()
        try:
            status, data = self._exchange(body)
        except (OSError, http.client.HTTPException) as error:
            self._reconnect()
            end = time.perf_counter()
            return Outcome(end - started, end - start, 0, error=repr(error))
        end = time.perf_counter()
        tokens = orjson.loads(data)["usage"]["prompt_tokens"] if status == 200 else 0
        error = "" if status in (200, 429) else data[:200].decode(errors="replace")
        return Outcome(end - started, end - start, status, tokens, error)

    def _exchange(self, body: bytes) -> tuple[int, bytes]:
        """One request; sent again once on a fresh connection when the server had closed this one while it was
        idle (uvicorn closes a keep-alive connection after 5 idle seconds), which is no error of the server's."""
        for attempt in range(2):
            try:
                self.connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
                reply = self.connection.getresponse()
                return reply.status, reply.read()
            except (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected):
                if attempt:
                    raise
                self._reconnect()
        raise AssertionError("unreachable")

    def _reconnect(self) -> None:
        self.connection.close()
        self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)


def closed_loop(port: int, workload: Workload, clients: int, seconds: float) -> list[Outcome]:
    """`clients` connections, each sending its next request as soon as the last is answered."""
    outcomes: list[Outcome] = []
    started = time.perf_counter()
    deadline = started + seconds

    def run() -> None:
        client = Client(port)
        while time.perf_counter() < deadline:
            outcomes.append(client.post(workload.next(), started))

    _run_threads([run] * clients)
    return outcomes


def _run_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@dataclass
class OpenLoop:
    """Arrivals at `rate` a second (Poisson) for `seconds`, each taken by an idle one of `clients` connections."""

    port: int
    workload: Workload
    clients: int
    rate: float
    seconds: float
    outcomes: list[Outcome] = field(default_factory=list)
    not_sent: int = 0

    def run(self) -> None:
        inbox: queue.SimpleQueue[list[str] | None] = queue.SimpleQueue()
        idle = threading.Semaphore(self.clients)
        started = time.perf_counter()
        workers = [threading.Thread(target=self._serve, args=(inbox, idle, started)) for _ in range(self.clients)]
        for worker in workers:
            worker.start()
        for _ in self._arrivals(started):
            if idle.acquire(blocking=False):
                inbox.put(self.workload.next())
            else:
                self.not_sent += 1
        for _ in workers:
            inbox.put(None)
        for worker in workers:
            worker.join()

    def _arrivals(self, started: float) -> Iterator[None]:
        arrivals = random.Random(1)
        at = started
        while (at := at + arrivals.expovariate(self.rate)) < started + self.seconds:
            time.sleep(max(0.0, at - time.perf_counter()))
            yield None

    def _serve(self, inbox: queue.SimpleQueue[list[str] | None], idle: threading.Semaphore, started: float) -> None:
        client = Client(self.port)
        while (texts := inbox.get()) is not None:
            self.outcomes.append(client.post(texts, started))
            idle.release()


def memory_mb(pid: int) -> tuple[float, float]:
    """(VmRSS, its anonymous part) in MB, from /proc; (nan, nan) once the process is gone."""
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return float("nan"), float("nan")
    fields = {line.split()[0]: int(line.split()[1]) for line in rollup[1:]}
    return fields["Rss:"] / 1024, fields["Anonymous:"] / 1024


def serve_children(pid: int) -> dict[str, int]:
    """The gateway and replica processes `bouquet serve` (process `pid`) started, by name: gateway0, replica0..."""
    found: dict[str, list[int]] = {"gateway": [], "replica": []}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        for kind in found:
            if kind.encode() in argv:
                found[kind].append(int(stat.parent.name))
    return {f"{kind}{i}": child for kind, pids in found.items() for i, child in enumerate(sorted(pids))}


@dataclass
class Sampler:
    """Every `every` seconds, (seconds since start, {process: (rss, anon)}) into `rows`, until `stop` is set."""

    processes: dict[str, int]
    every: float
    rows: list[tuple[float, dict[str, tuple[float, float]]]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        started = time.perf_counter()
        while True:
            self.rows.append((time.perf_counter() - started, {n: memory_mb(p) for n, p in self.processes.items()}))
            if self.stop.wait(self.every):
                return


def percentile_ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def print_memory(sampler: Sampler, load: OpenLoop) -> None:
    names = list(sampler.processes)
    print("\nresident memory, MB (RSS / anonymous), and the requests answered 200 in each interval")
    print(f"{'t s':>6} " + " ".join(f"{name:>17}" for name in names) + f" {'200s':>6} {'tokens/s':>9}")
    previous = 0.0
    for at, memory in sampler.rows:
        window = [o for o in load.outcomes if previous <= o.end < at and o.status == 200]
        rate = sum(o.tokens for o in window) / (at - previous) if at > previous else 0.0
        cells = " ".join(f"{memory[n][0]:8.0f} /{memory[n][1]:7.0f}" for n in names)
        print(f"{at:6.0f} {cells} {len(window):6d} {rate:9,.0f}")
        previous = at


def flat_after_warmup(sampler: Sampler, warmup: float, tolerance: float) -> bool:
    """Prints each process's RSS spread after `warmup` seconds; True when every spread is within `tolerance`."""
    flat = True
    print(f"\nafter the {warmup:.0f} s warm-up: RSS spread (max - min) / min, allowed {tolerance:.0%}")
    for name in sampler.processes:
        values = [memory[name][0] for at, memory in sampler.rows if at >= warmup]
        if len(values) < 2:
            print(f"  {name}: too few samples after the warm-up")
            flat = False
            continue
        spread = (max(values) - min(values)) / min(values)
        flat &= spread <= tolerance
        print(f"  {name:9} {min(values):7.0f} .. {max(values):7.0f} MB  spread {spread:6.1%}  "
              f"{'flat' if spread <= tolerance else 'NOT FLAT'}")  # fmt: skip
    return flat


def print_requests(load: OpenLoop, capacity: float) -> int:
    """Prints the load's outcome; returns the count of errors other than 429."""
    ok = [o for o in load.outcomes if o.status == 200]
    rejected = sum(o.status == 429 for o in load.outcomes)
    errors = [o for o in load.outcomes if o.status not in (200, 429)]
    sent = len(load.outcomes)
    offered = f"{load.rate:.1f} requests/s offered ({load.rate / capacity:.1f}x capacity) for {load.seconds:.0f} s"
    print(f"\nload: {offered}, {load.clients} connections; {sent} sent, {load.not_sent} not sent (all busy)")
    latencies = [o.latency for o in ok]
    print(f"  admitted (200): {len(ok)}, {sum(o.tokens for o in ok) / load.seconds:,.0f} tokens/s; latency "
          f"p50 {percentile_ms(latencies, 50):,.0f} ms  p90 {percentile_ms(latencies, 90):,.0f} ms  "
          f"p99 {percentile_ms(latencies, 99):,.0f} ms")  # fmt: skip
    print(f"  429: {rejected} ({rejected / max(sent, 1):.1%} of those sent)")
    by_status = Counter(o.status for o in errors)
    print(f"  other errors: {len(errors)}" + "".join(f", {n} of status {s}" for s, n in sorted(by_status.items())))
    for outcome in errors[:5]:
        print(f"    status {outcome.status}: {outcome.error}")
    return len(errors)


def measure_capacity(port: int, workload: Workload, clients: int, seconds: float) -> float:
    """Requests a second answered 200 by `clients` closed-loop clients, after a short warm-up."""
    closed_loop(port, workload, clients, min(10.0, seconds / 2))  # warm-up
    outcomes = closed_loop(port, workload, clients, seconds)
    ok = [o for o in outcomes if o.status == 200]
    tokens = sum(o.tokens for o in ok) / seconds
    latency = statistics.median(o.latency for o in ok) * 1e3
    print(f"capacity: {len(ok) / seconds:.2f} requests/s, {tokens:,.0f} tokens/s "
          f"({clients} closed-loop clients, {seconds:.0f} s; request p50 {latency:,.0f} ms)", flush=True)  # fmt: skip
    return len(ok) / seconds


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600.0, help="the overload's length")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1, help="gateway processes")
    parser.add_argument("--overload", type=float, default=2.0, help="offered rate as a multiple of capacity")
    parser.add_argument("--clients", type=int, default=128, help="connections in the overload's pool")
    parser.add_argument("--capacity-clients", type=int, default=8)
    parser.add_argument("--capacity-seconds", type=float, default=30.0)
    parser.add_argument("--query-share", type=float, default=0.5, help="share of requests that are one query")
    parser.add_argument("--min-texts", type=int, default=16, help="texts a document request, at least")
    parser.add_argument("--max-texts", type=int, default=64, help="texts a document request, at most")
    parser.add_argument("--sample-every", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, help="seconds of the overload before RSS must be flat (default 20%%)")
    parser.add_argument("--flat", type=float, default=0.10, help="allowed RSS spread after the warm-up")
    parser.add_argument("--serve-arg", action="append", default=[], help="passed to `bouquet serve` (repeat)")
    return parser.parse_args()


def soak(serve: Process, port: int, args: argparse.Namespace) -> bool:
    """Capacity, then the overload with memory sampled; True when memory stayed flat and no request failed."""
    workload = Workload(args.query_share, args.min_texts, args.max_texts)
    sampler = Sampler(serve_children(serve.process.pid), args.sample_every)
    print(f"processes: {sampler.processes}", flush=True)
    before = {name: memory_mb(pid)[0] for name, pid in sampler.processes.items()}
    print("RSS at start, MB: " + ", ".join(f"{name} {rss:.0f}" for name, rss in before.items()), flush=True)
    capacity = measure_capacity(port, workload, args.capacity_clients, args.capacity_seconds)
    load = OpenLoop(port, workload, args.clients, args.overload * capacity, args.seconds)
    sampling = threading.Thread(target=sampler.run, daemon=True)
    sampling.start()
    load.run()
    sampler.stop.set()
    sampling.join()
    print_memory(sampler, load)
    warmup = args.warmup if args.warmup is not None else 0.2 * args.seconds
    flat = flat_after_warmup(sampler, warmup, args.flat)
    errors = print_requests(load, capacity)
    return flat and errors == 0


def main() -> int:
    args = parse_args()
    port = free_port()
    serve_args = ["--device", "cpu", "--replicas", str(args.replicas), "--workers", str(args.workers)]
    print(f"bouquet serve {' '.join([*serve_args, *args.serve_arg])}", flush=True)
    serve = start_serve(port, *serve_args, *args.serve_arg)
    try:
        serve.wait_ready()
        passed = soak(serve, port, args)
    finally:
        serve.stop()
    print(f"\nsoak {'passed' if passed else 'FAILED'}: RSS flat after the warm-up, no error but 429")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
