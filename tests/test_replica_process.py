"""`bouquet replica` as an operator runs it: a process that serves once loaded and drains on SIGTERM."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from conftest import embed_ids
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bouquet.batch import Batch
from bouquet.proto import embedding_pb2_grpc
from bouquet.replica.client import embed_request, response_rows
from bouquet.replica.testing import marked, wait_until

pytestmark = pytest.mark.process  # every test starts bouquet processes


@dataclass
class ReplicaProcess:
    process: subprocess.Popen[str]
    address: str
    metrics_url: str

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(self.metrics_url, timeout=10).read().decode()
        match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def replica_process(minilm_path) -> Iterator[ReplicaProcess]:
    metrics_port = _free_port()
    command = [sys.executable, "-m", "bouquet.cli", "replica", "--model", str(minilm_path), "--listen",
               "127.0.0.1:0", "--max-batch-tokens", "512", "--metrics-port", str(metrics_port), "--dtype", "float32",
               "--device", "cpu"]  # fmt: skip
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True)
    try:
        port = _wait_for_port(process)
        yield ReplicaProcess(process, f"127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
        process.stderr.close()


def _wait_for_port(process: subprocess.Popen[str]) -> int:
    """The replica prints its port once the model is loaded (it listens on port 0: any free port)."""
    assert process.stderr is not None
    for line in process.stderr:
        match = re.search(r"serving .* on port (\d+)", line)
        if match:
            return int(match.group(1))
    raise AssertionError(f"replica exited with {process.wait()} before serving")


def test_health_reports_serving_once_loaded(replica_process):
    with grpc.insecure_channel(replica_process.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="bouquet.v1.Embedding"), timeout=10)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_sigterm_finishes_queued_work_then_exits_zero(replica_process, minilm_fp32):
    requests = [[marked(1000 + 10 * i + j, length=200) for j in range(6)] for i in range(8)]  # 9600 tokens
    with grpc.insecure_channel(replica_process.address) as channel:
        stub = embedding_pb2_grpc.EmbeddingStub(channel)
        calls = [stub.Embed.future(embed_request(Batch.pack(sequences)), timeout=120) for sequences in requests]
        # Every call has reached the replica, and some of its work is queued, not only in flight.
        received = ("bouquet_requests_in_progress", 'bouquet_requests_total{status="OK"}')
        wait_until(lambda: sum(map(replica_process.metric, received)) == len(requests))
        wait_until(lambda: replica_process.metric("bouquet_queue_seqs") > 0)
        replica_process.process.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        with pytest.raises(grpc.RpcError) as refused:  # a call after SIGTERM is turned away
            stub.Embed(embed_request(Batch.pack([marked(3)])), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        results = [response_rows(call.result(timeout=120)) for call in calls]
    assert replica_process.process.wait(timeout=60) == 0
    for sequences, rows in zip(requests, results, strict=True):
        np.testing.assert_allclose(rows, embed_ids(minilm_fp32, sequences), rtol=1e-4, atol=2e-5)


def test_sigterm_with_nothing_in_flight_exits_at_once(replica_process):
    """A gateway's health Watch stream is always open; it must not hold an idle replica for its whole drain time
    (60 s by default, beyond Kubernetes' 30 s grace)."""
    with grpc.insecure_channel(replica_process.address) as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        started = time.monotonic()
        replica_process.process.send_signal(signal.SIGTERM)
        assert replica_process.process.wait(timeout=30) == 0
    # Not the 60 s drain: it left once nothing was in flight (0.2 s here; the bound is 1 s).
    assert time.monotonic() - started < 1.0


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_a_replica_with_a_token_refuses_calls_without_it(minilm_path):
    """$BOUQUET_REPLICA_TOKEN set: Embed and Info need it (serve makes one for its own replicas and gateways);
    health stays open for orchestrators' probes."""
    import os

    command = [sys.executable, "-m", "bouquet.cli", "replica", "--model", str(minilm_path), "--listen",
               "127.0.0.1:0", "--device", "cpu", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "BOUQUET_REPLICA_TOKEN": "t0ken"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        address = f"127.0.0.1:{_wait_for_port(process)}"
        request = embed_request(Batch.pack([marked(5)]))
        with grpc.insecure_channel(address) as channel:
            stub = embedding_pb2_grpc.EmbeddingStub(channel)
            for metadata in (None, (("authorization", "Bearer wrong"),)):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Embed(request, timeout=10, metadata=metadata)
                assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            rows = response_rows(stub.Embed(request, timeout=30, metadata=(("authorization", "Bearer t0ken"),)))
            assert rows.shape == (1, 384)
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        process.kill()
        process.wait(timeout=30)
        process.stderr.close()


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_an_orphaned_replica_serves_until_the_last_gateway_has_exited(minilm_path, tmp_path):
    """`bouquet serve` killed: its replicas get ORPHANED_SIGNAL while its gateways drain. A replica serves until
    no gateway holds serve's lock file (serve_lock.py), however long that takes, not just until its calls pause
    (2 s, the fallback without the file), then drains and exits."""
    import os

    from bouquet.config import ORPHANED_SIGNAL
    from bouquet.processes import serve_lock

    lock = tmp_path / "gateways.lock"
    hold = "import fcntl, os, sys; fcntl.flock(os.open(sys.argv[1], os.O_RDWR | os.O_CREAT), fcntl.LOCK_SH); " \
           "print('held', flush=True); sys.stdin.read()"  # fmt: skip
    gateway = subprocess.Popen([sys.executable, "-c", hold, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)  # fmt: skip
    assert gateway.stdout is not None and gateway.stdout.readline() == "held\n"
    command = [sys.executable, "-m", "bouquet.cli", "replica", "--model", str(minilm_path), "--listen",
               "127.0.0.1:0", "--device", "cpu", "--dtype", "float32", "--cpu-warmup-tokens", "0"]  # fmt: skip
    process = subprocess.Popen(
        command, stderr=subprocess.PIPE, text=True, env={**os.environ, serve_lock.ENV: str(lock)}
    )
    try:
        address = f"127.0.0.1:{_wait_for_port(process)}"
        process.send_signal(ORPHANED_SIGNAL)
        time.sleep(3.0)  # past the 2 s without a call that ends the fallback's wait
        assert process.poll() is None, "the replica left while a gateway still lived"
        with grpc.insecure_channel(address) as channel:
            rows = response_rows(
                embedding_pb2_grpc.EmbeddingStub(channel).Embed(embed_request(Batch.pack([marked(5)])))
            )
            assert rows.shape == (1, 384)
        assert gateway.stdin is not None
        gateway.stdin.close()  # the last gateway exits: its lock goes with it
        assert gateway.wait(timeout=10) == 0
        started = time.monotonic()
        assert process.wait(timeout=30) == 0
        assert time.monotonic() - started < 5
    finally:
        gateway.kill()
        process.kill()
        process.wait(timeout=30)
        process.stderr.close()


def test_the_gateways_lock_reads_free_only_once_every_holder_has_exited(tmp_path, monkeypatch):
    """serve_lock.py: no file from serve (or none yet) is None, the replica's fallback; held by any gateway
    process, not free; free once the last one has exited, however it exited."""
    import os

    from bouquet.processes import serve_lock

    monkeypatch.delenv(serve_lock.ENV, raising=False)
    assert serve_lock.gateways_gone() is None  # not started by serve
    path = tmp_path / "gateways.lock"
    monkeypatch.setenv(serve_lock.ENV, str(path))
    assert serve_lock.gateways_gone() is None and not path.exists()  # a replica never makes the file anew
    serve_lock.create(str(path))
    assert serve_lock.gateways_gone() is True
    hold = "import sys; from bouquet.processes import serve_lock; serve_lock.hold_while_alive(); " \
           "print('held', flush=True); sys.stdin.read()"  # fmt: skip
    gateways = [subprocess.Popen([sys.executable, "-c", hold], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                 env=dict(os.environ)) for _ in range(2)]  # fmt: skip
    try:
        for gateway in gateways:
            assert gateway.stdout is not None and gateway.stdout.readline() == "held\n"
        assert serve_lock.gateways_gone() is False
        assert gateways[0].stdin is not None
        gateways[0].stdin.close()
        assert gateways[0].wait(timeout=10) == 0
        assert serve_lock.gateways_gone() is False  # one gateway still lives
        gateways[1].kill()  # however it exits
        gateways[1].wait(timeout=10)
        assert serve_lock.gateways_gone() is True
    finally:
        for gateway in gateways:
            gateway.kill()
            gateway.wait(timeout=10)
            for stream in (gateway.stdin, gateway.stdout):
                if stream is not None:
                    stream.close()
