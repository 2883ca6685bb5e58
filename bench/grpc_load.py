"""Unary Embed calls to a replica from one process, as fast as it answers: `--concurrency` calls in flight, each
sending a request from `--requests` (serialized EmbedRequests, each prefixed by its length as 4 little-endian
bytes), from the wall-clock time `--start-at` for `--seconds`; prints one JSON line: calls answered, errors.

Imports grpc alone (no torch, no bouquet), so that several such processes load one replica without sharing
its process's interpreter lock (bench/gpu_check.py's replica section).

    python bench/grpc_load.py --address 127.0.0.1:PORT --requests FILE --start-at T --seconds 15 --concurrency 32
"""

from __future__ import annotations

import argparse
import asyncio
import json
import struct
import time
from pathlib import Path

import grpc

EMBED = "/bouquet.v1.Embedding/Embed"


def read_requests(path: Path) -> list[bytes]:
    data, requests, offset = path.read_bytes(), [], 0
    while offset < len(data):
        (size,) = struct.unpack_from("<I", data, offset)
        requests.append(data[offset + 4 : offset + 4 + size])
        offset += 4 + size
    return requests


def write_requests(path: Path, requests: list[bytes]) -> None:
    path.write_bytes(b"".join(struct.pack("<I", len(r)) + r for r in requests))


async def load(address: str, requests: list[bytes], start_at: float, seconds: float, concurrency: int) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        embed = channel.unary_unary(EMBED)  # bytes in, bytes out: no message classes needed here
        await embed(requests[0], timeout=120)  # connected, and the replica's first buckets warm
        await asyncio.sleep(max(0.0, start_at - time.time()))
        stop_at = start_at + seconds
        counts = {"calls": 0, "errors": 0}

        async def caller(index: int) -> None:
            request = requests[index % len(requests)]
            while time.time() < stop_at:
                try:
                    await embed(request, timeout=60)
                    counts["calls"] += time.time() <= stop_at  # answered inside the window
                except grpc.aio.AioRpcError:
                    counts["errors"] += 1

        await asyncio.gather(*(caller(i) for i in range(concurrency)))
        return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--start-at", type=float, required=True, help="time.time() at which the clock starts")
    parser.add_argument("--seconds", type=float, required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    requests = read_requests(args.requests)
    counts = asyncio.run(load(args.address, requests, args.start_at, args.seconds, args.concurrency))
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
