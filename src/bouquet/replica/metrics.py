"""The replica's Prometheus metrics, in a registry of its own so that several replicas can share a process."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_TOKEN_BUCKETS = tuple(float(2**i) for i in range(4, 17))  # 16 .. 65536
_SEQ_BUCKETS = tuple(float(2**i) for i in range(0, 11))  # 1 .. 1024
_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.queue_tokens = Gauge(
            "bouquet_queue_tokens", "Tokens waiting, not yet in a step (images' patches included)", registry=r
        )
        self.queue_seqs = Gauge("bouquet_queue_seqs", "Sequences waiting, not yet in a step", registry=r)
        self.steps_in_flight = Gauge("bouquet_steps_in_flight", "Steps submitted to the engine, not done", registry=r)
        self.batch_tokens = Histogram(
            "bouquet_batch_tokens", "Tokens per step (images' patches included)", buckets=_TOKEN_BUCKETS, registry=r
        )  # fmt: skip
        self.batch_seqs = Histogram("bouquet_batch_seqs", "Sequences per step", buckets=_SEQ_BUCKETS, registry=r)
        self.step_seconds = Histogram(
            "bouquet_step_seconds",
            "Engine time per step: from when it reached the engine's head to its result",
            buckets=_SECONDS_BUCKETS,
            registry=r,
        )
        self.request_seconds = Histogram(
            "bouquet_request_seconds", "Embed call latency, arrival to reply", buckets=_SECONDS_BUCKETS, registry=r
        )
        self.requests_in_progress = Gauge(
            "bouquet_requests_in_progress", "Calls received and not yet answered", registry=r
        )
        self.requests = Counter("bouquet_requests", "Embed calls by gRPC status", ["status"], registry=r)

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's current value (0 when never set), e.g. value("bouquet_batch_tokens_count")."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0

    def serve_http(self, port: int, addr: str, tls: TlsFiles | None = None) -> None:
        """Exposes /metrics for Prometheus on a daemon thread, on `addr` (the replica's own listen host, so a
        replica bound to loopback does not publish its metrics to the network); over HTTPS with the replica's own
        certificate when it serves gRPC over TLS (a scraper then trusts its CA), asking scrapers for a certificate
        its client CA signed when it has one."""
        if tls is None:
            start_http_server(port, addr=addr, registry=self.registry)
            return
        start_http_server(
            port, addr=addr, registry=self.registry, certfile=str(tls.cert), keyfile=str(tls.key),
            client_cafile=None if tls.client_ca is None else str(tls.client_ca),
            client_auth_required=tls.client_ca is not None,
        )  # fmt: skip


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    client_ca: Path | None = None
