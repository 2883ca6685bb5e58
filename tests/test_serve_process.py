"""`bouquet serve` as an operator runs it: replicas and gateway workers as processes of their own, and SIGTERM
finishing the requests in flight before it exits."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import corpus
import httpx
import numpy as np
import pytest
from conftest import row_cosines
from test_replica_tls import make_certificates

from bouquet.gateway.testing import children, free_port, start_serve

pytestmark = pytest.mark.process  # every test starts bouquet processes


def in_flight(url: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    match = re.search(r"^bouquet_gateway_requests_in_flight (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def embed(url: str, texts: list[str]) -> tuple[int, int]:
    data = json.dumps({"input": texts, "model": "all-MiniLM-L6-v2"}).encode()
    request = urllib.request.Request(f"{url}/v1/embeddings", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=180) as reply:
        return reply.status, len(json.loads(reply.read())["data"])


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_sigterm_finishes_requests_in_flight():
    port = free_port()
    # A burst past what the replica computes in the admission window: queued, not refused (this tests draining). A
    # drain bound far above the work: on a loaded 2-core host (load average 8) the burst once took over the default
    # 30 s, and the work left was answered 503 at 30.0 s as it should be; that end is another test's
    # (test_gateway_process.py::test_a_drain_too_short_for_the_work_answers_503_not_500).
    serve = start_serve(
        port, "--workers", "2", "--device", "cpu", "--dtype", "float32", "--admission-wait", "120",
        "--drain-seconds", "120",
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready()
        commands = children(serve.process.pid)
        assert sum("bouquet.cli replica" in command for command in commands) == 1
        # Its replica listens on a Unix socket in a directory only this user can enter, not on TCP.
        words = next(command for command in commands if "bouquet.cli replica" in command).split()
        config_file = Path(words[words.index("--config") + 1])  # the replica's config, whole, beside its socket
        listen = json.loads(config_file.read_text())["replica"]["listen"]
        socket_path = Path(listen.removeprefix("unix:"))
        assert listen.startswith("unix:") and socket_path.is_socket()
        assert socket_path.parent.stat().st_mode & 0o777 == 0o700 and config_file.parent == socket_path.parent
        assert config_file.stat().st_mode & 0o777 == 0o600
        assert sum("bouquet.cli gateway" in command for command in commands) == 2
        texts = corpus.documents(48)
        with ThreadPoolExecutor(6) as pool:
            calls = [pool.submit(embed, url, texts) for _ in range(6)]
            deadline = time.monotonic() + 60
            while in_flight(url) < 7:  # six requests and this /metrics call, summed over both workers
                assert time.monotonic() < deadline, "the requests never arrived"
            serve.process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            results = [_answered(call, signalled, serve.lines) for call in calls]
        assert results == [(200, 48)] * 6
        assert serve.process.wait(timeout=240) == 0
    finally:
        serve.stop()


def _answered(call: Future[tuple[int, int]], signalled: float, log: list[str]) -> tuple[int, int]:
    """A drained request's status and rows; a refusal fails naming its status, body, when it came after the signal
    (a drain's 503 comes at --drain-seconds) and serve's last log lines."""
    try:
        return call.result()
    except urllib.error.HTTPError as error:
        after = time.monotonic() - signalled
        pytest.fail(f"HTTP {error.code} {error.read()[:300]!r} {after:.1f} s after the signal; log: {log[-30:]}")


@pytest.mark.long  # a serve start: CI's long tier
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the certificates")
def test_serve_over_mutual_tls(tmp_path: Path, sentence_transformer) -> None:
    """serve --tls-cert --tls-key --tls-client-ca: its gateways (two workers) answer over HTTPS clients holding a
    certificate the CA signed, with sentence-transformers' rows; a client without one, or in plaintext, gets none.
    serve is ready without probing them over HTTP (each gateway listens once it has heard from the replicas)."""
    tls = make_certificates(tmp_path)  # "replica" is a server certificate for 127.0.0.1, "gateway" a client's
    port = free_port()
    serve = start_serve(
        port, "--workers", "2", "--device", "cpu", "--dtype", "float32", "--tls-cert", str(tls / "replica.pem"),
        "--tls-key", str(tls / "replica.key"), "--tls-client-ca", str(tls / "ca.pem"),
    )  # fmt: skip
    url = f"https://127.0.0.1:{port}"
    trusted = ssl.create_default_context(cafile=tls / "ca.pem")
    client_certificate = ssl.create_default_context(cafile=tls / "ca.pem")
    client_certificate.load_cert_chain(tls / "gateway.pem", tls / "gateway.key")
    texts = [*corpus.documents(6), *corpus.queries(3)]
    try:
        serve.wait_ready()
        assert any(f"ready on {url}" in line for line in serve.lines)
        fresh = httpx.Limits(max_keepalive_connections=0)  # a connection each, spread over both workers
        with httpx.Client(verify=client_certificate, timeout=120, limits=fresh) as client:
            answers = [client.post(f"{url}/v1/embeddings", json={"input": texts}) for _ in range(4)]
        for answer in answers:
            assert answer.status_code == 200, answer.text
            rows = np.array([item["embedding"] for item in answer.json()["data"]], np.float32)
            assert row_cosines(rows, sentence_transformer.encode(texts)).min() >= 0.99999
        for context, where in ((trusted, url), (None, url.replace("https://", "http://"))):
            with httpx.Client(verify=context or False, timeout=10) as client, pytest.raises(httpx.TransportError):
                client.get(f"{where}/health")
    finally:
        assert serve.stop() == 0


@pytest.mark.fault
@pytest.mark.long  # 15 s; a fault campaign's case: CI runs it in its long tier
def test_sigkill_of_serve_still_answers_the_requests_in_flight():
    """serve killed outright: its gateways get SIGTERM and finish their requests while the replicas, told to go
    only once their gateways are done, keep serving them; then every child exits."""
    port = free_port()
    serve = start_serve(
        port, "--device", "cpu", "--dtype", "float32", "--chunk-tokens", "512", "--admission-wait", "120"
    )
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready()
        kids = [int(pid) for pid in _child_pids(serve.process.pid)]
        texts = corpus.documents(48)
        with ThreadPoolExecutor(8) as pool:
            calls = [pool.submit(embed, url, texts) for _ in range(8)]
            deadline = time.monotonic() + 60
            while in_flight(url) < 9:
                assert time.monotonic() < deadline, "the requests never arrived"
            serve.process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            results = [_answered(call, killed, serve.lines) for call in calls]
        assert results == [(200, 48)] * 8
        deadline = time.monotonic() + 60
        while any(_alive(pid) for pid in kids):
            assert time.monotonic() < deadline, "a child of the killed serve kept running"
            time.sleep(0.1)
    finally:
        serve.stop()


def _child_pids(pid: int) -> list[str]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(stat.parent.name)
        except (OSError, ValueError, IndexError):
            continue
    return found


def _alive(pid: int) -> bool:
    from pathlib import Path

    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.fault
@pytest.mark.long  # 8 s; a fault campaign's case: CI runs it in its long tier
def test_a_killed_replica_is_restarted_on_its_socket_and_served_again():
    port = free_port()
    serve = start_serve(port, "--device", "cpu", "--dtype", "float32")
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready()
        replica = next(
            int(pid) for pid in _child_pids(serve.process.pid)
            if "replica" in Path(f"/proc/{pid}/cmdline").read_text()
        )  # fmt: skip
        os.kill(replica, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not any("exited; restarting" in line for line in serve.lines):
            assert time.monotonic() < deadline, "serve did not restart its replica"
            time.sleep(0.1)
        while True:  # 503 until the new process has loaded the model and listens on the old socket
            try:
                assert embed(url, ["served again"]) == (200, 1)
                break
            except urllib.error.HTTPError as error:
                assert error.code == 503 and time.monotonic() < deadline, error.code
                time.sleep(0.2)
    finally:
        assert serve.stop() == 0
