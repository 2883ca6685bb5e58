"""Where a served one-text query's time goes, stage by stage: `bouquet serve` (one tree or two, side by side) with
timestamps at the stages of bench/stage_marks.py, one query at a time on a keep-alive connection (the bench's
client, base64 rows), the trees' requests alternated when there are two.

For each request the marks that fell between the client's send and its last byte, as offsets from the send;
printed: each mark's median offset in time order with the step from the one before, and per request the time
around the engine's forward (end to end less `Engine._run_on_cpu`), median. The marks cost ~1-2 us each, about
0.1 ms a query in all, the same in both trees.

    .venv/bin/python bench/served_stages.py [--src DIR [--src DIR2]] [--dtype int8] [--queries 800]
"""

from __future__ import annotations

import argparse
import bisect
import collections
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import corpus
import numpy as np
from serve import Client

from bouquet.gateway.testing import Process, free_port

BENCH = Path(__file__).resolve().parent
FORWARD = "engine: forward"


def start(src: Path, dtype: str, marks: Path, site: Path) -> tuple[Process, int]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{site}:{BENCH}:{src}", "BOUQUET_STAGE_MARKS": str(marks)}
    command = [sys.executable, "-m", "bouquet.cli", "serve", "--port", str(port), "--device", "cpu", "--dtype", dtype]
    process = Process(subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env), r"bouquet serve: ready")
    process.wait_ready()
    return process, port


def timed(client: Client, query: str) -> tuple[int, int]:
    begin = time.perf_counter_ns()
    client.embed([query])
    return begin, time.perf_counter_ns()


def read_marks(directory: Path) -> tuple[list[int], list[str]]:
    marks: list[tuple[int, str]] = []
    for file in directory.glob("*.txt"):
        for line in file.read_text().splitlines():
            label, ns = line.rsplit("\t", 1)
            marks.append((int(ns), label))
    marks.sort()
    return [ns for ns, _ in marks], [label for _, label in marks]


def stages(windows: list[tuple[int, int]], directory: Path) -> tuple[list[tuple[float, str]], list[float]]:
    """Median offset (us) of each mark seen in 90% of the requests, in time order; each request's time around the
    engine's forward (us)."""
    times, labels = read_marks(directory)
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    around = []
    for begin, end in windows:
        seen: collections.Counter[str] = collections.Counter()
        inside = range(bisect.bisect_left(times, begin), bisect.bisect_right(times, end))
        forward = {labels[i]: times[i] for i in inside if labels[i].startswith(FORWARD)}
        for i in inside:
            seen[labels[i]] += 1
            offsets[f"{labels[i]} #{seen[labels[i]]}"].append((times[i] - begin) / 1e3)
        offsets["client: last byte"].append((end - begin) / 1e3)
        if {FORWARD + ">", FORWARD + "<"} <= forward.keys():
            around.append((end - begin - forward[FORWARD + "<"] + forward[FORWARD + ">"]) / 1e3)
    common = [(float(np.median(v)), k) for k, v in offsets.items() if len(v) >= 0.9 * len(windows)]
    return sorted(common), around


def report(src: Path, windows: list[tuple[int, int]], directory: Path) -> None:
    found, around = stages(windows, directory)
    total = np.array([(end - begin) / 1e6 for begin, end in windows])
    print(f"\n== {src}: {len(windows)} queries, p50 {np.median(total):.3f} ms, p99 {np.percentile(total, 99):.3f}; "
          f"around the forward p50 {np.median(around):.0f} us")  # fmt: skip
    previous = 0.0
    for offset, label in found:
        print(f"  {label:34s} {offset:8.1f} us  (+{offset - previous:7.1f})")
        previous = offset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", type=Path, action="append", help="a tree's src/ (default: this checkout's)")
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--queries", type=int, default=800)
    args = parser.parse_args()
    trees = args.src or [BENCH.parent / "src"]
    queries = corpus.queries(args.queries)
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch, "site")
        site.mkdir()
        (site / "sitecustomize.py").write_text("import stage_marks  # noqa: F401\n")
        servers = []
        for index, src in enumerate(trees):
            marks = Path(scratch, f"marks{index}")
            marks.mkdir()
            servers.append((src, marks, *start(src, args.dtype, marks, site)))
        try:
            clients = [Client(port) for _, _, _, port in servers]
            windows: list[list[tuple[int, int]]] = [[] for _ in servers]
            for number, query in enumerate([*queries[:30], *queries]):
                order = range(len(servers)) if number % 2 == 0 else reversed(range(len(servers)))
                for index in order:
                    window = timed(clients[index], query)
                    if number >= 30:  # the first 30 warm the connections and the replicas' shapes
                        windows[index].append(window)
        finally:
            for _, _, process, _ in servers:
                process.stop()
        for (src, marks, _, _), taken in zip(servers, windows, strict=True):
            report(src, taken, marks)


if __name__ == "__main__":
    main()
