"""Each CPU choice of `bouquet serve` that depends on the machine, measured against its alternatives in one run.

The choices (--choices, comma-separated; all by default), each value one `bouquet serve` with every other option
at its default:
  workers       --cpu-workers: 1, 2 and (on more than 2 cores) one worker per thread
  lone-step     --cpu-lone-step-tokens: 256 (the default) against 0 (a lone short step keeps its worker's threads;
                borrowing only happens with one thread per worker, i.e. as many workers as threads)
  batch-tokens  --max-batch-tokens: 512, the CPU default (SchedulerConfig) and twice it, each with
                --cpu-warmup-tokens at the same value (the engine warms up to its step budget); the gateway's
                derived chunk follows the budget (twice it), as it does in `bouquet serve`
  chunk-tokens  --chunk-tokens: 512, derived (twice the step budget; the default) and four times the budget
A choice's servers are all started first (each idles while another is measured), then measured in turns, value
after value, for --rounds rounds, so that this VM's minute-to-minute swings fall on all of them; medians are
reported. Each turn: documents (standard-library docstrings, --per-request texts a request from --concurrency
clients on keep-alive connections, cycled for --seconds; real tokens per second end to end), with one short
query posted beside them every 0.1 s (its latency "under load": it waits behind the document steps queued
before it), then short queries one at a time for --query-seconds (a lone query's latency). The last line per
choice names the default and the value fastest here, by documents tokens/s, or by a lone query's p50 for
lone-step. The load average is printed after each choice: another process busy on the machine slows every
value, and may slow a lone step that borrows a core it shares with that process more than one on its own thread.

    .venv/bin/python bench/cpu_choices.py [--dtype float32] [--rounds 3] [--choices workers,lone-step,...]
                                          [--seconds 6] [--query-seconds 2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import corpus
import numpy as np
from serve import Client
from serve_configs import start

from bouquet.config import EngineConfig, SchedulerConfig, default_model_path
from bouquet.cpu_features import cpu_features
from bouquet.tokenizer import TextTokenizer

PROBE_INTERVAL = 0.1  # seconds between the short queries posted beside the documents
ROW = "  {:14} {:38} {:32} {:>9} {:>15}"


@dataclass(frozen=True)
class Choice:
    """One option of `bouquet serve` and the values to try; None leaves the option out (serve derives it)."""

    name: str
    flags: tuple[str, ...]  # each is given the value (a budget and the warm-up that must match it)
    values: tuple[int | None, ...]
    default: int | None
    by_query: bool = False  # fastest by a lone query's p50 rather than by documents tokens/s
    labels: dict[int | None, str] = field(default_factory=dict)
    note: str = ""  # printed under the choice's heading

    def serve_args(self, value: int | None) -> str:
        return "" if value is None else " ".join(f"{flag} {value}" for flag in self.flags)

    def label(self, value: int | None) -> str:
        return self.labels.get(value, str(value))


@dataclass
class Runs:
    """What one value measured, round by round."""

    rates: list[float] = field(default_factory=list)  # documents tokens/s
    query_p50s: list[float] = field(default_factory=list)  # a lone query's p50, seconds
    queries: list[float] = field(default_factory=list)  # every lone query's latency
    loaded: list[float] = field(default_factory=list)  # every query's latency under the documents


def serve_threads() -> int:
    """The intra-op threads `bouquet serve`'s one replica gets (gateway/serve.py's rule)."""
    return int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1)


def create_choices(threads: int) -> dict[str, Choice]:
    budget = SchedulerConfig.DEFAULT_MAX_BATCH_TOKENS["cpu"]
    lone = EngineConfig.cpu_lone_step_tokens
    return {  # workers' default: the engine's (Engine._split_threads)
        "workers": Choice(
            "--cpu-workers", ("--cpu-workers",), tuple(sorted({1, 2, threads})), 2 if threads >= 2 else 1
        ),
        "lone-step": Choice(
            "--cpu-lone-step-tokens",
            ("--cpu-lone-step-tokens",),
            (lone, 0),
            lone,
            by_query=True,
            labels={0: "0 (off)"},
            note="" if threads <= 2 else f"  (2 workers of {threads // 2} threads by default: no step borrows)",
        ),
        "batch-tokens": Choice(
            "--max-batch-tokens",
            ("--max-batch-tokens", "--cpu-warmup-tokens"),
            tuple(sorted({512, budget, 2 * budget})),
            budget,
        ),
        "chunk-tokens": Choice(
            "--chunk-tokens",
            ("--chunk-tokens",),
            (512, None, 4 * budget),
            None,
            labels={None: f"derived ({2 * budget})"},
        ),
    }


def documents(
    port: int, requests: list[list[str]], tokens: list[int], concurrency: int, seconds: float, probes: list[str]
) -> tuple[float, list[float]]:
    """Tokens/s of `concurrency` clients posting `requests` in turn for `seconds` (each finishes the request it
    has in flight), and the latencies of a short query posted every PROBE_INTERVAL meanwhile."""
    deadline = time.perf_counter() + seconds

    def client(first: int) -> int:
        connection, done, index = Client(port), 0, first
        while time.perf_counter() < deadline:
            connection.embed(requests[index % len(requests)])
            done += tokens[index % len(requests)]
            index += concurrency
        return done

    def probe() -> list[float]:
        connection, latencies = Client(port), []
        while time.perf_counter() < deadline:
            latencies.append(connection.embed([probes[len(latencies) % len(probes)]]))
            time.sleep(PROBE_INTERVAL)
        return latencies

    start_time = time.perf_counter()
    with ThreadPoolExecutor(concurrency + 1) as pool:
        probing = pool.submit(probe)
        done = sum(future.result() for future in [pool.submit(client, first) for first in range(concurrency)])
        elapsed = time.perf_counter() - start_time
        return done / elapsed, probing.result()


def lone_queries(port: int, queries: list[str], seconds: float) -> list[float]:
    """Short queries one at a time for `seconds`, after five to warm the connection."""
    connection = Client(port)
    for query in queries[:5]:
        connection.embed([query])
    deadline = time.perf_counter() + seconds
    latencies: list[float] = []
    while time.perf_counter() < deadline:
        latencies.append(connection.embed([queries[len(latencies) % len(queries)]]))
    return latencies


def measure(
    choice: Choice, workload: tuple[list[list[str]], list[int], list[str]], args: argparse.Namespace
) -> dict[int | None, Runs]:
    """Every value of `choice` served at once and measured in turns, --rounds times; Runs by value."""
    requests, tokens, queries = workload
    servers = {value: start(choice.serve_args(value), args.dtype) for value in choice.values}
    runs = {value: Runs() for value in choice.values}
    try:
        for _, port in servers.values():
            documents(port, requests, tokens, args.concurrency, 1.0, queries)  # warm-up
        for _ in range(args.rounds):
            for value, (_, port) in servers.items():
                rate, loaded = documents(port, requests, tokens, args.concurrency, args.seconds, queries)
                latencies = lone_queries(port, queries, args.query_seconds)
                record(runs[value], rate, loaded, latencies)
    finally:
        for serve, _ in servers.values():
            serve.stop()
    return runs


def record(runs: Runs, rate: float, loaded: list[float], latencies: list[float]) -> None:
    runs.rates.append(rate)
    runs.loaded += loaded
    runs.queries += latencies
    runs.query_p50s.append(statistics.median(latencies))


def report(choice: Choice, runs: dict[int | None, Runs]) -> str:
    """Prints the choice's table; returns its last line."""
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"\n{choice.name} (default {choice.label(choice.default)}; load average after it {load})")
    if choice.note:
        print(choice.note)
    print(ROW.format("value", "documents tokens/s (rounds)", "lone query p50 (rounds)", "p99", "under load p50"))
    for value, measured in runs.items():
        rates = f"{statistics.median(measured.rates):7,.0f} ({', '.join(f'{r:,.0f}' for r in measured.rates)})"
        p50s = ", ".join(f"{p * 1e3:.2f}" for p in measured.query_p50s)
        p50 = f"{statistics.median(measured.query_p50s) * 1e3:6.2f} ms ({p50s})"
        p99 = f"{np.percentile(measured.queries, 99) * 1e3:6.2f} ms"
        loaded = f"{statistics.median(measured.loaded) * 1e3:8.1f} ms" if measured.loaded else "-"
        print(ROW.format(choice.label(value), rates, p50, p99, loaded))
    return verdict(choice, runs)


def verdict(choice: Choice, runs: dict[int | None, Runs]) -> str:
    if choice.by_query:
        p50 = {value: statistics.median(measured.query_p50s) for value, measured in runs.items()}
        fastest = min(p50, key=p50.__getitem__)
        ratio = f"{p50[fastest] / p50[choice.default]:.2f}x the default's lone query p50"
    else:
        rate = {value: statistics.median(measured.rates) for value, measured in runs.items()}
        fastest = max(rate, key=rate.__getitem__)
        ratio = f"{rate[fastest] / rate[choice.default]:.2f}x the default's documents tokens/s"
    return f"{choice.name}: default {choice.label(choice.default)}, fastest here {choice.label(fastest)} ({ratio})"


def main() -> None:
    threads = serve_threads()
    choices = create_choices(threads)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--choices", default=",".join(choices), help=f"a subset of {','.join(choices)}")
    parser.add_argument("--seconds", type=float, default=6.0, help="of documents, per value and round")
    parser.add_argument("--query-seconds", type=float, default=2.0, help="of lone queries, per value and round")
    parser.add_argument("--docs", type=int, default=512)
    parser.add_argument("--per-request", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    chosen = args.choices.split(",")
    if unknown := [name for name in chosen if name not in choices]:
        parser.error(f"unknown choices {unknown}; known: {', '.join(choices)}")
    docs, queries = corpus.documents(args.docs), corpus.queries()
    lengths = list(map(len, TextTokenizer(default_model_path() / "tokenizer.json", 256).encode(docs)))
    starts = range(0, len(docs), args.per_request)
    requests = [docs[i : i + args.per_request] for i in starts]
    tokens = [sum(lengths[i : i + args.per_request]) for i in starts]
    print(f"# CPU: {cpu_features().describe()}; {threads} threads for the replica; {args.dtype}")
    print(f"# documents: {len(docs)} texts ({sum(lengths):,} tokens) cycled, {args.per_request} a request, "
          f"{args.concurrency} concurrent, {args.seconds:g} s a turn, a short query every {PROBE_INTERVAL:g} s "
          f"beside them; lone queries: {args.query_seconds:g} s a turn; {args.rounds} rounds")  # fmt: skip
    verdicts = [report(choices[name], measure(choices[name], (requests, tokens, queries), args)) for name in chosen]
    print()
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
