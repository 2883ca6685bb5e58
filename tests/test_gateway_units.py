"""The gateway's parts without processes: chunking, admission, request parsing, and that it never imports torch."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import orjson
import pytest

from bouquet.batch import Batch
from bouquet.config import GatewayConfig
from bouquet.encodings import FORMATS
from bouquet.gateway.admission import Admission
from bouquet.gateway.api.openai import parse_openai
from bouquet.gateway.api.tei import parse_tei
from bouquet.gateway.chunking import chunk_spans
from bouquet.gateway.errors import InvalidRequest, Overloaded, Unprocessable
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.metrics import GatewayMetrics


@pytest.mark.process
def test_the_gateway_never_imports_torch():
    modules = ["bouquet.cli", "bouquet.gateway.app", "bouquet.gateway.http.server", "bouquet.processes.serve",
               "bouquet.gateway.testing"]  # fmt: skip
    code = f"import sys; import {', '.join(modules)}; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("lengths", "chunk_tokens", "spans"),
    [
        ([10] * 10, 1000, [(0, 10)]),
        ([10] * 10, 50, [(0, 5), (5, 10)]),
        ([10] * 9, 40, [(0, 3), (3, 6), (6, 9)]),  # evened out: 3 chunks of 30, not 40 + 40 + 10
        ([500, 1, 1], 100, [(0, 1), (1, 3)]),  # an oversized sequence is a chunk of its own
        ([7], 1, [(0, 1)]),
    ],
)
def test_chunk_spans_cover_every_sequence_in_order(lengths, chunk_tokens, spans):
    assert chunk_spans(Batch.pack([[1] * length for length in lengths]), chunk_tokens) == spans


def test_chunk_spans_count_patch_images_patches_as_the_replica_does():
    """Four sequences of 10 tokens, two holding a 64-patch image: 40 tokens, one chunk by tokens alone; 168 in the
    replica's budget, so two chunks of about 84."""
    grids = np.array([[1, 8, 8], [1, 8, 8]])
    batch = Batch.pack([[1] * 10] * 4).with_patch_images(np.zeros((128, 12), np.float32), grids, [1, 0, 1, 0])
    assert chunk_spans(batch, 100) == [(0, 2), (2, 4)]
    assert chunk_spans(Batch.pack([[1] * 10] * 4), 100) == [(0, 4)]


def _admission(rate: float | None, floor: int = 100, ceiling: int = 10_000, requests: int = 8) -> Admission:
    return Admission(GatewayMetrics(), ceiling, 2.0, 0.2, requests, lambda: rate, lambda: floor)


async def _admit_and_hold(admission: Admission, tokens: int, hold: float) -> None:
    async with admission.admit(tokens, short_tokens=10):
        await asyncio.sleep(hold)


def test_admission_caps_tokens_in_flight_but_always_admits_a_lone_request():
    async def scenario() -> None:
        admission = _admission(rate=None)  # speed unknown: the floor, 100 tokens
        async with admission.admit(500, short_tokens=10):  # alone in the bulk lane: admitted over the cap
            with pytest.raises(Overloaded) as refused:  # waits its 0.2 s for room, then 429
                await _admit_and_hold(admission, 50, 0)
            assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
            async with admission.admit(5, short_tokens=10):  # a short request has a lane of its own
                assert admission.inflight == {False: 500, True: 5}
        async with admission.admit(60, short_tokens=10), admission.admit(40, short_tokens=10):
            assert admission.inflight[False] == 100
        assert admission.inflight == {False: 0, True: 0}

    asyncio.run(scenario())


def test_a_request_over_the_cap_waits_for_room_first_come_first_served():
    async def scenario() -> list[int]:
        admission = _admission(rate=None)
        order: list[int] = []

        async def request(index: int, tokens: int) -> None:
            async with admission.admit(tokens, short_tokens=10):
                order.append(index)
                await asyncio.sleep(0.05)

        await asyncio.gather(request(0, 80), request(1, 80), request(2, 20))  # 2 would fit beside 0, but waits
        return order

    assert asyncio.run(scenario()) == [0, 1, 2]


def test_admission_follows_the_measured_speed_within_floor_and_ceiling():
    assert _admission(rate=None).limit() == 100
    assert _admission(rate=1_000).limit() == 2_000  # two seconds of work
    assert _admission(rate=10).limit() == 100  # never under the floor
    assert _admission(rate=1e9).limit() == 10_000  # never over the ceiling


def test_a_ticket_holds_its_real_count_once_tokenized():
    async def scenario() -> None:
        admission = _admission(rate=None)
        async with admission.admit(90, short_tokens=10) as ticket:
            ticket.resize(30)
            async with admission.admit(70, short_tokens=10):
                assert admission.inflight[False] == 100
        assert admission.inflight[False] == 0

    asyncio.run(scenario())


def test_a_request_that_alone_runs_past_the_window_waits_less():
    """Window 2 s, wait 0.2 s, 100 tokens/s: 210 tokens (2.1 s) may wait 0.1 s; 300 (3 s) a quarter of the wait,
    0.05 s, however long it takes."""

    async def refused_after(tokens: int, exact: bool = True) -> float:
        admission = _admission(rate=100, floor=10)
        admission.tokens_per_estimate = 0.5  # as if learnt: bytes-based estimates count half
        async with admission.admit(150, short_tokens=10):  # 1.5 s of work in flight
            started = time.monotonic()
            with pytest.raises(Overloaded):
                async with admission.admit(tokens, short_tokens=10, exact=exact):
                    pass
            return time.monotonic() - started

    assert 0.15 <= asyncio.run(refused_after(100)) < 0.4  # within the window: the full wait
    assert 0.07 <= asyncio.run(refused_after(210)) < 0.15
    assert 0.03 <= asyncio.run(refused_after(300)) < 0.07
    assert 0.03 <= asyncio.run(refused_after(10_000)) < 0.07
    assert 0.07 <= asyncio.run(refused_after(420, exact=False)) < 0.15  # 420 bytes count as 210 tokens
    assert 0.03 <= asyncio.run(refused_after(420)) < 0.07  # 420 token ids are 420 tokens


def test_admission_learns_how_far_its_estimates_run_over():
    async def scenario() -> float:
        admission = _admission(rate=100, floor=10)
        for _ in range(40):
            async with admission.admit(1000, short_tokens=10) as ticket:
                ticket.tokenized(200)  # prose: a token is four to five bytes
        assert admission.inflight[False] == 0
        async with admission.admit(150, short_tokens=10):
            started = time.monotonic()
            with pytest.raises(Overloaded):  # 1,000 bytes now count as about 2.1 s, not 10: it waits a little
                await _admit_and_hold(admission, 1000, 0)
            return time.monotonic() - started

    assert 0.06 <= asyncio.run(scenario()) < 0.15


def test_a_large_body_is_refused_unread_when_the_work_in_flight_outlasts_the_wait():
    """Window 2 s, wait 0.2 s, 100 tokens/s (cap 200): a body of 64 KiB or more is refused before it is read,
    after the wait its bytes would be allowed, when the bulk tokens in flight stay over the cap for longer than
    the wait; a smaller body, or one while the work in flight drains in time, goes on to be read."""

    async def scenario() -> None:
        admission = _admission(rate=100, floor=10)
        await admission.refuse_unread(1 << 20)  # nothing in flight: read it
        async with admission.admit(215, short_tokens=10):  # 15 tokens over the cap: 0.15 s to drain, within 0.2 s
            await admission.refuse_unread(1 << 20)
        async with admission.admit(300, short_tokens=10):  # 100 over: 1 s
            await admission.refuse_unread(60_000)  # under 64 KiB: parsed, then admitted or refused on its tokens
            started = time.monotonic()
            with pytest.raises(Overloaded) as refused:
                await admission.refuse_unread(1 << 20)
            assert refused.value.status == 429 and refused.value.headers["Retry-After"] == "1"
            assert 0.04 <= time.monotonic() - started < 0.15  # its own wait (a quarter: it alone runs past both)

    asyncio.run(scenario())


def test_concurrent_requests_over_the_cap_are_refused_at_once():
    admission = _admission(rate=None, requests=2)
    with admission.request(), admission.request(), pytest.raises(Overloaded), admission.request():
        pass
    with admission.request():
        assert admission.requests == 1


def _openai(body: dict) -> EmbedJob:
    return parse_openai(orjson.dumps(body))


def _tei(body: dict) -> EmbedJob:
    return parse_tei(orjson.dumps(body))


def _inputs(value: object) -> tuple[list[str] | None, list[list[int]] | None]:
    job = _openai({"input": value})
    return job.texts, job.token_ids


def test_inputs_of_every_form():
    assert _inputs("a") == (["a"], None)
    assert _inputs(["a", "b"]) == (["a", "b"], None)
    assert _inputs([1, 2]) == (None, [[1, 2]])
    assert _inputs([[1], [2, 3]]) == (None, [[1], [2, 3]])
    assert _inputs(["a", [1]]) == (["a"], [[1]])  # mixed, as TEI takes: text_positions says where the text goes
    for bad in (True, [True], [1, "a"], [[1], 2], {"a": 1}, [None], [[1.5]]):
        with pytest.raises(Unprocessable):
            _inputs(bad)
    for empty in ("", [], [""], [[]]):
        with pytest.raises(InvalidRequest) as raised:
            _inputs(empty)
        assert raised.value.code == "empty_input" and raised.value.param.startswith("input")


def test_a_type_error_names_the_field_at_its_path():
    with pytest.raises(Unprocessable) as raised:
        _openai({"input": ["a", "b", 1.5]})
    assert (raised.value.code, raised.value.param) == ("invalid_type", "input[2]")
    with pytest.raises(InvalidRequest) as raised:
        _openai({"input": "a", "extra": 1})
    assert (raised.value.code, raised.value.param) == ("unsupported_parameter", "extra")
    assert parse_openai(orjson.dumps({"input": "a", "extra": 1}), strict=False).texts == ["a"]
    with pytest.raises(InvalidRequest) as raised:
        parse_openai(b'{"input": "\xff"}')
    assert raised.value.code == "invalid_utf8"
    with pytest.raises(InvalidRequest, match="not valid JSON"):
        parse_openai(b"{not json")


def test_request_defaults():
    job = _openai({"input": "a", "model": "m", "user": "u"})
    # normalize None: the model's Normalize module decides (the gateway learns it from Info)
    assert (job.model, job.options.normalize, job.truncate, job.response_format, job.options.dimensions) == (
        "m",
        None,
        True,
        FORMATS["float"],
        None,
    )
    tei = _tei({"inputs": ["a"], "normalize": False, "truncate": False, "truncation_direction": "Left"})
    assert (tei.options.normalize, tei.truncate, tei.truncation_direction) == (False, False, "left")
    with pytest.raises(InvalidRequest):
        _tei({"inputs": "a", "truncation_direction": "up"})
    with pytest.raises(Unprocessable):
        _tei({"inputs": "a", "normalize": 1})
    with pytest.raises(InvalidRequest):
        _openai({"model": "m"})


def test_gateway_workers_need_a_fixed_port():
    with pytest.raises(ValueError, match="fixed port"):
        GatewayConfig(replicas=("127.0.0.1:50051",), port=0, workers=2)
    with pytest.raises(ValueError, match="workers"):
        GatewayConfig(replicas=("127.0.0.1:50051",), workers=0)


def test_a_dead_gateway_workers_live_gauges_leave_the_shared_metrics(tmp_path):
    from types import SimpleNamespace

    from bouquet.processes.supervisor import Supervisor

    write_gauge = (
        "from prometheus_client import Gauge; Gauge('in_flight', 'in flight', multiprocess_mode='livesum').set(5)"
    )
    worker = subprocess.run(
        [sys.executable, "-c", write_gauge], env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}, check=True
    )
    assert worker.returncode == 0
    files = list(tmp_path.glob("gauge_livesum_*.db"))
    assert len(files) == 1
    pid = int(files[0].stem.rsplit("_", 1)[1])
    supervisor = Supervisor("test", ready_timeout=1.0, drain_seconds=1.0)
    supervisor._metrics_dir = SimpleNamespace(name=str(tmp_path))  # type: ignore[assignment]
    child = SimpleNamespace(process=SimpleNamespace(pid=pid))
    supervisor.gateways.append(child)  # type: ignore[arg-type]
    supervisor.forget_metrics(child)  # type: ignore[arg-type]
    assert not list(tmp_path.glob("gauge_livesum_*.db"))


def test_a_failed_chunk_cancels_its_siblings():
    """One chunk refused (a full queue) answers the request at once, and the chunks still waiting on replicas are
    cancelled, which cancels their gRPC calls, so no replica computes rows nobody will read."""
    import asyncio

    import numpy as np

    from bouquet.gateway.chunking import embed_chunked

    cancelled: list[int] = []

    class Pool:
        async def embed(self, model: str, batch: Batch, priority: int = 0) -> np.ndarray:
            if batch.num_seqs == 1 and batch.input_ids[0] == 7:
                raise Overloaded("queue full", "overloaded")
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                cancelled.append(int(batch.input_ids[0]))
                raise
            return np.zeros((batch.num_seqs, 2), np.float32)

    batch = Batch.pack([[1] * 10, [7] * 10, [3] * 10])  # three chunks of 10 tokens
    with pytest.raises(Overloaded):
        asyncio.run(asyncio.wait_for(embed_chunked(Pool(), "m", batch, chunk_tokens=10), timeout=10))
    assert sorted(cancelled) == [1, 3]


@pytest.mark.parametrize(
    "field", ["max_connections", "max_header_bytes", "header_timeout", "body_timeout", "idle_timeout"]
)
def test_connection_limits_must_be_positive(field: str):
    with pytest.raises(ValueError, match=f"{field} must be positive"):
        GatewayConfig(replicas=("127.0.0.1:50051",), **{field: 0})


def connection_table(cap: int):
    from bouquet.gateway.http.protocol import ConnectionLimits, Connections

    return Connections(ConnectionLimits(cap, 16384, 30.0, 30.0, 75.0), GatewayMetrics())


class FakeConnection:
    """What `Connections` asks of a connection: to close itself, to make room."""

    def __init__(self, shared, name: str):
        self.shared = shared
        self.name = name
        self.evicted = False

    def evict(self) -> None:
        self.evicted = True
        self.shared.release(self)


def test_at_the_cap_the_longest_idle_connection_makes_room_and_none_idle_means_a_refusal():
    shared = connection_table(cap=3)
    a, b, c = (FakeConnection(shared, name) for name in "abc")
    for connection in (a, b, c):
        assert shared.admit()
        shared.idle(connection)
    shared.busy(a)  # a request in progress on the oldest: never cut
    assert shared.admit() and (a.evicted, b.evicted, c.evicted) == (False, True, False)
    d = FakeConnection(shared, "d")
    shared.idle(c)  # c idle again, after a response: now the youngest idle but for d
    shared.idle(d)
    assert shared.admit() and c.evicted and not d.evicted
    shared.busy(d)
    assert not shared.admit()  # every connection busy: the new one is refused
    assert shared.counted == 3


def test_the_connection_cap_follows_the_open_file_limit(monkeypatch: pytest.MonkeyPatch):
    import resource

    from bouquet.gateway.http import protocol as http_protocol
    from bouquet.gateway.http.protocol import ConnectionLimits, connection_cap

    limits = ConnectionLimits(10_000, 16384, 30.0, 30.0, 75.0)
    set_to: list[tuple[int, int]] = []
    for soft, hard, cap in ((1024, 1_048_576, 10_000), (1024, 4096, 4096 - http_protocol._FD_RESERVE)):
        set_to.clear()
        monkeypatch.setattr(resource, "getrlimit", lambda _, soft=soft, hard=hard: (soft, hard))
        monkeypatch.setattr(resource, "setrlimit", lambda _, value: set_to.append(value))
        assert connection_cap(limits).max_connections == cap
        assert set_to == [(min(hard, 10_000 + http_protocol._FD_RESERVE), hard)]  # the soft limit raised first


def test_memory_is_trimmed_once_idle_after_work_and_never_during_it(monkeypatch):
    from bouquet.gateway import memory_trim

    trims: list[int] = []
    monkeypatch.setattr(memory_trim, "_malloc_trim", lambda: lambda: trims.append(1))
    monkeypatch.setattr(memory_trim, "_IDLE_CHECK_S", 0.01)
    state = {"in_flight": 1, "answered": 0}

    async def scenario() -> None:
        task = asyncio.ensure_future(memory_trim.trim_when_idle(lambda: state["in_flight"], lambda: state["answered"]))
        await asyncio.sleep(0.02)
        state["answered"] = 3
        await asyncio.sleep(0.05)
        assert trims == []  # work in flight: never
        state["in_flight"] = 0
        await asyncio.sleep(0.05)
        assert trims == [1]  # idle after work: once, not again while nothing new is answered
        task.cancel()

    asyncio.run(scenario())
