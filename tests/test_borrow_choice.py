"""A lone step borrows every thread only while borrowing is measured faster (engine/borrow_choice.py), and the
lead worker reports exactly the steps that ran alone (engine/cpu_threads.py)."""

from __future__ import annotations

import itertools
import threading

import pytest
from test_cpu_threads import _on_thread

from bouquet.engine.borrow_choice import BorrowChoice
from bouquet.engine.cpu_threads import StepThreads

QUIET = {True: 0.0046, False: 0.0065}  # seconds a lone query takes, borrowed or not, on an idle machine
BUSY = {True: 0.060, False: 0.008}  # and with another process holding a core


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def run(
    choice: BorrowChoice, clock: Clock, times: dict[bool, float], steps: int, tokens: int = 16, at: list | None = None
) -> list[bool]:
    """`steps` lone steps, one every 10 ms, each taking what `times` says for the way it ran; `at` gets their
    start times."""
    decisions = []
    for _ in range(steps):
        borrowed = choice.should_borrow(tokens)
        decisions.append(borrowed)
        if at is not None:
            at.append(clock.now)
        clock.now += times[borrowed]
        choice.record(tokens, borrowed, times[borrowed])
        clock.now += 0.01
    return decisions


def test_an_idle_machine_keeps_borrowing_and_refreshes_the_other_estimate_now_and_then() -> None:
    clock = Clock()
    choice = BorrowChoice(refresh_every=32, clock=clock)
    decisions = run(choice, clock, QUIET, 200)
    assert decisions[:2] == [True, False] and all(decisions[2:31])  # the alternative measured at once
    own_steps = decisions.count(False)
    assert 1 + 200 // 32 - 1 <= own_steps <= 1 + 200 // 32
    assert choice.borrowing(16)


def test_a_busy_core_stops_borrowing_and_retries_with_a_growing_backoff() -> None:
    clock = Clock()
    choice = BorrowChoice(first_backoff=1.0, max_backoff=8.0, clock=clock)
    run(choice, clock, QUIET, 40)
    assert choice.borrowing(16)
    starts: list[float] = []
    decisions = run(choice, clock, BUSY, 3000, at=starts)  # ~54 s of steps on a machine that stays busy
    assert not choice.borrowing(16)
    # Until the periodic own-thread step shows the loss, borrowing continues; then only retries, further and further
    # apart: a handful of borrowed steps where a fixed choice would borrow for all 3,000.
    first_loss = decisions.index(False)
    assert first_loss <= 32
    retries = [starts[i] for i, borrowed in enumerate(decisions) if borrowed and i > first_loss]
    gaps = [b - a for a, b in itertools.pairwise(retries)]
    assert len(retries) >= 5
    # 52 ms lost a borrowed step: retries at least 50 x that (2.6 s) apart, doubling from there to the cap
    assert retries[0] - starts[first_loss] == pytest.approx(2.6, abs=0.3)
    assert gaps[0] == pytest.approx(5.2, abs=0.3)
    assert all(gap == pytest.approx(8.0, abs=0.3) for gap in gaps[1:])


def test_borrowing_comes_back_at_the_first_retry_after_the_core_is_free_again() -> None:
    clock = Clock()
    choice = BorrowChoice(first_backoff=1.0, max_backoff=4.0, clock=clock)
    run(choice, clock, BUSY, 500)
    assert not choice.borrowing(16)
    decisions = run(choice, clock, QUIET, 2000)  # ~33 s: at least one retry falls inside
    assert choice.borrowing(16)
    back = decisions.index(True)
    assert all(decisions[back : back + 20])  # and it stays borrowing


def test_size_classes_decide_apart() -> None:
    clock = Clock()
    choice = BorrowChoice(clock=clock)
    run(choice, clock, BUSY, 100, tokens=200)  # long lone steps lose
    run(choice, clock, QUIET, 100, tokens=12)  # short ones win
    assert not choice.borrowing(200) and not choice.borrowing(129)
    assert choice.borrowing(12) and choice.borrowing(16)


def test_a_stale_estimate_is_replaced_not_averaged() -> None:
    clock = Clock()
    choice = BorrowChoice(stale_after=10.0, clock=clock)
    run(choice, clock, BUSY, 100)  # own thread measured at 8 ms, borrowing off
    assert not choice.borrowing(16)
    clock.now += 3600  # an hour with no lone step: the machine may be idle now
    assert choice.should_borrow(16)  # the retry is due
    choice.record(16, True, QUIET[True])
    assert choice.borrowing(16)  # 4.6 ms against the old 8 ms: borrowing wins at once, not after many samples


class _Setter:
    def __init__(self) -> None:
        self.current = 1

    def __call__(self, threads: int) -> None:
        self.current = threads

    def get(self) -> int:
        return self.current


class _Recording(BorrowChoice):
    def __init__(self, borrow: bool) -> None:
        super().__init__()
        self.borrow = borrow
        self.asked: list[int] = []
        self.recorded: list[tuple[int, bool]] = []

    def should_borrow(self, num_tokens: int) -> bool:
        self.asked.append(num_tokens)
        return self.borrow

    def record(self, num_tokens: int, borrowed: bool, seconds: float) -> None:
        assert seconds >= 0
        self.recorded.append((num_tokens, borrowed))


def test_the_lead_asks_and_reports_only_for_lone_short_steps_that_ran_alone_throughout() -> None:
    setter = _Setter()
    choice = _Recording(borrow=False)
    threads = StepThreads(1, 2, max_tokens=64, set_threads=setter, get_threads=setter.get, choice=choice)
    other_started, other_may_finish = threading.Event(), threading.Event()

    def other_step() -> None:
        with threads.step(1024):
            other_started.set()
            other_may_finish.wait(10)

    def lead() -> None:
        threads.make_lead()
        with threads.step(16):  # alone: asked, told not to borrow, reported as not borrowed
            assert setter.current == 1
        with threads.step(100):  # too long to borrow: neither asked nor reported
            pass
        with threads.step(16, timed=False):  # start-up work: borrows without asking, not reported
            assert setter.current == 2
        with threads.step(16):  # alone at its start, then another step starts: asked, not reported
            other = threading.Thread(target=other_step)
            other.start()
            other_started.wait(10)
            other_may_finish.set()
            other.join()
        try:
            with threads.step(16):  # a step that fails is not reported
                raise RuntimeError("forward failed")
        except RuntimeError:
            pass

    _on_thread(lead)
    assert choice.asked == [16, 16, 16]
    assert choice.recorded == [(16, False)]
    choice.borrow = True
    _on_thread(lambda: threads.step(16).__enter__())  # not the lead: never asks
    assert choice.asked == [16, 16, 16]


def test_a_borrowed_lone_step_is_reported_as_borrowed() -> None:
    setter = _Setter()
    choice = _Recording(borrow=True)
    threads = StepThreads(1, 2, max_tokens=64, set_threads=setter, get_threads=setter.get, choice=choice)

    def lead() -> None:
        threads.make_lead()
        with threads.step(16):
            assert setter.current == 2
        assert setter.current == 1

    _on_thread(lead)
    assert choice.recorded == [(16, True)]


def test_one_slow_step_does_not_stop_borrowing() -> None:
    clock = Clock()
    choice = BorrowChoice(clock=clock)
    run(choice, clock, QUIET, 40)
    choice.record(16, True, 0.030)  # a step that met a page fault or a garbage collection
    run(choice, clock, QUIET, 40)
    assert choice.borrowing(16)
    assert choice._classes[16].own.seconds == QUIET[False]


def test_a_retry_that_costs_seconds_waits_longer() -> None:
    clock = Clock()
    choice = BorrowChoice(first_backoff=1.0, max_backoff=60.0, clock=clock)
    images = {True: 4.0, False: 0.65}  # a lone image that borrows beside a co-tenant loses 3.35 s
    starts: list[float] = []
    decisions = run(choice, clock, images, 200, at=starts)
    retries = [starts[i] for i, borrowed in enumerate(decisions) if borrowed and i > decisions.index(False)]
    assert retries and all(
        b - a >= 60.0 - 0.1 for a, b in itertools.pairwise([starts[decisions.index(False)], *retries])
    )


def test_a_step_that_meets_another_widens_later_only_while_borrowing_wins() -> None:
    setter = _Setter()
    choice = BorrowChoice()
    threads = StepThreads(1, 2, max_tokens=64, set_threads=setter, get_threads=setter.get, choice=choice)
    other_started, other_may_finish = threading.Event(), threading.Event()

    def other_step() -> None:
        with threads.step(1024):
            other_started.set()
            other_may_finish.wait(10)

    def lead_step_beside_another() -> list[int]:
        other = threading.Thread(target=other_step)
        other.start()
        other_started.wait(10)
        seen = []
        with threads.step(16):  # not alone at its start
            seen.append(setter.current)
            other_may_finish.set()
            other.join()
            threads.rebalance()  # alone now, at a layer boundary
            seen.append(setter.current)
        other_started.clear()
        other_may_finish.clear()
        return seen

    def lead() -> None:
        threads.make_lead()
        assert lead_step_beside_another() == [1, 2]  # borrowing wins (the first guess): widens once alone
        choice.record(16, True, 0.060)
        choice.record(16, False, 0.008)  # now it loses
        assert not choice.borrowing(16)
        assert lead_step_beside_another() == [1, 1]

    _on_thread(lead)
