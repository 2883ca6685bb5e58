"""HTTPS for clients of `bouquet.ray_serve`, as docs/scaling.md configures it: Ray Serve's proxy given a certificate
and key in `http_options` (Ray 2.60's `ssl_certfile`, `ssl_keyfile`; certificates made by openssl with a CA of the
test's). A client that trusts the CA gets the answers `bouquet serve`'s gateway gives; plain HTTP on the port, and a
client that does not trust the CA, get none. Needs a Ray cluster of its own: the proxy's options are the Serve
instance's, set when it starts."""

from __future__ import annotations

import shutil
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[serve]' (the test extras pin it)")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'ray[serve]'")
openai = pytest.importorskip("openai")

import test_ray_serve as shared  # noqa: E402
from conftest import row_cosines  # noqa: E402
from ray_start import init_local_ray  # noqa: E402
from test_replica_tls import make_certificates  # noqa: E402

from bouquet.gateway.testing import free_port  # noqa: E402
from bouquet.ray_serve import app  # noqa: E402

pytestmark = [
    pytest.mark.long,
    pytest.mark.process,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed"),
]
texts, reference = shared.texts, shared.reference  # fixtures: the same texts and reference answers


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_certificates(tmp_path_factory.mktemp("ray-https"))  # "replica.pem": a server certificate for 127.0.0.1


@pytest.fixture(scope="module")
def port(certificates: Path) -> Iterator[int]:
    """A Ray cluster whose Serve proxy speaks HTTPS only, with the application deployed: the proxy's port."""
    init_local_ray(
        num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": shared._source()}},
    )  # fmt: skip
    try:
        port = free_port()
        tls = {"ssl_certfile": str(certificates / "replica.pem"), "ssl_keyfile": str(certificates / "replica.key")}
        serve.start(http_options={"host": "127.0.0.1", "port": port, **tls})
        serve.run(app({**shared.ARGS, "min_replicas": "1", "max_replicas": "1"}), name="https", route_prefix="/")
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_https_answers_as_bouquet_serve_and_plain_http_gets_nothing(
    port: int, certificates: Path, texts: list[str], reference: dict[str, Any]
) -> None:
    trusted = httpx.Client(verify=ssl.create_default_context(cafile=str(certificates / "ca.pem")), timeout=120)
    url = f"https://127.0.0.1:{port}/v1"
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, http_client=trusted)
    rows = np.array([item.embedding for item in client.embeddings.create(model=shared.MODEL, input=texts).data])
    assert row_cosines(rows.astype(np.float32), shared._rows(reference["embeddings"])).min() >= 0.99999
    with pytest.raises(httpx.TransportError):  # the proxy answers no plain HTTP on its port
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):  # nor a client that trusts another CA
        httpx.get(f"https://127.0.0.1:{port}/health", timeout=10)
