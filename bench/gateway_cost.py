"""What the gateway costs per request, in CPU time (not wall time, so a busy machine skews it little): a gateway
process in front of one replica, requests of one query and of 16 documents posted one client at a time, the
gateway's own CPU seconds (user + system, from /proc) divided by the requests and by their tokens. Compared, in
the same run, with the replica's CPU time for the same requests: the ratio says how many replicas' work one
gateway core keeps up with, i.e. when to add gateways rather than replicas.

    .venv/bin/python bench/gateway_cost.py [--requests 200]
"""

from __future__ import annotations

import argparse
import http.client
import json
from pathlib import Path

import corpus

from bouquet.gateway.testing import Process, free_port, start_gateway, start_replica, wait_healthy


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100


def post_all(port: int, texts: list[str], requests: int) -> int:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"input": texts, "encoding_format": "base64"})
    tokens = 0
    for _ in range(requests):
        connection.request("POST", "/v1/embeddings", body, {"Content-Type": "application/json"})
        reply = connection.getresponse()
        tokens += json.loads(reply.read())["usage"]["prompt_tokens"]
    return tokens


def measure(gateway: Process, replica: Process, port: int, texts: list[str], requests: int) -> str:
    post_all(port, texts, 5)  # warm
    before = cpu_seconds(gateway.process.pid), cpu_seconds(replica.process.pid)
    tokens = post_all(port, texts, requests)
    gateway_s = cpu_seconds(gateway.process.pid) - before[0]
    replica_s = cpu_seconds(replica.process.pid) - before[1]
    return (
        f"{len(texts):3d} texts a request: gateway {1000 * gateway_s / requests:6.2f} ms CPU a request, "
        f"{1000 * gateway_s / tokens * 1000:6.2f} ms a 1k tokens; replica {1000 * replica_s / requests:7.2f} ms; "
        f"one gateway core keeps up with {replica_s / max(gateway_s, 1e-9):5.1f} such replica cores"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    args = parser.parse_args()
    replica_port, port = free_port(), free_port()
    replica = start_replica(replica_port, "--dtype", "float32")
    gateway = start_gateway(port, [f"127.0.0.1:{replica_port}"])
    try:
        replica.wait_ready()
        gateway.wait_ready()
        wait_healthy(f"http://127.0.0.1:{port}")
        for texts in (corpus.queries(1), corpus.documents(16)):
            print(measure(gateway, replica, port, texts, args.requests))
    finally:
        gateway.stop()
        replica.stop()


if __name__ == "__main__":
    main()
