"""bench/gpu_check.py's replica section: one replica's tokens/s under many concurrent gRPC clients, beside the bare
engine's."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpu_setup import Run, make_engine, random_batch, random_ids, release

ROOT = Path(__file__).resolve().parent.parent


def replica_throughput(run: Run, path: Path, backend: str) -> None:
    """50-token inputs, 16 a request, into a replica's scheduler and engine, from client processes of their own
    (bench/grpc_load.py) so that the replica's event loop has this process's interpreter to itself (the
    published record: 1.6M tokens/s on one H200 from 32 vLLM copies); beside it the bare engine's tokens/s,
    steps of the scheduler's budget launched back to back."""
    from bouquet.batch import Batch
    from bouquet.config import SchedulerConfig
    from bouquet.replica.client import embed_request
    from bouquet.replica.testing import ReplicaThread

    engine = make_engine(path, run.device, "bfloat16", backend, graphs=not run.dry_run)
    replica = None
    processes, concurrency, per_request, seconds = (4, 32, 16, 15.0) if not run.dry_run else (2, 2, 4, 1.0)
    try:
        replica = ReplicaThread(engine, SchedulerConfig.for_device(run.device, 4096 if not run.dry_run else 512))
        requests = [embed_request(Batch.pack(random_ids(per_request, 50, seed))) for seed in range(64)]
        lead_s = 3.0 if run.dry_run else 10.0  # for each client process to import grpc, connect and make one call
        load = [r.SerializeToString() for r in requests], (processes, concurrency), seconds, lead_s
        calls, errors = drive_clients(replica.address, *load)
        served = calls * per_request * 50 / seconds
        batch = random_batch([50] * (replica.config.max_batch_tokens // 50), 30522)
        steps = 3 if run.dry_run else 30
        for _ in range(3):
            engine.embed(batch)
        start = time.perf_counter()
        for lazy in [engine.step(batch) for _ in range(steps)]:
            lazy.result(timeout=60)
        bare = steps * batch.num_tokens / (time.perf_counter() - start)
    finally:
        if replica is not None:
            replica.stop()
        release(engine)
    clients = f"{processes} client processes x {concurrency} calls in flight"
    summary = f"{served:,.0f} tokens/s from {clients} ({calls} requests of {per_request} x 50, {errors} errors)"
    run.report.add("bert-base: one replica, 50-token inputs", f"{summary}; bare engine {bare:,.0f} tokens/s", ">= 2.0M")


def drive_clients(
    address: str, requests: list[bytes], clients: tuple[int, int], seconds: float, lead_s: float
) -> tuple[int, int]:
    """Answered calls and errors from `clients` = (processes, calls in flight in each) grpc_load.py processes,
    the clock started `lead_s` from now in all."""
    from grpc_load import write_requests

    processes, concurrency = clients
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "requests.bin"
        write_requests(file, requests)
        command = [sys.executable, str(ROOT / "bench" / "grpc_load.py"), "--address", address, "--requests", str(file)]
        command += ["--start-at", str(time.time() + lead_s), "--seconds", str(seconds)]
        command += ["--concurrency", str(concurrency)]
        children = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
        try:
            outputs = [child.communicate(timeout=lead_s + seconds + 90)[0] for child in children]
        finally:
            for child in children:
                child.kill()
    if any(child.returncode for child in children):
        raise RuntimeError(f"a load process failed: return codes {[child.returncode for child in children]}")
    counts = [json.loads(output.strip().splitlines()[-1]) for output in outputs]
    return sum(c["calls"] for c in counts), sum(c["errors"] for c in counts)
