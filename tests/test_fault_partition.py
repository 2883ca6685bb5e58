"""Replicas on hosts of their own (network namespaces on a bridge, tests/netns.py) behind a gateway on another.
Under 8 concurrent clients, a replica host whose link is cut for 20 s costs no request, no request waits more than
3 s, and the host takes traffic again once its link is back. With 200 ms added to what one host sends, least
outstanding tokens gives it clearly less of a light load than the other: a chunk holds its tokens there 200 ms
longer, so it gets a share of about W / (W + 0.2) of the other's, W the time a chunk takes. (Under a saturating
load, W about a second here, both replicas stay busy and the delay moves little: that keeps the throughput.)
Marked `fault`: each case takes well under a minute and a half. Skipped where network namespaces cannot be made
(not root, no iproute2)."""

from __future__ import annotations

import collections
import re
import statistics
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

import corpus
import pytest
from netns import Cluster, Host, netns_available
from test_gateway_replicas import embed, healthy_replicas, wait_for

from bouquet.gateway.testing import Process, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.long, pytest.mark.process]
REPLICA_PORT = 50051  # every host is a fresh namespace: fixed ports are free
METRICS_PORT = 9100
GATEWAY_PORT = 8000
CLIENTS = 8
CUT_SECONDS = 20
# A request caught by the cut waits for the keepalive (1-2 s), then its chunk runs elsewhere at its first place in
# line (gateway/replicas/pool.py): 2.1-2.3 s here; 2.1-4.1 s before retries kept their place. On a machine whose
# cores are busy a request's own time grows, and with one host cut the other's queue doubles it again, so the bound
# is the larger of this and 2 s plus twice the run's median request (tests/test_fault_hung_replica.py's too): a move
# costs at most about one more request's time. Measured 2026-12-04 (2-core Xeon VM, other jobs beside): without a
# busy loop the requests caught took at most 1.7-2.0 s here and 2.3 s in the hung-replica test; with one busy loop
# per core and other jobs beside (load 6-10), at most 5.1 s and 5.3 s (3 s exceeded by up to 2.3 s), while the
# relative bound (5.4-9.1 s) held in every run that lost no request.
MAX_LATENCY = 3.0
WARM_SECONDS = 5  # the load first reaches its steady state: a cold replica's first requests are slower
DELAY_MS = 200
TEXTS = corpus.documents(6)  # several chunks a request: 8 clients saturate the replicas (p50 about 1 s, 2 cores)
QUERIES = corpus.queries(2)  # one small chunk a request, computed in milliseconds
LIGHT_CLIENTS = 4  # with QUERIES, a load the replicas keep up with (p50 about 0.1 s)


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    available, reason = netns_available()
    if not available:
        pytest.skip(reason)
    with Cluster(["gw", "r1", "r2"]) as cluster:
        yield cluster


class Load:
    """`clients` threads posting `texts` to the gateway in a loop; each request's (start, latency, status) kept."""

    def __init__(self, url: str, texts: list[str] = TEXTS, clients: int = CLIENTS):
        self.url = url
        self.texts = texts
        self.results: list[tuple[float, float, int]] = []
        self.errors: collections.Counter[str] = collections.Counter()  # each failure's status and message
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client) for _ in range(clients)]

    def _client(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            status, body = embed(self.url, self.texts)
            self.results.append((started, time.monotonic() - started, status))
            if status != 200:
                self.errors[f"{status} {body.get('error', body)}"[:160]] += 1

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def latencies(self) -> list[float]:
        return sorted(latency for _, latency, _ in self.results)

    def failures(self) -> list[int]:
        return [status for _, _, status in self.results if status != 200]

    def slowest(self, fault_at: float) -> list[str]:
        """The five slowest requests, and when each began against the fault."""
        slowest = sorted(self.results, key=lambda result: result[1])[-5:]
        return [f"{latency:.2f} s from fault{started - fault_at:+.2f} s" for started, latency, _ in slowest]

    def summary(self) -> str:
        latencies = self.latencies()
        p50, p99 = (latencies[min(len(latencies) - 1, int(q * len(latencies)))] for q in (0.5, 0.99))
        return (
            f"{len(latencies)} requests, {len(self.failures())} failed, latency p50 {p50:.2f} s, p99 {p99:.2f} s, "
            f"max {latencies[-1]:.2f} s" + (f" ({dict(self.errors)})" if self.errors else "")
        )


def _worst(results: list[tuple[float, float, int]]) -> str:
    latencies = sorted(latency for _, latency, _ in results)
    if not latencies:
        return "0"
    return f"{len(latencies)}, p50 {statistics.median(latencies):.2f} s, max {latencies[-1]:.2f} s"


def phases(load: Load, fault_at: float, ended_at: float, fault: str) -> str:
    """The requests' latencies by when they ran against the fault (from `fault_at` to `ended_at`)."""
    steady = [result for result in load.results if result[0] + result[1] < fault_at]
    caught = [result for result in load.results if result[0] < fault_at < result[0] + result[1]]
    during = [result for result in load.results if fault_at < result[0] < ended_at]
    after = [result for result in load.results if result[0] > ended_at]
    return (
        f"before the {fault} {_worst(steady)}; in flight at it {_worst(caught)}; started during it "
        f"{_worst(during)}; after it {_worst(after)}"
    )


def latency_bound(load: Load) -> tuple[float, str]:
    """The most a request may wait with one of two replicas lost, and how it was reached from the run itself."""
    typical = statistics.median(load.latencies())
    return max(MAX_LATENCY, 2.0 + 2 * typical), f"max({MAX_LATENCY:.0f} s, 2 s + 2 x the run's median {typical:.2f} s)"


def scrape(address: str, name: str, labels: str = "") -> float:
    """One sample of a Prometheus exposition at http://address/metrics (0 when absent)."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    pattern = rf"^{re.escape(name)}{re.escape('{' + labels + '}') if labels else ''} (\S+)$"
    found = re.search(pattern, text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


@contextmanager
def deployment(cluster: Cluster, replicas: list[str]) -> Iterator[tuple[str, Process]]:
    """A replica on r1 and one on r2 (their /metrics on METRICS_PORT), a gateway on gw given `replicas` as their
    addresses; yields the gateway's URL as the test process reaches it (a forward to gw), and the gateway."""
    processes: list[Process] = []
    try:
        for name in ("r1", "r2"):
            host = cluster[name]
            args = ("--dtype", "float32", "--max-batch-tokens", "512", "--metrics-port", str(METRICS_PORT))
            processes.append(start_replica(REPLICA_PORT, *args, host=host.address, prefix=host.prefix))
        gw = cluster["gw"]
        gateway_args = ("--host", gw.address, "--chunk-tokens", "128")
        processes.append(start_gateway(GATEWAY_PORT, replicas, *gateway_args, prefix=gw.prefix))
        for process in processes:
            process.wait_ready()
        url = f"http://{gw.forward(GATEWAY_PORT)}"
        wait_healthy(url)
        wait_for(lambda: healthy_replicas(url) == 2)
        yield url, processes[-1]
    finally:
        for process in reversed(processes):
            process.stop()


def served(host: Host, metrics: dict[str, str]) -> float:
    """Embed calls the replica on `host` answered OK, from its own /metrics."""
    return scrape(metrics[host.name], "bouquet_requests_total", 'status="OK"')


def marked_down(gateway: Process, address: str) -> str:
    """How often the gateway marked `address` down (a replica that stays up is, when it misses a keepalive ping) and
    ejected it (an attempt that ran past its deadline: a slow step on a loaded host)."""
    down = sum(f"replica {address} is down" in line for line in gateway.lines)
    ejected = sum(f"replica {address} ran past" in line for line in gateway.lines)
    return f"marked down {down} times, ejected {ejected} times"


def logged_down(gateway: Process, address: str, after: float) -> float:
    """Wall time of the gateway's first warning about `address` after `after` (its log's timestamps)."""
    for line in gateway.lines:
        found = re.match(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) WARNING .*replica " + re.escape(address), line)
        if found:
            logged = time.mktime(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S")) + int(found.group(2)) / 1000
            if logged >= after - 0.001:
                return logged
    return float("nan")


def test_a_partitioned_replica_host_costs_no_request_and_rejoins(cluster: Cluster):
    r1, r2 = cluster["r1"], cluster["r2"]
    address = r1.addr(REPLICA_PORT)
    with deployment(cluster, [address, r2.addr(REPLICA_PORT)]) as (url, gateway):
        metrics = {host.name: host.forward(METRICS_PORT) for host in (r1, r2)}  # read inside the host: no link
        with Load(url) as load:
            time.sleep(WARM_SECONDS)
            served_at_cut = served(r1, metrics)
            cut_at, cut_wall = time.monotonic(), time.time()
            r1.cut()
            wait_for(lambda: healthy_replicas(url) == 1, timeout=CUT_SECONDS)
            time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))
            orphaned = served(r1, metrics) - served_at_cut  # computed after the cut, their answers lost
            restored_at = time.monotonic()
            r1.restore()
            wait_for(lambda: healthy_replicas(url) == 2, timeout=30)  # it rejoins once its link is back
            rejoined = time.monotonic() - restored_at
            before = served(r1, metrics)
            wait_for(lambda: served(r1, metrics) > before + 5, timeout=15)  # and is given work again
            gateway_metrics = url.removeprefix("http://")
            assert scrape(gateway_metrics, "bouquet_gateway_replica_healthy", f'replica="{address}"') == 1
            time.sleep(1)
    detected = logged_down(gateway, address, cut_wall) - cut_wall
    bound, how = latency_bound(load)
    print(
        f"partition: {load.summary()}. The gateway logged the cut after {detected:.2f} s (r1 answered "
        f"{orphaned:.0f} calls after it, lost), saw the host back {rejoined:.2f} s after the restore. Requests: "
        f"{phases(load, cut_at, restored_at, 'cut')}; bound {bound:.2f} s ({how}); r2 "
        f"{marked_down(gateway, r2.addr(REPLICA_PORT))}"
    )
    # Enough traffic to mean something on a slow machine too: most clients caught by the cut, more started during it.
    caught = [result for result in load.results if result[0] < cut_at < result[0] + result[1]]
    during = [result for result in load.results if cut_at < result[0] < restored_at]
    assert load.failures() == [] and len(caught) >= CLIENTS // 2 and len(during) > CLIENTS, load.summary()
    assert load.latencies()[-1] <= bound < CUT_SECONDS, load.slowest(cut_at)


def test_a_slow_replica_host_gets_less_work(cluster: Cluster):
    r1, r2 = cluster["r1"], cluster["r2"]
    # Both behind endpoint() (a proxy each where there is no netem), so the only difference is the delay; the
    # delayed replica first, so that ties (equal outstanding tokens) go to it rather than away from it.
    with deployment(cluster, [r1.endpoint(REPLICA_PORT), r2.endpoint(REPLICA_PORT)]) as (url, _):
        metrics = {host.name: host.forward(METRICS_PORT) for host in (r1, r2)}

        def window(seconds: float) -> tuple[float, float]:
            start = (served(r1, metrics), served(r2, metrics))
            time.sleep(seconds)
            return served(r1, metrics) - start[0], served(r2, metrics) - start[1]

        with Load(url, QUERIES, clients=LIGHT_CLIENTS) as load:
            time.sleep(2)
            even = window(6)
            r1.delay(DELAY_MS)
            time.sleep(1)
            delayed = window(10)
            r1.delay(0)
    print(
        f"{DELAY_MS} ms on r1 ({'netem' if cluster.netem else 'proxy'}): {load.summary()}; Embed calls r1/r2 "
        f"without the delay {even[0]:.0f}/{even[1]:.0f}, with it {delayed[0]:.0f}/{delayed[1]:.0f}"
    )
    assert load.failures() == []
    assert delayed[1] > 20 and delayed[0] < delayed[1] / 2, (even, delayed)
