"""How throughput scales with replica hosts: one gateway on a host of its own in front of 1, 2 and 3 replica hosts
(network namespaces on a bridge, tests/netns.py; root needed), each replica pinned to a core of its own where the
machine has enough (else they share them), the same documents posted by the same clients each time. Prints
tokens/s per host count and the ratio to one host, medians of --repeats runs. On a machine with fewer cores than
replicas plus gateway, the ratios show what the cores allow, not what more hosts would give: it says so.

    sudo .venv/bin/python bench/scaling.py [--hosts 1,2,3] [--seconds 15] [--repeats 2] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import corpus

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from netns import Cluster, netns_available

from bouquet.gateway.testing import Process, start_gateway, start_replica, wait_healthy

REPLICA_PORT, GATEWAY_PORT = 50051, 8000


def post_for(address: str, texts: list[str], seconds: float, concurrency: int) -> float:
    """Tokens/s the gateway at `address` answers with `concurrency` clients posting `texts` for `seconds`."""
    host, port = address.split(":")
    tokens: list[int] = []
    deadline = time.monotonic() + seconds

    def client() -> None:
        connection = http.client.HTTPConnection(host, int(port), timeout=120)
        body = json.dumps({"input": texts, "encoding_format": "base64"})
        while time.monotonic() < deadline:
            connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
            reply = connection.getresponse()
            answer = json.loads(reply.read())
            if reply.status == 200:
                tokens.append(answer["usage"]["prompt_tokens"])

    started = time.monotonic()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(tokens) / (time.monotonic() - started)


def measure(hosts: int, texts: list[str], seconds: float, concurrency: int) -> float:
    cores = os.cpu_count() or 1
    names = ["gw", *(f"r{index}" for index in range(1, hosts + 1))]
    processes: list[Process] = []
    with Cluster(names) as cluster:
        try:
            for index in range(hosts):
                host = cluster[f"r{index + 1}"]
                pin = ["taskset", "-c", str(index % cores)] if hosts <= cores else []
                os.environ["OMP_NUM_THREADS"] = "1" if hosts <= cores else str(max(1, cores // hosts))
                args = ("--dtype", "float32", "--cpu-workers", "1")
                processes.append(start_replica(REPLICA_PORT, *args, host=host.address, prefix=[*host.prefix, *pin]))
            gw = cluster["gw"]
            replicas = [cluster[f"r{index + 1}"].addr(REPLICA_PORT) for index in range(hosts)]
            processes.append(start_gateway(GATEWAY_PORT, replicas, "--host", gw.address, prefix=gw.prefix))
            for process in processes:
                process.wait_ready()
            address = gw.forward(GATEWAY_PORT)
            wait_healthy(f"http://{address}")
            post_for(address, texts, 3, concurrency)  # warm-up
            return post_for(address, texts, seconds, concurrency)
        finally:
            for process in reversed(processes):
                process.stop()
            os.environ.pop("OMP_NUM_THREADS", None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", default="1,2,3")
    parser.add_argument("--seconds", type=float, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    available, reason = netns_available()
    if not available:
        sys.exit(f"bench/scaling.py: {reason}")
    counts = [int(count) for count in args.hosts.split(",")]
    texts = corpus.documents(16)
    runs: dict[int, list[float]] = {count: [] for count in counts}
    for _ in range(args.repeats):
        for count in counts:  # interleaved, so drift on a shared machine spreads over every count
            runs[count].append(measure(count, texts, args.seconds, args.concurrency))
    base = statistics.median(runs[counts[0]])
    cores = os.cpu_count() or 1
    print(f"replica hosts | tokens/s (median of {args.repeats}) | x {counts[0]} host(s)   [{cores} cores]")
    for count in counts:
        median = statistics.median(runs[count])
        note = "" if count <= cores else "  (more replicas than cores: they share them)"
        print(f"{count:13d} | {median:26,.0f} | {median / base:.2f}x{note}")


if __name__ == "__main__":
    main()
