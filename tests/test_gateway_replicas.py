"""Two replicas behind `bouquet gateway`: killing one under load loses no request; with none left the gateway
answers 503, and it serves again once a replica comes back on its address."""

from __future__ import annotations

import json
import signal
import threading
import time
import urllib.error
import urllib.request

import corpus
import numpy as np
import pytest
from conftest import row_cosines

from bouquet.gateway.testing import free_port, start_gateway, start_replica, wait_healthy

pytestmark = pytest.mark.process  # every test starts bouquet processes

TEXTS = corpus.documents(16)


def embed(url: str, texts: list[str]) -> tuple[int, dict]:
    data = json.dumps({"input": texts, "encoding_format": "float"}).encode()
    request = urllib.request.Request(f"{url}/v1/embeddings", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def rows(body: dict) -> np.ndarray:
    return np.array([item["embedding"] for item in body["data"]], np.float32)


def healthy_replicas(url: str) -> int:
    with urllib.request.urlopen(f"{url}/info", timeout=10) as reply:
        return json.loads(reply.read())["replicas"]


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


@pytest.mark.long  # a load with failures and a recovery: 20 s, CI's long tier
def test_failover_under_load_then_503_then_recovery():
    ports = [free_port(), free_port()]
    replica_args = ("--dtype", "float32", "--max-batch-tokens", "512")
    replicas = [start_replica(port, *replica_args) for port in ports]
    gateway_port = free_port()
    # Half the capacity gone under a closed loop: requests queue for it (this tests failover, not admission).
    gateway = start_gateway(
        gateway_port, [f"127.0.0.1:{port}" for port in ports], "--chunk-tokens", "256", "--admission-wait", "120"
    )
    url = f"http://127.0.0.1:{gateway_port}"
    try:
        for process in (*replicas, gateway):
            process.wait_ready()
        wait_healthy(url)
        wait_for(lambda: healthy_replicas(url) == 2)
        status, body = embed(url, TEXTS)
        assert status == 200
        expected = rows(body)

        results: list[tuple[int, dict]] = []
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                results.append(embed(url, TEXTS))

        threads = [threading.Thread(target=client) for _ in range(6)]
        for thread in threads:
            thread.start()
        wait_for(lambda: len(results) >= 6)
        replicas[0].process.send_signal(signal.SIGKILL)
        killed_at = len(results)
        wait_for(lambda: len(results) >= killed_at + 12)
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
        assert [status for status, _ in results] == [200] * len(results)
        for _, body in results:
            assert row_cosines(rows(body), expected).min() >= 0.99999

        replicas[1].process.send_signal(signal.SIGKILL)
        wait_for(lambda: embed(url, TEXTS[:1])[0] == 503)
        status, error = embed(url, TEXTS[:1])
        assert status == 503 and error["error"]["code"] == "no_healthy_replica"

        replicas[1] = start_replica(ports[1], *replica_args)
        replicas[1].wait_ready()
        wait_for(lambda: embed(url, TEXTS[:1])[0] == 200, timeout=30)
        assert row_cosines(rows(embed(url, TEXTS)[1]), expected).min() >= 0.99999
    finally:
        gateway_status = gateway.stop()
        for process in replicas:
            process.stop()
    assert gateway_status == 0
