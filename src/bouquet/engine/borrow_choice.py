"""Whether a lone short step should borrow every thread, decided from lone steps' own recent times.

Borrowing (engine/cpu_threads.py) makes a lone query ~1.3x faster on an idle machine, but a forward is hundreds
of OpenMP parallel regions, each ending at a barrier that waits for every thread of the team. When another
process holds one of the cores, the borrowed thread runs only in the slices the kernel gives it there, and
every region waits for it: a lone query or image then took ten times longer than on its worker's own thread
(docs/benchmarks.md, "A lone step under a co-tenant"). Nothing in /proc says that in advance (the load average
lags by seconds and counts our own threads), so the lead times what it does: lone steps that borrowed and lone
steps that did not, per size class, and borrows while borrowing is the faster of the two.

- Borrowing is tried first, as it wins on an idle machine; the second lone step of a class runs on the lead's own
  thread, and every `refresh_every`-th after it, so that the other estimate stays current (on an idle machine this
  costs a fraction of a millisecond a step on average).
- Each estimate is the median of its way's last few steps, so that one step that met a page fault or a collection
  decides nothing; an estimate not updated for `stale_after` seconds is replaced by the next sample.
- Borrowing stops once its steps take 10% longer than the own thread's. It is then retried after `first_backoff`
  seconds, doubling up to `max_backoff` while it keeps losing (and never sooner than 50 times what a retry is
  expected to lose), so a machine that stays busy pays one slow step a minute at most. A retry's step replaces
  the borrowed estimate (the machine it measured may be gone) and brings borrowing back if it beats the own thread.

Only steps that ran alone from start to end are recorded (the caller says so): a step that met another one
shared the cores and says nothing about borrowing. One thread (the lead worker) calls this object.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# A retry is spaced at least this many times what it is expected to lose, so retries cost at most ~2% of the time
# (a lone CLIP image that borrows beside a co-tenant loses seconds, not milliseconds).
_RETRY_SPACING = 50
_MARGIN = 1.1  # borrowing stops once its steps take this much longer than the lead's own thread's
_WINDOW = 5  # samples an estimate keeps: its median shrugs off a step that met a page fault or a collection


@dataclass
class _Estimate:
    samples: deque[float] = field(default_factory=lambda: deque(maxlen=_WINDOW))
    updated: float = -float("inf")  # clock time of the last sample; -inf: never sampled

    def add(self, seconds: float, now: float, stale_after: float, replace: bool) -> None:
        if replace or now - self.updated > stale_after:
            self.samples.clear()
        self.samples.append(seconds)
        self.updated = now

    @property
    def seconds(self) -> float:
        return statistics.median(self.samples)

    @property
    def known(self) -> bool:
        return bool(self.samples)


@dataclass
class _SizeClass:
    borrowed: _Estimate
    own: _Estimate
    borrowing: bool = True
    lone_steps: int = 0  # lone steps decided while borrowing wins, for the periodic own-thread refresh
    retry_at: float = 0.0  # clock time from which a class that stopped borrowing tries it again
    backoff: float = 0.0  # seconds to the next retry once borrowing loses again
    held: int = 0  # borrowed lone steps since borrowing (re)started without losing


class BorrowChoice:
    def __init__(
        self,
        refresh_every: int = 32,
        first_backoff: float = 1.0,
        max_backoff: float = 60.0,
        stale_after: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refresh_every = refresh_every
        self.first_backoff = first_backoff
        self.max_backoff = max_backoff
        self.stale_after = stale_after
        self._clock = clock
        self._classes: dict[int, _SizeClass] = {}

    def should_borrow(self, num_tokens: int) -> bool:
        """For a lone step of `num_tokens` about to start on the lead."""
        size = self._class(num_tokens)
        if not size.borrowing:
            return self._clock() >= size.retry_at  # the retry: one borrowed step, then `record` decides
        size.lone_steps += 1
        if not size.own.known:  # the first lone step borrows, the second measures the alternative
            return size.lone_steps % 2 != 0
        return size.lone_steps % self.refresh_every != 0

    def record(self, num_tokens: int, borrowed: bool, seconds: float) -> None:
        """A lone step's wall time, borrowed or on the lead's own threads, that ran alone from start to end."""
        now = self._clock()
        size = self._class(num_tokens)
        retry = borrowed and not size.borrowing
        (size.borrowed if borrowed else size.own).add(seconds, now, self.stale_after, replace=retry)
        if not (size.borrowed.known and size.own.known):
            return
        if retry:
            if size.borrowed.seconds <= size.own.seconds:
                size.borrowing, size.lone_steps, size.held = True, 0, 0
                bound = size_class(num_tokens)
                logger.info("lone steps of <= %d tokens borrow every thread again: %s", bound, _vs(size))
            else:
                self._back_off(size, now)
        elif size.borrowing and size.borrowed.seconds > _MARGIN * size.own.seconds:
            self._back_off(size, now)
            size.borrowing = False
            logger.info(
                "lone steps of <= %d tokens stop borrowing threads (another process holds a core?): %s; retried in "
                "%.0f s", size_class(num_tokens), _vs(size), size.backoff,
            )  # fmt: skip
        elif size.borrowing and borrowed:
            size.held += 1
            if size.held >= self.refresh_every:  # borrowing has held a while: the next loss starts a new backoff
                size.backoff = 0.0

    def _back_off(self, size: _SizeClass, now: float) -> None:
        loss = size.borrowed.seconds - size.own.seconds  # what the next retry is expected to cost
        size.backoff = min(self.max_backoff, max(self.first_backoff, 2 * size.backoff, _RETRY_SPACING * loss))
        size.retry_at = now + size.backoff

    def measured(self, num_tokens: int) -> bool:
        """Whether lone steps of this size have been timed both ways."""
        size = self._class(num_tokens)
        return size.borrowed.known and size.own.known

    def borrowing(self, num_tokens: int) -> bool:
        """Whether lone steps of this size currently borrow (retries aside)."""
        return self._class(num_tokens).borrowing

    def _class(self, num_tokens: int) -> _SizeClass:
        key = size_class(num_tokens)
        size = self._classes.get(key)
        if size is None:
            size = self._classes[key] = _SizeClass(_Estimate(), _Estimate())
        return size


def size_class(num_tokens: int) -> int:
    """The size class: the power of two at or above the step's tokens (16 at least)."""
    return max(16, 1 << (max(num_tokens, 1) - 1).bit_length())


def _vs(size: _SizeClass) -> str:
    return f"{size.borrowed.seconds * 1e3:.1f} ms borrowed against {size.own.seconds * 1e3:.1f} ms on its own thread"
