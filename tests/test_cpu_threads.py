"""CPU engine threads: the step workers' dispatch, a lone short step borrowing every thread on the lead
worker, and the engine starting no OpenMP helpers on its caller's thread."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from bouquet.batch import Batch
from bouquet.config import EngineConfig
from bouquet.engine.borrow_choice import BorrowChoice
from bouquet.engine.cpu_threads import StepThreads
from bouquet.engine.engine import Engine
from bouquet.engine.step_workers import StepWorkers
from bouquet.kernels.openmp import find_thread_setter


def _thread_name() -> str:
    return threading.current_thread().name


@pytest.fixture
def workers():
    started: list[int] = []
    pool = StepWorkers(3, started.append, name="test-worker")
    assert sorted(started) == [0, 1, 2]  # every initializer ran before the constructor returned
    yield pool
    pool.shutdown()


def test_an_idle_lead_takes_every_step(workers: StepWorkers) -> None:
    names = {workers.submit(_thread_name).result(10) for _ in range(20)}
    assert names == {"test-worker-0"}


def test_busy_workers_queue_steps_first_in_first_out() -> None:
    pool = StepWorkers(1, lambda _: None)
    try:
        release = threading.Event()
        blocker = pool.submit(release.wait, 10)
        order: list[int] = []
        queued = [pool.submit(order.append, i) for i in range(6)]
        time.sleep(0.05)
        assert order == [] and not any(f.done() for f in queued)  # the one worker is held
        release.set()
        for future in [blocker, *queued]:
            future.result(10)
        assert order == list(range(6))
    finally:
        pool.shutdown()


def test_every_queued_step_runs_when_several_workers_free_up(workers: StepWorkers) -> None:
    release = threading.Event()
    blockers = [workers.submit(release.wait, 10) for _ in range(3)]
    done: list[int] = []
    queued = [workers.submit(done.append, i) for i in range(9)]
    release.set()
    for future in blockers + queued:
        future.result(10)
    assert sorted(done) == list(range(9))


def test_a_step_submitted_from_a_done_callback_finds_the_lead_free(workers: StepWorkers) -> None:
    """The worker is idle again before its result's callbacks run, as a replica submits its next step there."""
    names: list[str] = []
    finished = threading.Event()

    def chain(remaining: int) -> None:
        future = workers.submit(_thread_name)

        def next_step(done) -> None:
            names.append(done.result())
            if remaining:
                chain(remaining - 1)
            else:
                finished.set()

        future.add_done_callback(next_step)

    chain(20)
    assert finished.wait(10)
    assert set(names) == {"test-worker-0"}


def test_a_step_that_raises_fails_only_its_future(workers: StepWorkers) -> None:
    def fail() -> None:
        raise ValueError("bad batch")

    with pytest.raises(ValueError, match="bad batch"):
        workers.submit(fail).result(10)
    assert workers.submit(lambda: 7).result(10) == 7


def test_shutdown_finishes_what_was_submitted() -> None:
    pool = StepWorkers(2, lambda _: None)
    release = threading.Event()
    held = [pool.submit(release.wait, 10) for _ in range(2)]
    queued = [pool.submit(lambda i=i: i) for i in range(4)]
    threading.Timer(0.05, release.set).start()
    pool.shutdown()
    assert all(f.result(0) for f in held) and [f.result(0) for f in queued] == [0, 1, 2, 3]
    with pytest.raises(RuntimeError, match="shutdown"):
        pool.submit(lambda: None)


def test_a_failing_initializer_fails_the_constructor() -> None:
    def init(index: int) -> None:
        if index == 1:
            raise OSError("no thread for you")

    with pytest.raises(OSError, match="no thread for you"):
        StepWorkers(2, init)


class _Recorder:
    """A stand-in OpenMP setter (and getter) that records each count set after the lead's start-up check."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.current = 1
        self.checked = False

    def __call__(self, threads: int) -> None:
        self.current = threads
        if self.checked:
            self.calls.append(threads)

    def get(self) -> int:
        return self.current


def _lead(threads: StepThreads, setter: _Recorder) -> None:
    threads.make_lead()
    setter.checked = True


def _on_thread(fn) -> None:
    """Runs fn on a new thread and re-raises what it raised, so that a failed assert there fails the test."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


def test_only_the_lead_borrows_and_only_for_a_short_lone_step() -> None:
    setter = _Recorder()
    threads = StepThreads(1, 4, max_tokens=64, set_threads=setter, get_threads=setter.get)

    def lead_steps() -> None:
        _lead(threads, setter)
        with threads.step(64):  # alone and short: every thread, then back to its own
            assert setter.calls == [4]
        assert setter.calls == [4, 1]
        with threads.step(65):  # too long to borrow
            pass

    _on_thread(lead_steps)
    assert setter.calls == [4, 1]

    def other_worker_step() -> None:
        with threads.step(8):
            pass

    _on_thread(other_worker_step)  # not the lead: never borrows
    assert setter.calls == [4, 1] and threads.running == 0


def test_a_trial_step_borrows_as_told_and_its_time_goes_to_the_choice() -> None:
    setter = _Recorder()
    threads = StepThreads(1, 4, max_tokens=64, set_threads=setter, get_threads=setter.get)

    def lead_steps() -> None:
        _lead(threads, setter)
        with threads.step(20, trial=False):  # what the choice would try second: the lead's own thread
            assert setter.calls == []
        assert not threads.choice.measured(20)
        with threads.step(20, trial=True):
            assert setter.calls == [4]
        assert setter.calls == [4, 1] and threads.choice.measured(20) and not threads.choice.measured(16)

    _on_thread(lead_steps)


def test_a_borrowing_step_gives_the_threads_back_when_another_starts() -> None:
    setter = _Recorder()
    threads = StepThreads(1, 2, max_tokens=256, set_threads=setter, get_threads=setter.get)
    other_started, other_may_finish = threading.Event(), threading.Event()

    def other_step() -> None:
        with threads.step(1024):
            other_started.set()
            other_may_finish.wait(10)

    def lead_step() -> None:
        _lead(threads, setter)
        with threads.step(16):
            threads.rebalance()  # a layer boundary, alone
            assert setter.calls == [2]
            other = threading.Thread(target=other_step)
            other.start()
            other_started.wait(10)
            threads.rebalance()  # next layer: the other step runs now
            assert setter.calls == [2, 1]
            other_may_finish.set()
            other.join()
            threads.rebalance()  # alone again
            assert setter.calls == [2, 1, 2]
        assert setter.calls == [2, 1, 2, 1]

    _on_thread(lead_step)


def test_a_setter_that_does_not_move_torchs_count_leaves_borrowing_off() -> None:
    calls: list[int] = []
    threads = StepThreads(1, 2, max_tokens=256, set_threads=calls.append, get_threads=lambda: 1)

    def step() -> None:
        threads.make_lead()
        calls.clear()
        with threads.step(8):
            pass

    _on_thread(step)
    assert calls == []


def test_openmp_setter_is_found_and_sets_only_the_calling_thread() -> None:
    setter = find_thread_setter()
    if setter is None:
        pytest.skip("torch here is not built with a known OpenMP runtime")
    seen: list[int] = []

    def set_one() -> None:
        torch.get_num_threads()
        setter(1)
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    _on_thread(set_one)
    assert seen == [1]
    assert torch.get_num_threads() == before
    seen.clear()
    _on_thread(lambda: seen.append(torch.get_num_threads()))
    assert seen == [before]  # torch's default for new threads is untouched


def _batch(tokenizer, texts: list[str]) -> Batch:
    return Batch.pack(tokenizer.encode(texts))


def test_a_lone_short_step_runs_on_every_thread_and_a_long_one_on_its_share(minilm_path, minilm_tokenizer) -> None:
    if find_thread_setter() is None:
        pytest.skip("torch here is not built with a known OpenMP runtime")
    config = EngineConfig(minilm_path, "cpu", "float32", num_threads=2, cpu_workers=2, cpu_lone_step_tokens=64)
    engine = Engine(config)
    seen: list[int] = []
    engine.model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    try:
        assert engine._step_threads is not None  # a lone query's classes timed both ways at start
        assert all(engine._step_threads.choice.measured(tokens) for tokens in (1, 16, 17, 32, 33, 64))
        # What the start-up timing found depends on what else ran on the cores then (a loaded machine stops
        # borrowing for a while); this test is about a step that borrows, so it starts from a fresh choice.
        engine._step_threads.choice = BorrowChoice()
        short = _batch(minilm_tokenizer, ["a short query"])
        long = _batch(minilm_tokenizer, ["a document about embeddings " * 20])
        assert long.num_tokens > 64
        expected = {
            "short": _rows_from_a_one_thread_engine(minilm_path, short),
            "long": _rows_from_a_one_thread_engine(minilm_path, long),
        }
        short_rows = engine.embed(short)
        long_rows = engine.embed(long)
        assert seen == [2, 1]
        np.testing.assert_allclose(short_rows, expected["short"], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(long_rows, expected["long"], rtol=1e-5, atol=1e-6)
    finally:
        engine.close()


def _rows_from_a_one_thread_engine(minilm_path: Path, batch: Batch) -> np.ndarray:
    engine = Engine(EngineConfig(minilm_path, "cpu", "float32", cpu_workers=1, cpu_lone_step_tokens=0))
    try:
        return engine.embed(batch)
    finally:
        engine.close()


def test_the_lead_gives_the_threads_back_at_the_next_layer_once_another_step_starts(
    minilm_path, minilm_tokenizer
) -> None:
    if find_thread_setter() is None:
        pytest.skip("torch here is not built with a known OpenMP runtime")
    # Eager layers: a CPU graph's replay (float32's lone query is one) runs no hook between its layers. No
    # start-up warm-up, whose timing of borrowing depends on the machine's load then: the first lone step borrows.
    config = EngineConfig(
        minilm_path,
        "cpu",
        "float32",
        num_threads=2,
        cpu_workers=2,
        cpu_lone_step_tokens=64,
        cpu_graphs=False,
        cpu_warmup_tokens=0,
    )
    engine = Engine(config)
    assert engine._step_threads is not None
    lead_threads_by_layer: list[int] = []
    other: list = []
    long = _batch(minilm_tokenizer, ["a document about embeddings " * 20])

    lead_past_layer_1 = threading.Event()

    def watch(*_: object) -> None:  # runs after the engine's own pre-hook, on whichever worker runs the layer
        if threading.current_thread().name != "bouquet-engine-0":
            lead_past_layer_1.wait(30)  # the other step stays running until the lead has checked again
            return
        lead_threads_by_layer.append(torch.get_num_threads())
        if len(lead_threads_by_layer) == 1:  # layer 0 of the lone step: another step starts meanwhile
            other.append(engine.step(long))
            deadline = time.monotonic() + 30
            while engine._step_threads.running < 2 and time.monotonic() < deadline:
                time.sleep(0.001)
        elif len(lead_threads_by_layer) == 2:
            lead_past_layer_1.set()

    attention_layers = [m for m in engine.model.modules() if type(m).__name__ == "Attention"]
    for layer in attention_layers:
        layer.register_forward_pre_hook(watch)
    try:
        engine.embed(_batch(minilm_tokenizer, ["a short query"]))
        other[0].result(60)
        assert lead_threads_by_layer[:2] == [2, 1]
        assert len(lead_threads_by_layer) == len(attention_layers)
    finally:
        engine.close()


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
@pytest.mark.process
def test_building_an_engine_leaves_no_openmp_helpers_behind() -> None:
    """In a fresh interpreter: an engine built and closed on the main thread leaves no thread behind. Its
    model loads on a passing thread; had it loaded on the caller's, that thread would keep an OpenMP helper
    for good, and the lead's wider team beside it would throttle both (engine/cpu_threads.py). A first engine
    built on another thread starts torch's own one-off threads, so that they are not counted."""
    script = textwrap.dedent(
        """
        import os
        import threading
        import time
        from bouquet.config import EngineConfig, default_model_path
        from bouquet.engine.engine import Engine

        def threads():
            return len(os.listdir("/proc/self/task"))

        def settled(expected=None):
            # A joined thread's OS thread (and its OpenMP helpers) may linger a moment after join returns:
            # wait for the count to reach `expected`, or without one, to hold still for 0.2 s.
            deadline, last, still_since = time.monotonic() + 10, threads(), time.monotonic()
            while time.monotonic() < deadline:
                time.sleep(0.01)
                now = threads()
                if expected is not None and now <= expected:
                    return now
                if now != last:
                    last, still_since = now, time.monotonic()
                elif expected is None and time.monotonic() - still_since > 0.2:
                    return now
            return threads()

        config = EngineConfig(default_model_path(), "cpu", "float32", num_threads=2, cpu_workers=2)
        warm = threading.Thread(target=lambda: Engine(config).close())
        warm.start()
        warm.join()
        before = settled()
        Engine(config).close()
        print(settled(before) - before)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "0"
