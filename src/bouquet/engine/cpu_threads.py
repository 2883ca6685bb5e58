"""OpenMP threads on the CPU: where the engine's may start, and a lone short step borrowing the idle cores.

GNU OpenMP (the runtime in torch's wheels) keeps, for every thread that ever ran a parallel region on n
threads, a pool of n - 1 helper threads, freed only when that thread exits. While it manages more threads
than there are cores it stops spin-waiting between regions and puts helpers to sleep instead, and a
forward runs hundreds of regions: on 2 cores a 15-token float32 forward on two threads went from 4.6-4.7 ms
to 9-10 ms once a second thread's two-thread team existed (docs/benchmarks.md, "OpenMP teams"). Hence:

- the engine does its own multi-threaded work (loading, prepacking) on a thread that then exits
  (`on_passing_thread`), so the caller's thread holds no pool;
- each engine worker keeps its share of the threads; with one thread each they hold no pool at all;
- then exactly one worker, the lead, may widen its team to every core: a step of at most `max_tokens`
  tokens that runs alone takes all the threads (a lone query runs on both cores instead of one: 4.6 against
  6.5 ms above), and at each layer checks again, going back to one thread as soon as another step has
  started, so the cores are oversubscribed for at most one short layer. Longer steps never borrow: one of
  their layers would hold the extra core for tens of milliseconds;
- and only while borrowing is measured faster: another process holding a core makes a borrowing step wait
  at every barrier for a thread the kernel rarely runs, so the lead times its lone steps both ways and
  stops borrowing where it loses (engine/borrow_choice.py).

Borrowing therefore needs one thread per worker (2 workers on 2 or 3 cores; not 2 × 2 on 4). It widens
OpenMP only, not MKL's per-thread count: the CPU forward's matrix products and attention go through oneDNN
and ATen, which follow OpenMP. A sequence's embedding may differ in the last bits (about 1e-6) between a
step that ran alone and one that did not, as the thread count changes the order of the sums.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from bouquet.engine.borrow_choice import BorrowChoice

logger = logging.getLogger(__name__)


class StepThreads:
    """Counts the steps running and sets the lead worker's OpenMP thread count for each step it runs."""

    def __init__(
        self,
        own_threads: int,
        all_threads: int,
        max_tokens: int,
        set_threads: Callable[[int], None],
        get_threads: Callable[[], int] = torch.get_num_threads,
        choice: BorrowChoice | None = None,
    ) -> None:
        self.own_threads = own_threads
        self.all_threads = all_threads
        self.max_tokens = max_tokens
        self._set_threads = set_threads
        self._get_threads = get_threads
        self.choice = choice or BorrowChoice()
        self._running = 0
        self._started = 0  # steps started so far: a step that saw it unchanged at its end ran alone throughout
        self._lock = threading.Lock()
        self._local = threading.local()  # is_lead, may_borrow, threads

    @property
    def running(self) -> int:
        return self._running

    def make_lead(self) -> None:
        """Called once, on the one worker thread allowed to borrow; first checks that the setter really moves
        torch's count on this thread, and leaves borrowing off (logged) where it does not."""
        self._set_threads(self.all_threads)
        widened = self._get_threads() == self.all_threads
        self._set_threads(self.own_threads)
        if widened and self._get_threads() == self.own_threads:
            self._local.is_lead = True
        else:
            logger.warning("omp_set_num_threads did not change torch's thread count: a lone step keeps its share")

    @contextmanager
    def step(self, num_tokens: int, timed: bool = True, trial: bool | None = None) -> Iterator[None]:
        """Around one step, on the worker thread that computes it. A lone short step on the lead borrows as
        `choice` says and its time goes back to `choice`; `timed=False` (start-up work) borrows without asking;
        `trial` (start-up timing, engine.py) borrows or not as it says, its time recorded as a lone step's."""
        with self._lock:
            self._running += 1
            self._started += 1
            started, lone = self._started, self._running == 1
        short_on_lead = getattr(self._local, "is_lead", False) and num_tokens <= self.max_tokens
        timed = timed and short_on_lead and lone
        if timed and trial is not None:
            self._local.may_borrow = trial
        elif timed:
            self._local.may_borrow = self.choice.should_borrow(num_tokens)
        else:  # start-up work, or a step that met others: it may widen at a later layer, once they have finished
            self._local.may_borrow = short_on_lead and self.choice.borrowing(num_tokens)
        borrowed = self._local.may_borrow
        begin = time.perf_counter()
        try:
            self.rebalance()
            yield
        except BaseException:
            timed = False  # a failed step's time says nothing
            raise
        finally:
            seconds = time.perf_counter() - begin
            with self._lock:
                self._running -= 1
                alone_throughout = self._started == started
            if self._local.may_borrow:
                self._local.may_borrow = False
                self._apply(self.own_threads)
            if timed and alone_throughout:
                self.choice.record(num_tokens, borrowed, seconds)

    def rebalance(self) -> None:
        """At the step's start and at each layer: every thread while the step is alone, else its share."""
        if getattr(self._local, "may_borrow", False):
            self._apply(self.all_threads if self._running == 1 else self.own_threads)

    def _apply(self, threads: int) -> None:
        if getattr(self._local, "threads", self.own_threads) != threads:
            self._set_threads(threads)
            self._local.threads = threads
