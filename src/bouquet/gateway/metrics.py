"""The gateway's Prometheus metrics. Under `bouquet serve --workers N` each worker writes to the directory in
PROMETHEUS_MULTIPROC_DIR and /metrics sums them, so any worker answers for all."""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from bouquet.gateway.fetch_answer import REFUSALS as FETCH_REFUSALS

_LATENCY_BUCKETS = (0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "bouquet_gateway_requests", "HTTP requests by route and status", ["route", "status"], registry=r
        )
        self.request_seconds = Histogram(
            "bouquet_gateway_request_seconds",
            "HTTP request latency by route",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "bouquet_gateway_tokenize_seconds", "time to tokenize one request", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.queue_seconds = Histogram(
            "bouquet_gateway_queue_seconds",
            "time a chunk waits and computes at its replica (the replica's queue included)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("bouquet_gateway_tokens", "tokens embedded, by model", ["model"], registry=r)
        self.in_flight = Gauge(
            "bouquet_gateway_requests_in_flight",
            "HTTP requests being answered",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.tokens_in_flight = Gauge(
            "bouquet_gateway_tokens_in_flight",
            "tokens admitted and not yet answered",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.connections_open = Gauge(
            "bouquet_gateway_connections_open",
            "HTTP connections open and counted against --max-connections",
            registry=r,
            multiprocess_mode="livesum",
        )
        # reason: header_too_large, header_timeout, body_timeout, idle_timeout, invalid_http (not HTTP/1.1: a bad
        # request line, header or chunk), evicted (an idle one, to make room at the cap) or refused (503 at the cap,
        # every connection busy)
        self.connections_closed = Counter(
            "bouquet_gateway_connections_closed",
            "HTTP connections the gateway closed or refused, by reason",
            ["reason"],
            registry=r,
        )
        self.retries = Counter("bouquet_gateway_chunk_retries", "chunks retried on another replica", registry=r)
        self.ejections = Counter(
            "bouquet_gateway_replica_ejections",
            "times a replica was taken out of rotation for running past an attempt's deadline",
            ["replica"],
            registry=r,
        )
        self.replica_tokens = Counter(
            "bouquet_gateway_replica_tokens", "tokens a replica computed for this gateway", ["replica"], registry=r
        )
        self.dispatch_wait_seconds = Histogram(
            "bouquet_gateway_dispatch_wait_seconds",
            "time a chunk waits at the gateway for room at a replica",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.dns_failures = Counter(
            "bouquet_gateway_dns_failures", "failed lookups of a --replicas-dns name", ["name"], registry=r
        )
        self.dns_replicas = Gauge(
            "bouquet_gateway_dns_replicas",
            "addresses a --replicas-dns name resolved to last",
            ["name"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.refused = Counter(
            "bouquet_gateway_refused",
            "requests refused with 429 before any work, by reason",
            ["reason"],
            registry=r,
        )
        self.admission_tokens = Gauge(
            "bouquet_gateway_admission_limit_tokens",
            "tokens a gateway admits at once now, in each lane: the replicas' measured speed times the admission "
            "window",
            registry=r,
            multiprocess_mode="livesum",
        )
        # Demand as admission sees it, by model and lane (short: a batch or less; bulk: the rest). The replicas'
        # own queue stays short under overload, because admission holds the excess here and then refuses it: these
        # are what an autoscaler reads (docs/scaling.md). The model is "" where it is not known (a body refused
        # unread; a caller that does not name it).
        demand = ["model", "lane"]
        self.admission_waiting_tokens = Gauge(
            "bouquet_gateway_admission_waiting_tokens",
            "tokens of requests waiting for admission (estimated from their bytes as tokenizing has run)",
            demand,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.admission_admitted_tokens = Gauge(
            "bouquet_gateway_admission_admitted_tokens",
            "tokens of requests admitted and not yet answered (estimated until tokenized, then counted)",
            demand,
            registry=r,
            multiprocess_mode="livesum",
        )
        self.admission_refused_tokens = Counter(
            "bouquet_gateway_admission_refused_tokens",
            "tokens of requests refused (429) for want of room, estimated from their bytes",
            demand,
            registry=r,
        )
        self.admission_refused = Counter(
            "bouquet_gateway_admission_refused_requests",
            "requests refused (429) for want of room, after their wait or unread",
            demand,
            registry=r,
        )
        self.replica_healthy = Gauge(
            "bouquet_gateway_replica_healthy",
            "1 while a replica is healthy",
            ["replica"],
            registry=r,
            multiprocess_mode="livemax",
        )

        self.image_fetches = Counter("bouquet_gateway_image_fetches", "image URLs fetched", registry=r)
        self.image_fetch_bytes = Counter(
            "bouquet_gateway_image_fetch_bytes", "bytes of the image URLs' bodies fetched", registry=r
        )
        self.image_fetch_refusals = Counter(
            "bouquet_gateway_image_fetch_refusals", "image URLs refused or failed, by reason", ["reason"], registry=r
        )
        for reason in FETCH_REFUSALS:
            self.image_fetch_refusals.labels(reason)

    def exposition(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)
