"""The in-flight token cap end to end: the real gateway and a replica in this process (tests/in_process.py), a long
request holding the cap, a second bulk one turned away with 429 and Retry-After while a one-text query still gets in
(short requests have a lane of their own), and service back once the first is done."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import corpus
from in_process import served

from bouquet.engine.engine import Engine


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    data = json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, {k.lower(): v for k, v in error.headers.items()}, json.loads(error.read())


def _in_flight_tokens(base: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    lines = [line for line in text.splitlines() if line.startswith("bouquet_gateway_tokens_in_flight")]
    return sum(float(line.split()[-1]) for line in lines)


def test_over_the_in_flight_cap_is_429_with_retry_after_then_recovers(minilm_path: Path, minilm_fp32: Engine) -> None:
    options = {"model_dirs": (minilm_path,), "max_inflight_tokens": 1000, "admission_wait": 0}
    with served([minilm_fp32], listen=True, **options) as running, ThreadPoolExecutor(1) as pool:
        base = running.url
        long = pool.submit(_post, f"{base}/v1/embeddings", {"input": corpus.documents(48)})  # ~6,000 tokens
        deadline = time.monotonic() + 30
        while _in_flight_tokens(base) == 0:
            assert time.monotonic() < deadline, "the long request never got in"
            time.sleep(0.01)
        status, _, body = _post(f"{base}/v1/embeddings", {"input": "a query gets in while the cap is held"})
        assert status == 200 and len(body["data"]) == 1
        status, headers, body = _post(f"{base}/v1/embeddings", {"input": corpus.documents(16)})
        assert status == 429
        assert headers.get("retry-after") == "1"
        assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "rate_limit_error"
        assert long.result(timeout=120)[0] == 200
        status, _, body = _post(f"{base}/v1/embeddings", {"input": "served again once the cap is free"})
        assert status == 200 and len(body["data"][0]["embedding"]) == 384
