"""Image URLs on an IPv6 origin, and the fetches in the gateway's /metrics: a tiny CLIP behind the real gateway (in
process), an http.server on [::1] serving image files. The listed literal `http://[::1]:PORT` is fetched, however a
URL spells the address, equal to the same image inline; the same port over IPv4 or as an IPv4-mapped address is not
the listed origin; a listed name resolving to loopback is refused. /metrics counts the URLs fetched and their bytes,
and each refusal by its reason (not listed, inward address, unreachable, a bad answer, too large, no origin listed),
every reason present at 0 from the start."""

from __future__ import annotations

import functools
import http.server
import socket
import threading
from collections.abc import Iterator

import httpx
import numpy as np
import pytest
from in_process import engines, served
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families
from test_image_api import _data_uri, _file, _image, _rows
from test_mixed_image_inputs import CLIP, QuietFiles, clip  # noqa: F401 (clip: the module's tiny CLIP fixture)

from bouquet.engine.engine import Engine
from bouquet.gateway.fetch_answer import REFUSALS

MAX_IMAGE_BYTES = 200_000
FILES = {"0.png": _file(_image(50, 80, 0)), "1.png": _file(_image(33, 21, 1))}
LARGE = np.random.default_rng(0).integers(0, 256, (400, 400, 3), dtype=np.uint8)


class _V6Server(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6
    daemon_threads = True


@pytest.fixture(scope="module")
def v6_origin(tmp_path_factory) -> Iterator[str]:
    root = tmp_path_factory.mktemp("v6-images")
    for name, data in FILES.items():
        (root / name).write_bytes(data)
    (root / "large.png").write_bytes(_file(Image.fromarray(LARGE)))
    server = _V6Server(("::1", 0), functools.partial(QuietFiles, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://[::1]:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def engine(clip) -> Iterator[Engine]:  # noqa: F811
    with engines(clip[0]) as built:
        yield built[0]


@pytest.fixture(scope="module")
def gateway(engine: Engine, v6_origin: str) -> Iterator[httpx.Client]:
    closed = "http://[::1]:1"  # listed, nothing listening: unreachable
    origins = (v6_origin, closed, "http://localhost:" + v6_origin.rsplit(":", 1)[1])  # a name resolving to loopback
    with served([engine], max_image_bytes=MAX_IMAGE_BYTES, image_url_origins=origins) as running:
        yield running.client


def _fetch_metrics(client: httpx.Client) -> dict[str, float]:
    """The fetch counters: fetches, bytes, and each reason's refusals, by name."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name.startswith("bouquet_gateway_image_fetch") and sample.name.endswith("_total"):
                values[sample.labels.get("reason", sample.name)] = sample.value
    return values


def _embed(client: httpx.Client, url: str) -> httpx.Response:
    return client.post("/embeddings_image", json={"model": CLIP, "input": [url]})


def test_an_ipv6_literal_origin_is_fetched_in_any_spelling(gateway: httpx.Client, v6_origin: str) -> None:
    port = v6_origin.rsplit(":", 1)[1]
    inline = _rows(_embed(gateway, _data_uri(FILES["0.png"])))
    for origin in (v6_origin, f"http://[0:0:0:0:0:0:0:1]:{port}", f"http://[::0001]:{port}"):
        np.testing.assert_allclose(_rows(_embed(gateway, f"{origin}/0.png")), inline, atol=1e-6)


@pytest.mark.parametrize(
    ("url", "code", "reason"),
    [
        ("http://127.0.0.1:{port}/0.png", "image_url_refused", "not_listed"),  # the port over IPv4: not listed
        ("http://[::ffff:127.0.0.1]:{port}/0.png", "image_url_refused", "not_listed"),
        ("http://localhost:{port}/0.png", "image_url_refused", "inward_address"),
        ("http://[::1]:1/0.png", "image_url_failed", "unreachable"),
        ("{origin}/missing.png", "image_url_failed", "bad_answer"),
        ("{origin}/large.png", "image_too_large", "too_large"),
    ],
)
def test_refusals_are_400s_counted_by_reason(
    gateway: httpx.Client, v6_origin: str, url: str, code: str, reason: str
) -> None:
    before = _fetch_metrics(gateway)
    response = _embed(gateway, url.format(origin=v6_origin, port=v6_origin.rsplit(":", 1)[1]))
    assert response.status_code == 400, response.text
    assert (response.json()["error"]["code"], response.json()["error"]["param"]) == (code, "input[0]")
    after = _fetch_metrics(gateway)
    assert {key: after[key] - before[key] for key in after if after[key] != before[key]} == {reason: 1}


def test_fetches_and_their_bytes_are_counted(gateway: httpx.Client, v6_origin: str) -> None:
    before = _fetch_metrics(gateway)
    assert set(REFUSALS) <= set(before)  # every reason shown, at 0 before its first refusal
    response = gateway.post("/embeddings_image", json={"model": CLIP, "input": [
        f"{v6_origin}/0.png", f"{v6_origin}/1.png", _data_uri(FILES["1.png"])]})  # fmt: skip
    assert response.status_code == 200, response.text
    after = _fetch_metrics(gateway)
    fetches, fetched_bytes = "bouquet_gateway_image_fetches_total", "bouquet_gateway_image_fetch_bytes_total"
    assert after[fetches] - before[fetches] == 2  # the inline image is no fetch
    assert after[fetched_bytes] - before[fetched_bytes] == len(FILES["0.png"]) + len(FILES["1.png"])


def test_a_url_with_no_origin_listed_counts_as_no_origins(engine: Engine) -> None:
    with served([engine], max_image_bytes=MAX_IMAGE_BYTES) as running:
        before = _fetch_metrics(running.client)
        response = _embed(running.client, "http://[::1]:9/0.png")
        assert response.status_code == 400 and response.json()["error"]["code"] == "image_url_refused"
        assert _fetch_metrics(running.client)["no_origins"] - before["no_origins"] == 1
