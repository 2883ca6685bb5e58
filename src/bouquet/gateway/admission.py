"""Admission control: a cap on tokens in flight per gateway process; over it, 429 with Retry-After."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from bouquet.gateway.errors import Overloaded
from bouquet.gateway.metrics import GatewayMetrics


class Admission:
    def __init__(self, max_inflight_tokens: int, metrics: GatewayMetrics, retry_after_s: int = 1):
        self.max_inflight_tokens = max_inflight_tokens
        self.inflight_tokens = 0
        self._metrics = metrics
        self._retry_after = str(retry_after_s)

    @contextmanager
    def admit(self, tokens: int) -> Iterator[None]:
        """Holds `tokens` until the block ends; a request alone is always admitted (the per-request limit
        bounds it), so an oversized one cannot starve."""
        if self.inflight_tokens and self.inflight_tokens + tokens > self.max_inflight_tokens:
            raise Overloaded(
                f"the server is at capacity ({self.inflight_tokens} tokens in flight); retry shortly",
                "overloaded",
                headers={"Retry-After": self._retry_after},
            )
        self.inflight_tokens += tokens
        self._metrics.tokens_in_flight.inc(tokens)
        try:
            yield
        finally:
            self.inflight_tokens -= tokens
            self._metrics.tokens_in_flight.dec(tokens)
