"""Demand at admission (issue 27): the gateway's gauges of tokens waiting and admitted, and its counters of what it
refused, by model and lane, read from real Prometheus exposition text. Under overload the replica's own queue stays
at most one admitted request deep, because admission holds the excess at the gateway and then refuses it: the
gateway's demand gauges are what an autoscaler must read (docs/scaling.md), and this shows both sides at once."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import corpus
import in_process
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bouquet.engine.engine import Engine
from bouquet.gateway.admission import Admission
from bouquet.gateway.errors import Overloaded
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.replica.server import ReplicaServer

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _parsed(text: str) -> Samples:
    """Every sample of an exposition, keyed by name and sorted labels."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def _total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels` (as PromQL's sum would)."""
    wanted = set(labels.items())
    return sum(value for (sample, keys), value in samples.items() if sample == name and wanted <= set(keys))


def _exposition(metrics: GatewayMetrics) -> Samples:
    return _parsed(generate_latest(metrics.registry).decode())


# --- the admission alone ------------------------------------------------------------------------------------------


def test_waiting_admitted_and_refused_tokens_by_model_and_lane() -> None:
    """One request holds the bulk lane's cap, a second waits (its tokens in the waiting gauge, labelled with its
    model) and is refused when its wait runs out (its tokens and itself counted); every gauge is back at 0 after."""
    metrics = GatewayMetrics()
    admission = Admission(metrics, 100, 2.0, 0.3, 16, lambda: None, lambda: 100)
    seen: list[Samples] = []

    async def scenario() -> None:
        async with admission.admit(500, short_tokens=10, model="minilm", exact=True):
            waiter = asyncio.ensure_future(_admit(admission, 80, "minilm"))
            await asyncio.sleep(0.05)  # the waiter is in line: the bulk lane holds 500, over the cap of 100
            seen.append(_exposition(metrics))
            with pytest.raises(Overloaded):
                await waiter
            seen.append(_exposition(metrics))

    asyncio.run(scenario())
    waiting, refused = seen
    bulk = {"model": "minilm", "lane": "bulk"}
    assert _total(waiting, "bouquet_gateway_admission_waiting_tokens", **bulk) == 80
    assert _total(waiting, "bouquet_gateway_admission_admitted_tokens", **bulk) == 500
    assert _total(waiting, "bouquet_gateway_admission_limit_tokens") == 100
    assert _total(refused, "bouquet_gateway_admission_waiting_tokens") == 0
    assert _total(refused, "bouquet_gateway_admission_refused_tokens_total", **bulk) == 80
    assert _total(refused, "bouquet_gateway_admission_refused_requests_total", **bulk) == 1
    assert _total(refused, "bouquet_gateway_refused_total", reason="tokens") == 1  # the reason count is kept
    after = _exposition(metrics)
    for gauge in ("bouquet_gateway_admission_waiting_tokens", "bouquet_gateway_admission_admitted_tokens"):
        assert _total(after, gauge) == 0, gauge


async def _admit(admission: Admission, tokens: int, model: str) -> None:
    async with admission.admit(tokens, short_tokens=10, model=model, exact=True):
        pass


def test_a_short_request_counts_in_its_own_lane() -> None:
    metrics = GatewayMetrics()
    admission = Admission(metrics, 100, 2.0, 0.3, 16, lambda: None, lambda: 100)

    async def scenario() -> Samples:
        async with admission.admit(8, short_tokens=10, model="minilm", exact=True):
            return _exposition(metrics)

    held = asyncio.run(scenario())
    assert _total(held, "bouquet_gateway_admission_admitted_tokens", model="minilm", lane="short") == 8
    assert _total(held, "bouquet_gateway_admission_admitted_tokens", lane="bulk") == 0


# --- overload against the real gateway and replica ----------------------------------------------------------------

TEXTS = 48  # about 6,000 tokens: far over the cap below, so one such request is admitted at a time
CLIENTS = 6
MAX_SECONDS = 120.0  # a guard against a hang, not a bound under test


class _Replicas(ReplicaServer):
    """The replica servers in_process.served starts, kept so that the test can read their metrics."""

    started: ClassVar[list[ReplicaServer]] = []

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        _Replicas.started.append(self)


@contextmanager
def _served(engine: Engine, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, ReplicaServer]]:
    monkeypatch.setattr(_Replicas, "started", [])
    monkeypatch.setattr(in_process, "ReplicaServer", _Replicas)
    options = {"model_dirs": (model_dir,), "max_inflight_tokens": 1000, "admission_wait": 0.5}
    with in_process.served([engine], listen=True, **options) as running:
        [replica] = _Replicas.started
        yield running.url, replica


def _post(url: str, body: bytes) -> int:
    request = urllib.request.Request(f"{url}/v1/embeddings", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            reply.read()
            return reply.status
    except urllib.error.HTTPError as error:
        error.read()
        return error.code


def _gateway_samples(url: str) -> Samples:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as reply:
        return _parsed(reply.read().decode())


@dataclass
class _Watch:
    """What a scraper saw, sample by sample: the gateway's demand and the replica's queue."""

    body_tokens: float
    peak_waiting: float = 0.0
    peak_demand_over_limit: float = 0.0
    peak_replica_queue: float = 0.0
    peak_waiting_by_model: dict[str, float] = field(default_factory=dict)
    refused_tokens: float = 0.0
    statuses: list[int] = field(default_factory=list)

    def seen_enough(self) -> bool:
        return self.peak_waiting > self.body_tokens and self.refused_tokens > 0

    def scrape(self, url: str, replica: ReplicaServer) -> None:
        gateway = _gateway_samples(url)
        queue = _parsed(generate_latest(replica.metrics.registry).decode())
        waiting = _total(gateway, "bouquet_gateway_admission_waiting_tokens")
        admitted = _total(gateway, "bouquet_gateway_admission_admitted_tokens")
        limit = _total(gateway, "bouquet_gateway_admission_limit_tokens")
        self.peak_waiting = max(self.peak_waiting, waiting)
        for (sample, labels), value in gateway.items():
            model = dict(labels).get("model")
            if sample == "bouquet_gateway_admission_waiting_tokens" and model is not None:
                self.peak_waiting_by_model[model] = max(self.peak_waiting_by_model.get(model, 0.0), value)
        self.peak_demand_over_limit = max(self.peak_demand_over_limit, (waiting + admitted) / max(limit, 1))
        self.peak_replica_queue = max(self.peak_replica_queue, _total(queue, "bouquet_queue_tokens"))
        self.refused_tokens = _total(gateway, "bouquet_gateway_admission_refused_tokens_total")


def test_overload_raises_the_demand_gauges_not_the_replica_queue(
    minilm_path: Path, minilm_fp32: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients send ~6,000-token requests back to back against a cap of 1,000 tokens, while a scraper reads the
    gateway's /metrics and the replica's exposition, until the waiting tokens have passed one request's tokens and
    refusals have been counted. The replica's queue meanwhile never held more than one request's tokens: the
    demand was visible only at the gateway. Afterwards the demand gauges are back at 0."""
    body = json.dumps({"input": corpus.documents(TEXTS)}).encode()
    with _served(minilm_fp32, minilm_path, monkeypatch) as (url, replica):
        assert _post(url, body) == 200  # alone: its real token count, from the gateway's own counter
        watch = _Watch(_total(_gateway_samples(url), "bouquet_gateway_tokens_total"))
        stop = threading.Event()

        def client() -> None:
            while not stop.is_set():
                watch.statuses.append(_post(url, body))

        clients = [threading.Thread(target=client, daemon=True) for _ in range(CLIENTS)]
        for thread in clients:
            thread.start()
        guard = threading.Timer(MAX_SECONDS, stop.set)
        guard.start()
        try:
            while not stop.is_set() and not watch.seen_enough():
                watch.scrape(url, replica)
        finally:
            stop.set()
            guard.cancel()
            for thread in clients:
                thread.join(timeout=120)
        after = _gateway_samples(url)

    assert watch.seen_enough(), f"overload never showed at the gateway: {watch}"
    assert set(watch.statuses) <= {200, 429} and 429 in watch.statuses, watch.statuses
    assert watch.peak_demand_over_limit > 1, "waiting and admitted tokens passed the admission limit"
    assert watch.peak_replica_queue <= watch.body_tokens, "the replica queued no more than one admitted request"
    assert watch.peak_waiting_by_model.get("all-MiniLM-L6-v2", 0) > watch.body_tokens, watch.peak_waiting_by_model
    for gauge in ("bouquet_gateway_admission_waiting_tokens", "bouquet_gateway_admission_admitted_tokens"):
        assert _total(after, gauge) == 0, gauge
