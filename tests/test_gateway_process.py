"""`bouquet gateway` as its own process in front of a real replica of all-MiniLM-L6-v2 served from a directory
the gateway is not given, so the tokenizer comes through the replica's Info; and `--workers N` as processes."""

from __future__ import annotations

import json
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import corpus
import numpy as np
import openai
import pytest
from conftest import row_cosines

from bouquet.gateway.testing import Process, children, free_port, start_gateway, start_replica, wait_healthy

pytestmark = pytest.mark.process  # every test starts bouquet processes

MODEL = "all-MiniLM-L6-v2"  # the replica's directory name, so its Info names the model so
API_KEY = "test-key"
TEXTS = [*corpus.documents(6), *corpus.queries(3), *corpus.NON_ASCII_TEXTS[:3]]


def linked_copy(source: Path, target: Path) -> Path:
    """The model under another directory name, its files linked rather than copied."""
    target.mkdir()
    for path in source.iterdir():
        (target / path.name).symlink_to(path)
    return target


@pytest.fixture(scope="module")
def replica(minilm_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model_dir = linked_copy(minilm_path, tmp_path_factory.mktemp("models") / MODEL)
    port = free_port()
    process = start_replica(port, "--model", str(model_dir), "--dtype", "float32")
    try:
        process.wait_ready()
        yield f"127.0.0.1:{port}"
    finally:
        process.stop()


@pytest.fixture(scope="module")
def gateway(replica: str) -> Iterator[str]:
    port = free_port()
    process: Process = start_gateway(port, [replica], "--api-key", API_KEY)  # no --model
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_ready()
        wait_healthy(url)
        yield url
    finally:
        assert process.stop() == 0


def post(url: str, body: dict) -> object:
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


def get(url: str) -> tuple[int, str, bytes]:
    """Status, content type and body, without the API key."""
    with urllib.request.urlopen(url, timeout=30) as reply:
        return reply.status, reply.headers.get("content-type", ""), reply.read()


def in_flight(url: str) -> float:
    request = urllib.request.Request(f"{url}/metrics", headers={"Authorization": f"Bearer {API_KEY}"})
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    match = re.search(r"^bouquet_gateway_requests_in_flight (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_text_through_a_gateway_without_the_model_matches_sentence_transformers(gateway, sentence_transformer):
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    response = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    rows = np.array([item.embedding for item in response.data], np.float32)
    expected = sentence_transformer.encode(TEXTS, convert_to_numpy=True)
    assert rows.shape == expected.shape
    assert row_cosines(rows, expected).min() >= 0.99999
    assert response.usage.prompt_tokens > len(TEXTS)


def test_tokenize_through_a_gateway_without_the_model(gateway):
    tokens = post(f"{gateway}/tokenize", {"inputs": ["hello world"], "model": MODEL})
    assert [token["id"] for token in tokens[0]] == [101, 7592, 2088, 102]
    assert tokens[0][1] == {"id": 7592, "text": "hello", "special": False, "start": 0, "stop": 5}


def test_docs_load_nothing_from_outside_and_need_no_api_key(gateway):
    status, content_type, page = get(f"{gateway}/docs")
    assert status == 200 and content_type.startswith("text/html")
    html = page.decode()
    assert not re.search(r"https?:|//", html), "an external URL in /docs"
    assets = re.findall(r'(?:href|src)="([^"]+)"', html)
    assert sorted(assets) == ["/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"]
    expected_types = {".css": "text/css", ".js": "text/javascript"}
    for asset in assets:
        status, content_type, body = get(f"{gateway}{asset}")
        assert status == 200 and content_type.split(";")[0] == expected_types[Path(asset).suffix], asset
        assert len(body) > 100_000  # Swagger UI itself, not an error page
    assert b"SwaggerUIBundle" in get(f"{gateway}/docs/swagger-ui-bundle.js")[2]
    assert get(f"{gateway}/openapi.json")[0] == 200
    with pytest.raises(urllib.error.HTTPError) as missing:
        get(f"{gateway}/docs/index.html")  # only the page's own assets are served
    assert missing.value.code == 404


@pytest.mark.long  # CI's long tier: the default run stays within its ~10 minutes
def test_workers_share_the_port_and_sigterm_drains_them(replica):
    port = free_port()
    parent = start_gateway(port, [replica], "--workers", "2", "--api-key", API_KEY)
    url = f"http://127.0.0.1:{port}"
    try:
        parent.wait_ready()  # every worker listens, each only once it has heard its replica's model
        with ThreadPoolExecutor(8) as pool:  # at once, on fresh connections the kernel spreads over both workers
            answers = list(pool.map(lambda _: post(f"{url}/v1/embeddings", {"input": "x", "model": MODEL}), range(16)))
        assert [len(answer["data"]) for answer in answers] == [1] * 16  # none a 503 "no replica has reported"
        workers = [command for command in children(parent.process.pid) if "bouquet.cli gateway" in command]
        assert len(workers) == 2
        assert not any("--workers" in command or API_KEY in command for command in workers)
        with ThreadPoolExecutor(1) as pool:
            call = pool.submit(post, f"{url}/v1/embeddings", {"input": corpus.documents(64), "model": MODEL})
            deadline = time.monotonic() + 60
            while in_flight(url) < 2:  # the request and this /metrics call, summed over both workers
                assert time.monotonic() < deadline, "the request never arrived"
                # Ended before it was seen in flight: its own error (or answer) says why, not a 60 s timeout.
                assert not call.done(), f"the request ended before it was seen in flight: {call.result()!r:.300}"
            parent.process.send_signal(signal.SIGTERM)
            try:
                answer = call.result()
            except urllib.error.HTTPError as error:  # which refusal, and what the workers logged (seen once, 503)
                pytest.fail(f"HTTP {error.code} {error.read()[:300]!r} during the drain; log: {parent.lines[-30:]}")
            assert len(answer["data"]) == 64  # finished, not cut
        assert parent.process.wait(timeout=60) == 0
        with pytest.raises(urllib.error.URLError):  # no worker is left on the port
            get(f"{url}/health")
    finally:
        parent.stop()


def test_a_drain_too_short_for_the_work_answers_503_not_500(replica):
    """SIGTERM with a request that cannot finish within `--drain-seconds`: it is cancelled and answered 503 with
    Retry-After (its client retries elsewhere), the gateway logs no failure and exits 0. Before, uvicorn cancelled
    it at the drain's end and answered 500 while the replicas' channels closed under its pending chunks."""
    port = free_port()
    gateway = start_gateway(port, [replica], "--api-key", API_KEY, "--drain-seconds", "1")
    url = f"http://127.0.0.1:{port}"
    try:
        gateway.wait_ready()
        wait_healthy(url)
        with ThreadPoolExecutor(1) as pool:  # ~60,000 tokens: many seconds on a CPU replica, far over the drain
            call = pool.submit(post, f"{url}/v1/embeddings", {"input": corpus.documents(512), "model": MODEL})
            deadline = time.monotonic() + 60
            while in_flight(url) < 2:
                assert time.monotonic() < deadline, "the request never arrived"
                assert not call.done(), f"the request ended before it was seen in flight: {call.result()!r:.300}"
            gateway.process.send_signal(signal.SIGTERM)
            with pytest.raises(urllib.error.HTTPError) as refused:
                call.result()
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
        assert json.loads(refused.value.read())["error"]["code"] == "shutting_down"
        assert gateway.process.wait(timeout=60) == 0
        assert not [line for line in gateway.lines if "Exception in ASGI application" in line or "Traceback" in line]
    finally:
        gateway.stop()
