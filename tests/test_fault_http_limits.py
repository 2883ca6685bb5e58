"""Every HTTP connection to the gateway is bounded (gateway/http/protocol.py), tested as a fault campaign found the
gaps: real processes on loopback, raw sockets where a client must misbehave. A 50 MB header is refused 431 while
it still arrives; headers or a body that stop arriving get a 408 and a closed connection; a silent connection is
closed; a crowd of idle connections past the cap makes room for a new client, and with every connection busy a
new one is refused 503 with Retry-After rather than reset. Each bad case runs while good requests succeed.
Marked `fault`: part of the default run; short timeouts are passed as flags so each case is bounded in time."""

from __future__ import annotations

import asyncio
import json
import re
import resource
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import corpus
import pytest
from test_gateway_replicas import embed

from bouquet.gateway.testing import Process, free_port, start_gateway, start_replica, wait_healthy

pytestmark = [pytest.mark.fault, pytest.mark.process]

TIMEOUT = 1  # seconds: the header, body and idle timeouts of the gateway under test
MARGIN = 15.0  # generous: a timed-out connection must be closed within TIMEOUT + MARGIN, on a loaded machine too
TEXTS = corpus.documents(4)
HUGE = 50 * 1024 * 1024


@pytest.fixture(scope="module")
def replica() -> Iterator[str]:
    port = free_port()
    process = start_replica(port, "--dtype", "float32")
    try:
        process.wait_ready()
        yield f"127.0.0.1:{port}"
    finally:
        process.stop()


def running_gateway(replica: str, *args: str) -> tuple[Process, str, int]:
    port = free_port()
    process = start_gateway(port, [replica], *args)
    process.wait_ready()
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url)
    return process, url, port


@pytest.fixture(scope="module")
def gateway(replica: str) -> Iterator[tuple[str, int]]:
    """Short timeouts; the header limit is the default (16 KiB)."""
    timeouts = ("--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT), "--idle-timeout", str(TIMEOUT))
    process, url, port = running_gateway(replica, *timeouts)
    try:
        yield url, port
    finally:
        assert process.stop() == 0


# Clients


def connect(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=TIMEOUT + MARGIN)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the gateway sends until it closes the connection, and how long that took."""
    started = time.monotonic()
    received = b""
    with sock:
        while piece := sock.recv(65536):
            received += piece
    return received, time.monotonic() - started


def response(raw: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lower-case names) and JSON body of one HTTP response."""
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split()[1]), headers, json.loads(body)


def assert_error(raw: bytes, status: int, code: str) -> dict[str, str]:
    got, headers, body = response(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json"
    if isinstance(body["error"], str):  # a TEI route: TEI's body, {"error", "error_type"}
        assert set(body) == {"error", "error_type"} and body["error"], body
        return headers
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == code
    return headers


def closed_count(url: str, reason: str) -> float:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    match = re.search(rf'^bouquet_gateway_connections_closed_total{{reason="{reason}"}} (\S+)$', text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@contextmanager
def good_requests(url: str) -> Iterator[None]:
    """Embedding requests, one after another, for as long as the block runs: every one must succeed."""
    statuses: list[int] = []
    stop = threading.Event()

    def client() -> None:
        while not stop.is_set():
            statuses.append(embed(url, TEXTS)[0])

    thread = threading.Thread(target=client)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=120)
    assert statuses and set(statuses) == {200}, statuses


# Size


def oversized_header(size: int) -> Iterator[bytes]:
    """One header line of `size` bytes, in 64 KiB pieces."""
    yield b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nX-Padding: "
    piece = b"a" * 65536
    for _ in range(size // len(piece)):
        yield piece


def many_headers(size: int) -> Iterator[bytes]:
    """`size` bytes of short header lines."""
    yield b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\n"
    piece = b"X-Padding: aaaaaaaaaaaaaaaaaaaaaa\r\n" * 2048
    for _ in range(size // len(piece)):
        yield piece


def send_until_answered(sock: socket.socket, pieces: Iterator[bytes]) -> int:
    """Sends the pieces until the gateway answers (or stops reading); the bytes sent."""
    sent = 0
    pending = next(pieces)
    while True:
        readable, writable, _ = select.select([sock], [sock], [], TIMEOUT + MARGIN)
        if readable or not writable:
            return sent
        try:
            count = sock.send(pending)
        except (BrokenPipeError, ConnectionResetError):
            return sent
        sent += count
        pending = pending[count:] or next(pieces, b"")
        if not pending:
            return sent


@pytest.mark.parametrize("shape", [oversized_header, many_headers])
def test_a_50_mb_header_is_refused_431_as_it_arrives(gateway: tuple[str, int], shape: Callable) -> None:
    url, port = gateway
    before = closed_count(url, "header_too_large")
    with good_requests(url):
        sock = connect(port)
        sent = send_until_answered(sock, shape(HUGE))
        raw, _ = until_closed(sock)
    print(f"{shape.__name__}: answered 431 after {sent} of {HUGE} bytes")
    assert_error(raw, 431, "headers_too_large")
    assert sent < HUGE  # answered while the header still arrived, not once 50 MB were held
    assert closed_count(url, "header_too_large") == before + 1
    assert embed(url, TEXTS)[0] == 200


def test_a_head_at_the_limit_is_served_and_one_byte_more_is_not(gateway: tuple[str, int]) -> None:
    _, port = gateway
    head = b"GET /health HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nX-Padding: "
    padding = 16 * 1024 - len(head) - len(b"\r\n\r\n")
    for extra, status in ((0, 200), (1, 431)):
        sock = connect(port)
        sock.sendall(head + b"a" * (padding + extra) + b"\r\n\r\n")
        raw, _ = until_closed(sock)
        assert response(raw)[0] == status
    # A head well under the limit with a body far over it in the same write: the body is no header bytes.
    body = json.dumps({"input": ["word " * 10_000], "encoding_format": "float"}).encode()
    sock = connect(port)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nConnection: close\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    assert response(until_closed(sock)[0])[0] == 200


# Time


def test_headers_that_stop_arriving_get_408(gateway: tuple[str, int]) -> None:
    url, port = gateway
    before = closed_count(url, "header_timeout")
    with good_requests(url):
        sock = connect(port)
        sock.sendall(b"POST /v1/embe")  # half a request line, and nothing more
        raw, seconds = until_closed(sock)
    assert_error(raw, 408, "request_timeout")
    assert seconds < TIMEOUT + MARGIN
    assert closed_count(url, "header_timeout") == before + 1


@pytest.mark.parametrize("route", ["/v1/embeddings", "/embed", "/rerank", "/v1/rerank", "/score", "/tokenize"])
def test_a_body_shorter_than_its_content_length_gets_408(gateway: tuple[str, int], route: str) -> None:
    url, port = gateway
    before = closed_count(url, "body_timeout")
    with good_requests(url):
        sock = connect(port)
        head = (
            f"POST {route} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"input": "twenty"')  # 18 of the 100 bytes promised
        raw, seconds = until_closed(sock)
    headers = assert_error(raw, 408, "request_timeout")
    assert headers["connection"] == "close" and seconds < TIMEOUT + MARGIN
    assert closed_count(url, "body_timeout") == before + 1


def test_a_body_trickled_a_byte_at_a_time_gets_408(gateway: tuple[str, int]) -> None:
    """A byte every 0.3 s never lets the pause between bytes reach the body timeout; the whole body's deadline (the
    timeout plus a second per 1,000 bytes) cuts it instead, within a few seconds rather than the hours it would
    take to send."""
    url, port = gateway
    before = closed_count(url, "body_too_slow")
    with good_requests(url):
        sock = connect(port)
        head = "POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        sock.sendall(f"{head}Content-Length: 100000\r\n\r\n".encode())
        stop = threading.Event()

        def trickle() -> None:
            while not stop.wait(0.3):
                try:
                    sock.send(b" ")
                except OSError:
                    return

        sender = threading.Thread(target=trickle, daemon=True)
        sender.start()
        try:
            raw, seconds = until_closed(sock)
        finally:
            stop.set()
            sender.join()
    headers = assert_error(raw, 408, "request_timeout")
    assert headers["connection"] == "close" and seconds < TIMEOUT + MARGIN
    assert closed_count(url, "body_too_slow") == before + 1


def test_a_body_left_unread_by_an_answered_route_is_cut(gateway: tuple[str, int]) -> None:
    url, port = gateway
    before = closed_count(url, "body_timeout")
    sock = connect(port)
    sock.sendall(b"POST /v1/models HTTP/1.1\r\nHost: gateway\r\nContent-Length: 100\r\n\r\n{")  # a 405 route
    raw, seconds = until_closed(sock)
    assert_error(raw, 405, "method_not_allowed")
    assert seconds < TIMEOUT + MARGIN
    assert closed_count(url, "body_timeout") == before + 1


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nHost gateway\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n}",  # a good request, then bytes that begin none
    ],
    ids=["request_line", "content_length", "header", "after_a_request"],
)
def test_bytes_that_are_not_http_get_a_json_400(gateway: tuple[str, int], raw: bytes) -> None:
    url, port = gateway
    before = closed_count(url, "invalid_http")
    with good_requests(url):
        sock = connect(port)
        sock.sendall(raw)
        answer, _ = until_closed(sock)
    if raw.startswith(b"GET /health"):
        first, _, answer = answer.partition(b"HTTP/1.1 400")  # the good request's answer comes first
        assert first.startswith(b"HTTP/1.1 200") and answer
        answer = b"HTTP/1.1 400" + answer
    assert_error(answer, 400, "invalid_http")
    assert closed_count(url, "invalid_http") == before + 1


def test_a_connection_answered_before_its_body_ended_is_idle_from_the_bodys_end(gateway: tuple[str, int]) -> None:
    """A route may answer before reading the body (a 405 here; a 401, a 413, an overload 429): once the rest of
    the body has come, the connection is an idle keep-alive one, its idle time counted from then."""
    url, port = gateway
    before = closed_count(url, "idle_timeout")
    sock = connect(port)
    started = time.monotonic()
    sock.sendall(b"POST /v1/models HTTP/1.1\r\nHost: gateway\r\nContent-Length: 10\r\n\r\n{")
    time.sleep(0.7 * TIMEOUT)  # answered meanwhile; the body's rest comes within the body timeout
    sock.sendall(b'"a": 123}')
    body_ended = time.monotonic()
    raw, _ = until_closed(sock)
    closed_after = time.monotonic() - body_ended
    assert_error(raw, 405, "method_not_allowed")
    assert TIMEOUT * 0.9 <= closed_after < TIMEOUT + MARGIN, (closed_after, body_ended - started)
    assert closed_count(url, "idle_timeout") == before + 1


def test_a_silent_connection_and_an_idle_keep_alive_one_are_closed(gateway: tuple[str, int]) -> None:
    url, port = gateway
    before = closed_count(url, "idle_timeout")
    with good_requests(url):
        silent = connect(port)
        assert until_closed(silent)[0] == b""  # closed without a word: it asked nothing
    kept = connect(port)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
    raw, seconds = until_closed(kept)
    assert response(raw)[0] == 200 and seconds < TIMEOUT + MARGIN
    assert closed_count(url, "idle_timeout") >= before + 2


# Count

CAP = 1000  # the crowd's gateway's --max-connections
BUSY_HEAD = (
    b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\nContent-Length: 100\r\n"
    b"Expect: 100-continue\r\n\r\n"
)


class Idle(asyncio.Protocol):
    """A connection that sends nothing."""

    def __init__(self) -> None:
        self.closed = False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True


class Busy(asyncio.Protocol):
    """A request in progress that cannot finish: its head sent with Expect: 100-continue, its body never. The
    gateway's `100 Continue` says the route is reading the body, so the request is in progress for certain."""

    def __init__(self) -> None:
        self.reading = asyncio.get_running_loop().create_future()
        self.received = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(BUSY_HEAD)

    def data_received(self, data: bytes) -> None:
        self.received += data
        if b"100 Continue" in self.received and not self.reading.done():
            self.reading.set_result(True)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.reading.done():
            self.reading.set_result(False)


async def open_many(port: int, count: int, protocol: type[asyncio.Protocol]) -> list[tuple[asyncio.Transport, Any]]:
    """`count` connections, opened in batches the listen backlog holds."""
    loop = asyncio.get_running_loop()
    opened: list[tuple[asyncio.Transport, Any]] = []
    for start in range(0, count, 500):
        batch = [loop.create_connection(protocol, "127.0.0.1", port) for _ in range(min(500, count - start))]
        opened += await asyncio.gather(*batch)
    return opened


async def eventually(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.1)


def connections_open(url: str) -> float:
    """The gateway's gauge; infinite while it refuses the asking connection for want of room."""
    try:
        text = urllib.request.urlopen(f"{url}/metrics", timeout=30).read().decode()
    except urllib.error.HTTPError as error:
        assert error.code == 503
        return float("inf")
    return float(re.search(r"^bouquet_gateway_connections_open (\S+)$", text, re.MULTILINE).group(1))


def refusal(port: int) -> bytes:
    """What a new connection gets when every connection is busy (it sends its request, as a client would)."""
    sock = connect(port)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
    return until_closed(sock)[0]


async def crowd(url: str, port: int, count: int) -> None:
    idle = await open_many(port, count, Idle)
    # Past the cap each new connection closed the one idle longest; what is left open is at most the cap.
    await eventually(lambda: sum(not p.closed for _, p in idle) <= CAP)
    assert (await asyncio.to_thread(embed, url, TEXTS))[0] == 200  # a new client, served at the cap
    assert await asyncio.to_thread(closed_count, url, "evicted") >= count - CAP
    for transport, _ in idle:
        transport.close()
    await eventually(lambda: connections_open(url) <= 1)  # just the /metrics one
    busy = await open_many(port, CAP, Busy)
    try:
        assert all(await asyncio.gather(*(p.reading for _, p in busy)))
        headers = assert_error(await asyncio.to_thread(refusal, port), 503, "too_many_connections")
        assert headers["retry-after"] == "1"
        status, body = await asyncio.to_thread(embed, url, TEXTS)  # a good client is refused fairly too
        assert status == 503 and body["error"]["code"] == "too_many_connections"
    finally:
        for transport, _ in busy:
            transport.close()
    await eventually(lambda: connections_open(url) <= 1)
    assert (await asyncio.to_thread(embed, url, TEXTS))[0] == 200


@contextmanager
def open_file_limit() -> Iterator[int]:
    """The soft open-file limit raised to the hard one while the block runs (the gateway started in it inherits
    it); yields it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_a_crowd_of_idle_connections_makes_room_and_a_busy_one_is_refused_503(replica: str) -> None:
    with open_file_limit() as limit:
        count = min(20_000, limit) - 300  # as many as this process may open, less its own descriptors
        assert count > 2 * CAP, f"the open-file limit {limit} is too low for this test"
        # Long timeouts: here nothing may close for time, only for room; and more requests may be answered at
        # once than there are connections, so every busy connection keeps its request in progress.
        process, url, port = running_gateway(
            replica, "--max-connections", str(CAP), "--idle-timeout", "300", "--body-timeout", "300",
            "--header-timeout", "300", "--max-concurrent-requests", str(4 * CAP),
        )  # fmt: skip
        try:
            started = time.monotonic()
            asyncio.run(crowd(url, port, count))
            print(f"crowd: {count} idle connections, cap {CAP}, {time.monotonic() - started:.1f} s")
            assert closed_count(url, "refused") >= 2
        finally:
            assert process.stop() == 0


def read_response(sock: socket.socket) -> bytes:
    """One whole response (headers and a Content-Length body), read as the client would while it still sends."""
    received = b""
    while b"\r\n\r\n" not in received:
        piece = sock.recv(65536)
        assert piece, received
        received += piece
    head, _, body = received.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        piece = sock.recv(65536)
        assert piece, received
        body += piece
    return head + b"\r\n\r\n" + body


def test_a_client_still_sending_an_over_limit_body_reads_its_413(gateway: tuple[str, int]) -> None:
    """The 413 goes out before the body ends; the client, still sending, must be able to read it whole: the
    gateway reads and drops what follows (a lingering close) rather than closing on unread bytes, whose reset would
    make the client's stack drop the answer."""
    _, port = gateway
    size = 10 * 1024 * 1024
    sock = connect(port)
    sock.sendall(f"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {size}\r\n\r\n".encode())  # fmt: skip
    piece, sent = b" " * 65536, 0
    with sock:
        while sent < size:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable:
                break
            sent += sock.send(piece[: size - sent])
        answer = read_response(sock)
    assert_error(answer, 413, "payload_too_large")


def test_expect_100_continue_over_the_limit_gets_413_and_the_body_is_never_a_request(
    gateway: tuple[str, int],
) -> None:
    """curl's way: headers with `Expect: 100-continue`, then the body only if 100 Continue comes. A 413 comes
    instead; a client that sends the body anyway must not see it parsed as a next request (a 400)."""
    _, port = gateway
    sock = connect(port)
    sock.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                 b"Expect: 100-continue\r\nContent-Length: 10485760\r\n\r\n")  # fmt: skip
    answer = read_response(sock)
    assert_error(answer, 413, "payload_too_large")
    try:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n" + b"x" * 100_000)
    except (BrokenPipeError, ConnectionResetError):
        return
    rest, _ = until_closed(sock)
    assert b"HTTP/1.1 400" not in rest and b"HTTP/1.1 200" not in rest, rest[:300]


def test_a_responses_head_and_body_arrive_in_one_read(gateway: tuple[str, int]) -> None:
    """The head and the body leave in one send (http/held_writes.py): a client waiting on the connection wakes once
    for the whole answer. uvicorn alone wrote them apart, and the client's first read held the head only."""
    _, port = gateway
    body = json.dumps({"input": "one short query", "model": "all-MiniLM-L6-v2"}).encode()
    request = (f"POST /v1/embeddings HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip
    with connect(port) as sock:
        for _ in range(20):  # one keep-alive connection, as a client of one query at a time holds it
            sock.sendall(request)
            first = sock.recv(1 << 20)
            head, _, rest = first.partition(b"\r\n\r\n")
            status, headers, _ = response(head + b"\r\n\r\n{}")
            assert status == 200, first[:300]
            assert len(rest) == int(headers["content-length"]), f"the first read held {len(rest)} body bytes"
            assert json.loads(rest)["data"][0]["embedding"]
