"""Overload: 64 clients sending 256 texts each, far past what the replica can compute, with a one-text probe
beside them. Every answer comes within 5 s (200, or 429 with Retry-After), the probe's median within 1 s (both
bounds scaled by one big request's time alone on a slower machine), the
replica stops computing within 1 s of the last answer (refused and cancelled work is not computed) and the
gateway's RSS comes back within 20% of its start. Marked `fault`; CI runs it.

Twice: with clients that wait the Retry-After they are given (1 s), as the OpenAI and Hugging Face clients do,
and with clients that retry after 0.1 s whatever they are told. Those sent about 400 refused 256-text bodies a
second, and parsing them took the gateway a whole core of this 2-core VM from the replica (served requests 6 to
8 s) until large bodies were refused unread (docs/benchmarks.md, "Overload"). One 256-text request (~34k tokens)
takes 3.4 to 5.1 s alone here (about 2 s on the machine the issue was measured on); when it takes over 3.5 s (the
VM slower, a neighbour on its host), the bound becomes that time plus 1.5 s: on such a spell a served request
took up to 1.2x its time alone (5.23 s against 4.30), over the 1 s margin the test first had, and on CI's slower
machine 2x (13.7 s against 6.8) with clients retrying every 0.1 s: the bound is 2.5x its time alone plus 1 s."""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import corpus
import pytest

from bouquet.gateway.testing import Process, free_port, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.long, pytest.mark.process]
CLIENTS = 64
TEXTS = 256
LOAD_SECONDS = 20.0


def _body(texts: list[str] | str) -> bytes:
    return json.dumps({"input": texts, "encoding_format": "base64"}).encode()


def _post(url: str, data: bytes) -> tuple[int, float]:
    """The status, and the seconds Retry-After asks for (0 unless a 429)."""
    request = urllib.request.Request(f"{url}/v1/embeddings", data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()
            return reply.status, 0.0
    except urllib.error.HTTPError as error:
        error.read()
        if error.code != 429:
            return error.code, 0.0
        assert error.headers.get("Retry-After"), "a 429 without Retry-After"
        return error.code, float(error.headers["Retry-After"])


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 1/100 s


def _seconds_until_idle(pid: int, quiet: float = 0.5, timeout: float = 30.0) -> float:
    """Seconds from now until the process has used no CPU for `quiet` seconds (that quiet time not counted)."""
    started = time.monotonic()
    last = _cpu_seconds(pid)
    last_change = started
    while time.monotonic() - last_change < quiet:
        assert time.monotonic() - started < timeout, "the replica kept computing"
        time.sleep(0.05)
        now = _cpu_seconds(pid)
        if now - last > 0.02:  # more than the idle process's own housekeeping
            last, last_change = now, time.monotonic()
    return last_change - started


class _Load:
    def __init__(self, url: str, retry_after: float | None):
        self.url = url
        self.retry_after = retry_after  # None: the seconds each 429 asks for
        self.stop = threading.Event()
        self.answers: list[tuple[int, float]] = []  # (status, seconds) of every big request
        self.probes: list[tuple[int, float]] = []
        self.last_answer = 0.0
        self.body = _body(corpus.documents(TEXTS))

    def _timed(self, body: bytes, into: list[tuple[int, float]]) -> float:
        started = time.monotonic()
        status, retry_after = _post(self.url, body)
        ended = time.monotonic()
        into.append((status, ended - started))
        self.last_answer = max(self.last_answer, ended)
        return retry_after

    def client(self) -> None:
        while not self.stop.is_set():
            retry_after = self._timed(self.body, self.answers)
            self.stop.wait(retry_after if self.retry_after is None or not retry_after else self.retry_after)

    def probe(self) -> None:
        body = _body("what does the probe wait for?")
        while not self.stop.is_set():
            self._timed(body, self.probes)
            time.sleep(0.2)


@pytest.mark.parametrize("retry_after", [None, 0.1], ids=["retry_as_asked", "retry_after_0.1s"])
def test_overload_is_refused_early_and_short_requests_keep_a_short_wait(retry_after: float | None) -> None:
    replica_port, gateway_port = free_port(), free_port()
    replica = start_replica(replica_port, "--dtype", "float32")
    gateway = start_gateway(gateway_port, [f"127.0.0.1:{replica_port}"])
    url = f"http://127.0.0.1:{gateway_port}"
    load = _Load(url, retry_after)
    try:
        for process in (replica, gateway):
            process.wait_ready()
        wait_healthy(url)
        assert _post(url, load.body)[0] == 200  # warm: the model's first batches, the tokenizer
        started = time.monotonic()
        assert _post(url, load.body)[0] == 200
        alone = time.monotonic() - started  # one request with the replica to itself
        rss_start = _rss_mb(gateway.process.pid)
        threads = [threading.Thread(target=load.client) for _ in range(CLIENTS)]
        threads.append(threading.Thread(target=load.probe))
        for thread in threads:
            thread.start()
        time.sleep(LOAD_SECONDS)
        load.stop.set()
        for thread in threads:
            thread.join(timeout=120)
        since_last_answer = time.monotonic() - load.last_answer
        idle_after = since_last_answer + _seconds_until_idle(replica.process.pid)
        time.sleep(1)
        rss_end = _rss_mb(gateway.process.pid)
    finally:
        load.stop.set()
        _stop(gateway, replica)
    _report(load, idle_after, rss_start, rss_end, alone)
    statuses = {status for status, _ in load.answers + load.probes}
    assert statuses <= {200, 429}, statuses
    assert any(status == 200 for status, _ in load.answers), "no big request was served"
    # Before admission control, answers came after 30-68 s here, and a probe waited 52 s; before a request's own
    # time shortened its wait, 5.5-9 s.
    # Relative to the request alone: a slow VM took 6.5 s for it alone, and 8.6 s under the load; CI's (6.8 s alone)
    # 13.7 s with clients retrying every 0.1 s, whose 170 refusals a second share its 2 cores with the replica. A
    # request queued behind the other 63 clients' would take tens of times its time alone: 2.5x still tells.
    assert max(seconds for _, seconds in load.answers) <= max(5.0, 2.5 * alone + 1.0)
    assert all(status == 200 for status, _ in load.probes), "a one-text probe was refused"
    # A probe waits for the step running when it comes, which a slower machine makes longer: CI's probe p50 1.2 s
    # when one big request alone took 6.8 s there.
    assert statistics.median(seconds for _, seconds in load.probes) <= max(1.0, 0.25 * alone)
    assert idle_after <= 1.0 + 0.1  # the quiet window's sampling
    # +45-90 MB before the idle trim collected refused requests' cycles (gateway/memory_trim.py); +860 MB before
    # admission control. What stays after the trim is a high-water mark, not a leak: on a Zen 5 VM whose clients
    # got 1,600-1,800 requests refused in 20 s, +26-31 MB, and +32 MB after 45 s and 3,252 requests
    # (docs/memory.md); under 20% on the slower CPUs before.
    assert rss_end <= 1.3 * rss_start


def _stop(*processes: Process) -> None:
    for process in processes:
        process.stop()


def _report(load: _Load, idle_after: float, rss_start: float, rss_end: float, alone: float) -> None:
    served = [seconds for status, seconds in load.answers if status == 200]
    probes = sorted(seconds for _, seconds in load.probes)
    refused = sorted(seconds for status, seconds in load.answers if status != 200)
    print(
        f"overload: one request alone {alone:.2f} s; {len(load.answers)} big requests, {len(served)} served in "
        f"{' '.join(f'{seconds:.2f}' for seconds in served)} s; refused p50 {statistics.median(refused):.3f} s "
        f"max {refused[-1]:.2f} s;"
        f" probe p50 {statistics.median(probes):.3f} s max {probes[-1]:.3f} s ({len(probes)});"
        f" replica idle {idle_after:.2f} s after the last answer; gateway RSS {rss_start:.0f} -> {rss_end:.0f} MB"
    )
