"""Admission control, decided before a request costs anything: a cap on requests being answered (TEI's
`max_concurrent_requests`), and a cap on tokens in flight that follows what the replicas can compute.

The token cap is the replicas' measured speed times `admission_seconds` (within a floor of some batches per
replica and the `max_inflight_tokens` ceiling): what is admitted is computed within about that long, so an
admitted request is answered in seconds. A request over the cap waits, first come first served, up to
`admission_wait` seconds for room (a burst of a few clients is served, not refused) and is then told to come
back (429, Retry-After). It is admitted on an upper bound of its tokens taken before tokenizing (its UTF-8
bytes, or the model's limit when it will be truncated) and holds its real count once tokenized. Short requests
(one batch or less: queries) have a budget and a line of their own, so a flood of bulk documents never turns a
query away; the pool also sends their chunks first.

A request waits only as long as its answer can still come within about `admission_wait + admission_seconds`:
one that alone takes longer than the window waits that much less (its time is its tokens over the measured speed,
the tokens estimated from its bytes as the requests tokenized so far ran), down to a quarter of the wait for one
that alone takes longer than both: it is answered later than that bound, but a steady flow of smaller requests
cannot keep it out for good (at the head of the line it holds them back while it waits). Without this a
256-text request that takes 3.5 s alone waited 2 s for its turn and was answered after 5.5 s or more.

A large body is refused before it is read when the bulk requests in flight alone will not be computed down to
the cap within its wait (`refuse_unread`): parsing and estimating a refused 256-text body cost the gateway about
2.5 ms, and clients that retry at once (400 a second) took a whole core from the replicas with it.

Demand is published as it is met (metrics.py, by model and lane): tokens waiting, tokens admitted, and tokens and
requests refused. Under overload the replicas' queues stay short, since the excess waits and is refused here, so
these, not the replicas' queues, say how many more replicas would be used (docs/scaling.md)."""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from dataclasses import dataclass

from bouquet.gateway.errors import Overloaded
from bouquet.gateway.metrics import GatewayMetrics

_RECHECK_S = 0.05
_LEAST_WAIT_SHARE = 0.25  # of admission_wait, for a request that alone takes longer than wait and window
# Bodies smaller than this are parsed before they are refused: it costs little, and a body's size says little
# of its tokens (a query's one long text is truncated to the model's limit).
_REFUSE_UNREAD_BYTES = 64 * 1024
_LANES = {False: "bulk", True: "short"}  # the metrics' lane label


@dataclass
class Ticket:
    """Tokens a request holds while it is answered; `resize` once the real count is known."""

    tokens: int
    short: bool
    _admission: Admission
    exact: bool = False  # counted from token ids, not estimated from bytes
    model: str = ""  # the metrics' label

    def resize(self, tokens: int) -> None:
        self._admission.move(self, tokens - self.tokens)
        self.tokens = tokens

    def tokenized(self, tokens: int) -> None:
        """Holds the real count instead of the estimate, which teaches the admission how its estimates run."""
        if not self.exact:
            self._admission.learn(self.tokens, tokens)
        self.resize(tokens)


class Admission:
    def __init__(
        self,
        metrics: GatewayMetrics,
        max_inflight_tokens: int,
        admission_seconds: float,
        admission_wait: float,
        max_concurrent_requests: int,
        tokens_per_second: Callable[[], float | None],
        floor_tokens: Callable[[], int],
        retry_after_s: int = 1,
    ):
        self.max_inflight_tokens = max_inflight_tokens
        self.admission_seconds = admission_seconds
        self.admission_wait = admission_wait
        self.max_concurrent_requests = max_concurrent_requests
        self._tokens_per_second = tokens_per_second
        self._floor_tokens = floor_tokens
        self.inflight = {False: 0, True: 0}  # tokens held by bulk and by short requests
        self._lines: dict[bool, collections.deque[asyncio.Event]] = {
            False: collections.deque(),
            True: collections.deque(),
        }
        self.tokens_per_estimate = 1.0  # real tokens over the bytes-based estimate, averaged: about 1/4 for prose
        self.requests = 0
        self.answered = 0  # requests answered (or refused after entering), ever
        self._metrics = metrics
        self._retry_after = str(retry_after_s)

    def limit(self) -> int:
        """Tokens admitted at once, per lane: what the replicas compute in `admission_seconds`."""
        floor = min(self.max_inflight_tokens, self._floor_tokens())
        rate = self._tokens_per_second()
        tokens = floor if rate is None else int(rate * self.admission_seconds)
        limit = max(floor, min(self.max_inflight_tokens, tokens))
        self._metrics.admission_tokens.set(limit)
        return limit

    @contextmanager
    def request(self) -> Iterator[None]:
        """One request being answered, refused at once over `max_concurrent_requests`."""
        if self.requests >= self.max_concurrent_requests:
            self._refuse(f"the server is answering {self.requests} requests, its limit", "concurrent_requests")
        self.requests += 1
        try:
            yield
        finally:
            self.requests -= 1
            self.answered += 1

    @asynccontextmanager
    async def admit(
        self, tokens: int, short_tokens: int, exact: bool = False, model: str = ""
    ) -> AsyncIterator[Ticket]:
        """Holds about `tokens` (an upper bound from bytes, or `exact`) until the block ends. A request alone in
        its lane is always admitted (the per-request limits bound it). `model` labels its demand in the metrics."""
        short = tokens <= short_tokens
        own = tokens if exact else tokens * self.tokens_per_estimate
        await self._wait_for_room(tokens, short, own, model)
        ticket = Ticket(0, short, self, exact, model)
        ticket.resize(tokens)
        try:
            yield ticket
        finally:
            ticket.resize(0)

    async def refuse_unread(self, body_bytes: int) -> None:
        """Refuses (429) a body of `body_bytes` (64 KiB or more) before it is read or parsed when the bulk requests
        in flight alone leave more than the replicas compute within the longest wait: it would be refused after
        waiting, whatever it holds (the requests waiting ahead, which may leave, and its own tokens, not known yet,
        are not counted). It is refused after the wait its bytes would be allowed, as if it had waited, so that a
        client retrying at once comes back no sooner."""
        rate = self._tokens_per_second()
        if body_bytes < _REFUSE_UNREAD_BYTES or not rate:
            return
        if self.inflight[False] - self.limit() > rate * self.admission_wait:
            own = body_bytes * self.tokens_per_estimate
            await asyncio.sleep(self._wait_allowed(own))
            self._refuse_demand("", False, round(own))  # the model is in the body, which is never read
            self._refuse(f"the server is at capacity ({self.inflight[False]} tokens in flight)", "tokens")

    def _wait_allowed(self, tokens: float) -> float:
        """`admission_wait`, less the time the request's own compute runs past the admission window; at least a
        quarter of it."""
        rate = self._tokens_per_second()
        if not rate:
            return self.admission_wait
        overrun = max(0.0, tokens / rate - self.admission_seconds)
        return max(_LEAST_WAIT_SHARE * self.admission_wait, self.admission_wait - overrun)

    def learn(self, estimate: int, tokens: int) -> None:
        if estimate > 0:
            self.tokens_per_estimate += 0.1 * (min(1.0, tokens / estimate) - self.tokens_per_estimate)

    async def _wait_for_room(self, tokens: int, short: bool, own: float, model: str) -> None:
        line = self._lines[short]
        if self._fits(tokens, short) and not line:
            return  # the common case: no line, room now
        turn = asyncio.Event()
        line.append(turn)
        deadline = time.monotonic() + self._wait_allowed(own)
        waiting = self._metrics.admission_waiting_tokens.labels(model, _LANES[short])
        shown = round(own)  # whole tokens: floats added and taken away in another order would not come back to 0
        waiting.inc(shown)
        try:
            while not (line[0] is turn and self._fits(tokens, short)):
                left = deadline - time.monotonic()
                if left <= 0:
                    limit, held = self.limit(), self.inflight[short]
                    self._refuse_demand(model, short, shown)
                    self._refuse(f"the server is at capacity ({held} tokens in flight, {limit} at once)", "tokens")
                # The first in line also looks again on its own: the cap moves with the measured speed.
                await _wait(turn, min(_RECHECK_S, left) if line[0] is turn else left)
        finally:
            waiting.dec(shown)
            line.remove(turn)
            if line:
                line[0].set()

    def _fits(self, tokens: int, short: bool) -> bool:
        held = self.inflight[short]
        return held == 0 or held + tokens <= self.limit()

    def move(self, ticket: Ticket, tokens: int) -> None:
        self.inflight[ticket.short] += tokens
        self._metrics.tokens_in_flight.inc(tokens)
        self._metrics.admission_admitted_tokens.labels(ticket.model, _LANES[ticket.short]).inc(tokens)
        line = self._lines[ticket.short]
        if tokens < 0 and line:
            line[0].set()

    def _refuse_demand(self, model: str, short: bool, tokens: int) -> None:
        self._metrics.admission_refused_tokens.labels(model, _LANES[short]).inc(tokens)
        self._metrics.admission_refused.labels(model, _LANES[short]).inc()

    def _refuse(self, message: str, reason: str) -> None:
        self._metrics.refused.labels(reason).inc()
        raise Overloaded(f"{message}; retry shortly", "overloaded", headers={"Retry-After": self._retry_after})


async def _wait(event: asyncio.Event, seconds: float) -> None:
    event.clear()
    with suppress(TimeoutError):
        await asyncio.wait_for(event.wait(), seconds)
