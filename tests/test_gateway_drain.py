"""A gateway's drain (SIGTERM) never answers 500: the work in hand, queued or computing, goes on for
`drain_seconds`; what is left then is cancelled (its chunks with it) and answered 503 with Retry-After, in the
route's own error shape, before the server cancels its tasks (which uvicorn answers 500) and before the replicas'
channels close. In-process: the replica's engine is held, so a request is in hand for as long as the test says."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from in_process import Served, served

from bouquet.engine.engine import Engine
from bouquet.gateway.http.server import bind_socket, uvicorn_config
from bouquet.replica.testing import RecordingEngine, wait_until


@pytest.fixture
def held(recorder: RecordingEngine, minilm_fp32: Engine) -> Iterator[tuple[Served, RecordingEngine]]:
    recorder.config = minilm_fp32.config  # type: ignore[attr-defined]  # what the replica reports as its dtype
    with served([recorder]) as running:  # type: ignore[list-item]
        yield running, recorder


def _begin_drain(running: Served, seconds: float) -> None:
    assert running.app is not None and running.loop is not None
    service = running.app.state.service
    running.loop.call_soon_threadsafe(service.begin_drain, seconds)


def _post(client: httpx.Client, route: str, body: dict[str, object]) -> Future[httpx.Response]:
    return ThreadPoolExecutor(1).submit(client.post, route, json=body)


def test_work_left_when_the_drain_ends_is_answered_503_with_retry_after(
    held: tuple[Served, RecordingEngine],
) -> None:
    running, engine = held
    engine.hold()
    openai = _post(running.client, "/v1/embeddings", {"input": ["a held request"]})
    tei = _post(running.client, "/embed", {"inputs": "another held request"})
    wait_until(lambda: len(engine.batches) >= 1)  # computing (the other may still be queued behind it)
    began = time.monotonic()
    _begin_drain(running, 0.3)
    answers = openai.result(30), tei.result(30)
    assert time.monotonic() - began < 10
    for answer in answers:
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1" and answer.headers["connection"] == "close"
    assert answers[0].json()["error"]["code"] == "shutting_down"
    assert answers[1].json() == {"error": answers[1].json()["error"], "error_type": "Unhealthy"}  # TEI's shape
    engine.release()


def test_work_that_finishes_within_the_drain_is_answered(held: tuple[Served, RecordingEngine]) -> None:
    running, engine = held
    engine.hold()
    request = _post(running.client, "/v1/embeddings", {"input": ["finished during the drain"]})
    wait_until(lambda: len(engine.batches) >= 1)
    _begin_drain(running, 30)
    time.sleep(0.2)
    engine.release()
    answer = request.result(30)
    assert answer.status_code == 200 and len(answer.json()["data"]) == 1


def test_a_request_whose_head_is_arriving_when_the_drain_begins_is_answered(minilm_fp32: Engine) -> None:
    """uvicorn's drain closes every connection without a response in progress; a request whose head was still
    arriving (sent before SIGTERM) got a closed connection instead of its answer. Its head completed after the drain
    began, it is answered, and the connection then closes. Real socket, the gateway's own server set-up."""
    body = json.dumps({"input": ["sent before the drain"]}).encode()
    with served([minilm_fp32]) as running:
        assert running.app is not None and running.loop is not None
        server = uvicorn.Server(uvicorn_config(running.app, running.app.state.service.config, lifespan="off",
                                               log_config=None))  # fmt: skip
        sock = bind_socket("127.0.0.1", 0)
        address = sock.getsockname()
        serving = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), running.loop)
        wait_until(lambda: server.started)
        with socket.create_connection(address, timeout=60) as client:
            client.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\n")  # half its head
            wait_until(lambda: any(c._in_message for c in server.server_state.connections))  # type: ignore[attr-defined]
            running.loop.call_soon_threadsafe(setattr, server, "should_exit", True)
            wait_until(lambda: _refused(address))  # the drain began: the port closed, the connections told
            client.sendall(b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            answer = _read_until_closed(client)
        serving.result(30)
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), answer[:300]
    assert b"connection: close" in head.lower()
    assert len(json.loads(payload)["data"][0]["embedding"]) == 384


def _refused(address: tuple[str, int]) -> bool:
    try:
        socket.create_connection(address, timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _read_until_closed(client: socket.socket) -> bytes:
    chunks = []
    while chunk := client.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)
