"""`bouquet.ray_serve` on a local Ray cluster of 2 CPUs: the application `serve run bouquet.ray_serve:app` starts,
reached over real HTTP through Ray Serve's proxy. Its answers are those of the gateway `bouquet serve` runs (the
same app in this process, in front of this process's engine), and a replica actor killed while requests are in
flight costs none of them: each gets its 200 and its vectors, and Ray Serve's replacement joins the gateway."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import numpy as np
import pytest
from conftest import row_cosines
from corpus import NON_ASCII_TEXTS, documents, queries
from in_process import api
from test_replica_tls import make_certificates

ray = pytest.importorskip("ray", reason="Ray is not installed: pip install 'ray[serve]' (the test extras pin it)")
serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install 'ray[serve]'")
openai = pytest.importorskip("openai")

from ray_start import init_local_ray  # noqa: E402

import bouquet  # noqa: E402
from bouquet.gateway.testing import free_port  # noqa: E402
from bouquet.proto import embedding_pb2, embedding_pb2_grpc  # noqa: E402
from bouquet.ray_serve import app  # noqa: E402
from bouquet.ray_serve import registry as registry_module  # noqa: E402
from bouquet.ray_serve.autoscaling import DemandPolicy  # noqa: E402
from bouquet.ray_serve.config import app_config  # noqa: E402
from bouquet.ray_serve.registry import LEASE_SECONDS, Demand, Registry  # noqa: E402

APP = "bouquet"
MODEL = "all-MiniLM-L6-v2"
# Two replicas of one CPU each, float32 as the reference engine; no start-up build of oneDNN's primitives (its
# seconds are the replicas' to spend on requests here).
ARGS = {"dtype": "float32", "device": "cpu", "cpu_warmup_tokens": "0", "min_replicas": "2", "max_replicas": "2"}


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A Ray cluster of its own with Ray Serve's proxy on a free port: the URL."""
    init_local_ray(
        num_cpus=2, object_store_memory=300 * 2**20, include_dashboard=False,
        runtime_env={"env_vars": {"PYTHONPATH": _source()}},  # the workers import this bouquet
    )  # fmt: skip
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _source() -> str:
    """PYTHONPATH with this bouquet first, whatever the process's sys.path."""
    return os.pathsep.join([str(Path(bouquet.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])


@pytest.fixture(scope="module")
def url(cluster: str) -> str:
    """The application deployed as `serve run` deploys it."""
    _deploy(cluster, ARGS, APP)
    return cluster


def _deploy(url: str, args: dict[str, str], name: str) -> None:
    """`serve.run`, whose return means the application answers: each gateway's startup waited for a healthy replica
    (ray_serve/gateway.py), so `/health` is 200 on every gateway at once, never 503. Only the proxy's route may lag
    (404 from Ray Serve's proxy), which is waited out."""
    serve.run(app(args), name=name, route_prefix="/")
    deadline = time.monotonic() + 30.0
    while (status := httpx.get(f"{url}/health", timeout=10).status_code) == 404 and time.monotonic() < deadline:
        time.sleep(0.1)
    statuses = [status] + [httpx.get(f"{url}/health", timeout=10).status_code for _ in range(7)]
    assert statuses == [200] * 8, statuses


@pytest.fixture(scope="module")
def texts() -> list[str]:
    return [text for pair in zip(documents(24), queries(24), strict=True) for text in pair] + list(NON_ASCII_TEXTS)


@pytest.fixture(scope="module")
def reference(minilm_fp32, minilm_path: Path, texts: list[str]) -> dict[str, Any]:
    """What the gateway of `bouquet serve` answers for the texts, with its model directory, in this process."""
    with api([minilm_fp32], model_dirs=(minilm_path,)) as client:
        embeddings = client.post("/v1/embeddings", json={"input": texts, "model": MODEL}).json()
        tei = client.post("/embed", json={"inputs": texts[:4]}).json()
        models = client.get("/v1/models").json()
        missing = client.post("/v1/embeddings", json={"input": "a", "model": "nope"})
    return {"embeddings": embeddings, "tei": tei, "models": models, "missing": (missing.status_code, missing.json())}


def _rows(body: dict[str, Any]) -> np.ndarray:
    return np.array([item["embedding"] for item in body["data"]], dtype=np.float32)


def _without_times(body: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in body.items() if key not in ("id", "created", "data")}


@pytest.mark.long  # a local Ray cluster and three deployments: about half a minute to start
@pytest.mark.process
def test_answers_as_bouquet_serve(url: str, texts: list[str], reference: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    answer = client.embeddings.create(model=MODEL, input=texts)
    rows = np.array([item.embedding for item in answer.data], dtype=np.float32)
    assert row_cosines(rows, _rows(reference["embeddings"])).min() >= 0.99999
    assert [item.index for item in answer.data] == list(range(len(texts)))
    assert _without_times(answer.model_dump(exclude_none=True)) == _without_times(reference["embeddings"])
    with httpx.Client(base_url=url, timeout=60) as http:
        tei = np.array(http.post("/embed", json={"inputs": texts[:4]}).json(), dtype=np.float32)
        assert row_cosines(tei, np.array(reference["tei"], dtype=np.float32)).min() >= 0.99999
        assert _models(http.get("/v1/models").json()) == _models(reference["models"])
        missing = http.post("/v1/embeddings", json={"input": "a", "model": "nope"})
        assert (missing.status_code, missing.json()) == reference["missing"]
        assert http.get("/health").status_code == 200


def _models(body: dict[str, Any]) -> list[tuple[str, str]]:
    return [(model["id"], model["object"]) for model in body["data"]]


@pytest.mark.long
@pytest.mark.process
def test_a_replica_killed_mid_load_loses_no_request(url: str, texts: list[str], reference: dict[str, Any]) -> None:
    """Four clients without retries send 8 texts a request while one replica actor of two is killed (as the OOM
    killer or a lost node would): every request answered 200 with the reference's vectors; the gateway retried the
    dead replica's chunks elsewhere, and the replica Ray Serve starts in its place joins and computes."""
    expected = _rows(reference["embeddings"])
    before = _replicas()
    load = _Load(url, texts, expected, clients=4).start()
    try:
        time.sleep(3.0)  # both replicas busy
        killed_at = time.monotonic()
        victim = next(iter(before))
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        replacement = _wait_for_replacement(url, before, victim)
        recovered = time.monotonic() - killed_at
        time.sleep(2.0)  # some of the load on the replacement too
    finally:
        load.stop()
    print(f"{load.answered} answered, {len(load.failures)} failed; the replacement served {recovered:.1f} s after")
    assert not load.failures and not load.refused, load.failures[:3]
    assert load.answered >= 20
    metrics = httpx.get(f"{url}/metrics").text
    assert _counter(metrics, "bouquet_gateway_chunk_retries_total") >= 1  # the dead replica's calls, moved
    assert _counter(metrics, "bouquet_gateway_replica_tokens_total", replacement) > 0


@pytest.mark.long
@pytest.mark.process
def test_the_registry_restarted_loses_no_replica_and_no_request(
    url: str, texts: list[str], reference: dict[str, Any]
) -> None:
    """The registry holds its list in memory: killed, Ray Serve restarts it empty. The gateway keeps its replicas
    while the new registry's list is incomplete, the replicas renew into it, and no request meets an empty pool."""
    registry = serve.get_deployment_handle("Registry", app_name=APP)
    before, _ = registry.replicas.remote().result()
    (name,) = [n for n in _actor_names() if n.startswith(f"SERVE_REPLICA::{APP}#Registry#")]
    load = _Load(url, texts, _rows(reference["embeddings"]), clients=2).start()
    try:
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        _wait_until(lambda: registry.replicas.remote().result() == (before, True), 60.0)
        time.sleep(1.0)
    finally:
        load.stop()
    assert not load.failures and not load.refused, load.failures[:3]
    assert load.answered > 0


class _Load:
    """Clients sending requests of `size` texts back to back, each answer checked against the reference's rows;
    a 429 (admission, under overload) counted apart from failures."""

    def __init__(self, url: str, texts: list[str], expected: np.ndarray, clients: int, size: int = 8):
        self._client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        self._texts, self._expected, self._size = texts, expected, size
        self._threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]
        self._stop = threading.Event()
        self.answered = self.refused = 0
        self.failures: list[str] = []

    def start(self) -> _Load:
        for thread in self._threads:
            thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=90)

    def _run(self, client: int) -> None:
        start = client * self._size
        while not self._stop.is_set():
            picked = [(start + i) % len(self._texts) for i in range(self._size)]
            start += 5
            try:
                answer = self._client.embeddings.create(model=MODEL, input=[self._texts[i] for i in picked])
                rows = np.array([item.embedding for item in answer.data], dtype=np.float32)
                if row_cosines(rows, self._expected[picked]).min() < 0.99999:
                    self.failures.append(f"wrong vectors for texts {picked}")
                self.answered += 1
            except openai.RateLimitError:
                self.refused += 1
            except Exception as error:  # what a client sees: another status, a reset, a timeout
                self.failures.append(f"{error!r} from {error.__cause__!r} at {time.monotonic():.2f}")


def _actor_names() -> list[str]:
    return [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]


def _replicas() -> set[str]:
    """The replica actors' names, as Ray Serve names them in its namespace."""
    return {name for name in _actor_names() if name.startswith(f"SERVE_REPLICA::{APP}#BouquetReplica#")}


def _wait_for_replacement(url: str, before: set[str], victim: str, seconds: float = 90.0) -> str:
    """The gRPC address of the replica Ray Serve started for the killed one, once the gateway has sent it work."""
    registry = serve.get_deployment_handle("Registry", app_name=APP)
    known: set[str] | None = None
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        addresses, _ = registry.replicas.remote().result()
        if known is None:
            known = set(addresses)  # the two before the kill (the victim's lease has a few seconds left)
        new = set(addresses) - known
        if new and victim not in _replicas() and len(_replicas() - before) == 1:
            (address,) = new
            if _counter(httpx.get(f"{url}/metrics").text, "bouquet_gateway_replica_tokens_total", address) > 0:
                return address
        time.sleep(0.5)
    raise AssertionError(f"no replacement replica served within {seconds} s")


def _counter(metrics: str, name: str, replica: str | None = None) -> float:
    label = "" if replica is None else r'\{replica="' + re.escape(replica) + r'"\}'
    found = re.search(rf"^{name}{label} (\S+)$", metrics, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


class _Context:
    def __init__(self, replicas: int, ratios: dict[str, float] | None):
        self.current_num_replicas = self.target_num_replicas = replicas
        self.aggregated_metrics = {} if ratios is None else {"demand_ratio": ratios}


def test_the_policy_wants_replicas_for_the_demand_ratio() -> None:
    policy = DemandPolicy(target=0.8)
    assert policy(_Context(2, {"a": 0.8, "b": 0.8}))[0] == 2  # exactly at the target
    assert policy(_Context(2, {"a": 1.5, "b": 1.5}))[0] == 4  # overloaded: the excess over the target
    assert policy(_Context(4, {"a": 0.1}))[0] == 1  # idle: down to one (Ray Serve keeps min_replicas)
    assert policy(_Context(3, None))[0] == 3  # nothing reported yet: unchanged


def test_the_registry_keeps_leases_and_says_when_its_list_is_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Ray: the registry's own logic, on a clock the test moves."""
    clock = [100.0]
    monkeypatch.setattr(registry_module.time, "monotonic", lambda: clock[0])
    registry = Registry.func_or_class()  # the class Ray Serve runs
    run = asyncio.run
    run(registry.renew("r1", "10.0.0.1:5"))
    run(registry.renew("r2", "10.0.0.2:5"))
    assert run(registry.replicas()) == (["10.0.0.1:5", "10.0.0.2:5"], False)  # just started: others may not know it
    clock[0] += LEASE_SECONDS - 0.5
    run(registry.renew("r1", "10.0.0.1:5"))
    run(registry.leave("r3"))  # one it never saw: nothing
    clock[0] += 1.0
    assert run(registry.replicas()) == (["10.0.0.1:5"], True)  # r2's lease ran out; a lease since the start
    run(registry.leave("r1"))
    assert run(registry.replicas()) == ([], True)
    assert run(registry.demand_ratio()) is None
    run(registry.report_demand("g1", Demand(wanted_tokens=3000, limit_tokens=2000)))
    clock[0] += LEASE_SECONDS - 0.5
    run(registry.report_demand("g2", Demand(wanted_tokens=0, limit_tokens=2000)))
    assert run(registry.demand_ratio()) == 0.75  # summed over the gateways
    clock[0] += 1.0
    assert run(registry.demand_ratio()) == 0.0  # g1 stopped reporting: its demand is gone


def test_arguments_as_serve_run_gives_them() -> None:
    config = app_config(
        {"model": "m", "max_batch_tokens": "512", "cuda_graphs": "false", "served_model_names": "a, b",
         "admission_wait": "2.5", "max_replicas": "8", "token_id_input": "no"},
        "token",
    )  # fmt: skip
    assert config.engine == {"model_path": str(Path("m").resolve()), "cuda_graphs": {"enabled": False}}
    assert config.scheduler == {"max_batch_tokens": 512}
    assert config.replica.served_model_names == ("a", "b") and config.replica.token == "token"
    assert config.gateway.admission_wait == 2.5 and not config.gateway.token_id_input
    assert config.gateway.replica_token == "token" and config.gateway.replicas_followed
    assert config.serve.max_replicas == 8 and config.serve.min_replicas == 1
    with pytest.raises(ValueError, match="unknown argument 'port'"):
        app_config({"port": "8000"}, "token")  # Ray Serve's proxy has the port
    with pytest.raises(ValueError, match="argument max_batch_seqs=many"):
        app_config({"max_batch_seqs": "many"}, "token")
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        app_config({"min_replicas": "3", "max_replicas": "2"}, "token")
    with pytest.raises(ValueError, match="needs both ends"):  # a replica over TLS that no gateway could reach
        app_config({"tls_cert": "r.pem", "tls_key": "r.key"}, "token")
    tls = app_config({"tls_cert": "r.pem", "tls_key": "r.key", "replica_tls_ca": "ca.pem",
                      "replica_tls_server_name": "replica.bouquet.test"}, "token")  # fmt: skip
    assert tls.replica.tls_cert == Path("r.pem") and tls.gateway.replica_tls_server_name == "replica.bouquet.test"


def test_the_gateways_actor_imports_no_torch_and_bouquet_no_ray() -> None:
    """The ingress actor imports gateway.py (Ray Serve unpickles its class by name): like every gateway, no torch.
    `import bouquet` and the CLI import no Ray."""
    code = (
        "import sys, bouquet, bouquet.cli; assert 'ray' not in sys.modules, 'ray'; "
        "import bouquet.ray_serve.gateway, bouquet.ray_serve.registry; assert 'torch' not in sys.modules, 'torch'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env={**os.environ, "PYTHONPATH": _source()})


def test_the_cluster_config_file_deploys_the_application_it_says() -> None:
    """deploy/ray-serve/serve-config.yaml: valid for Ray Serve's `serve deploy`, and its arguments build the three
    deployments with its replicas' bounds, resources and policy (no cluster: the application as Ray Serve builds it)."""
    yaml = pytest.importorskip("yaml")
    from ray.serve._private.build_app import build_app  # what `serve deploy` runs on the arguments
    from ray.serve.schema import ServeDeploySchema

    path = Path(__file__).resolve().parent.parent / "deploy" / "ray-serve" / "serve-config.yaml"
    (application,) = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text())).applications
    assert application.import_path == "bouquet.ray_serve:app"
    built = {d.name: d for d in build_app(app(application.args), name=APP).deployments}
    assert set(built) == {"Registry", "BouquetReplica", "BouquetGateway"}
    scaling = built["BouquetReplica"]._deployment_config.autoscaling_config
    assert (scaling.min_replicas, scaling.max_replicas) == (2, 8)
    assert scaling.policy.policy_kwargs == {"target": 0.8}
    assert built["BouquetReplica"].ray_actor_options == {"num_cpus": 4, "num_gpus": 0}
    assert built["BouquetGateway"]._deployment_config.num_replicas == 2
    assert built["BouquetGateway"]._deployment_config.max_ongoing_requests == 512  # admission's limit, not Serve's


# One replica to start, at most two; the admission limit held low (4,096 tokens a lane) so that 8 clients of 32
# texts are several times what it admits: demand over the target at once, without a core's worth of clients.
SCALING = {
    **ARGS, "min_replicas": "1", "max_replicas": "2", "upscale_delay_s": "0", "downscale_delay_s": "5",
    "max_inflight_tokens": "4096",
}  # fmt: skip


@pytest.mark.long
@pytest.mark.process
def test_replicas_follow_the_gateways_demand(cluster: str, texts: list[str], reference: dict[str, Any]) -> None:
    """Overload adds the second replica, which joins and computes; once the load is light again it is removed, and
    the requests sent while it drains lose nothing."""
    with contextlib.suppress(Exception):
        serve.delete(APP)  # the other tests' two replicas hold both CPUs
    _deploy(cluster, SCALING, "scaling")
    assert _running("scaling") == 1
    expected = _rows(reference["embeddings"])
    started = time.monotonic()
    heavy = _Load(cluster, texts, expected, clients=8, size=32).start()
    try:
        _wait_until(lambda: _running("scaling") == 2 and len(_registered("scaling")) == 2, 100.0)
        up = time.monotonic() - started
        _wait_until(lambda: min(_tokens(cluster, a) for a in _registered("scaling")) > 0, 30.0)
    finally:
        heavy.stop()
    assert not heavy.failures, heavy.failures[:3]  # refused (429) under overload, never failed
    stopped = time.monotonic()
    light = _Load(cluster, texts, expected, clients=1, size=1).start()
    try:
        _wait_until(lambda: _running("scaling") == 1, 100.0)
        down = time.monotonic() - stopped
        time.sleep(2.0)
    finally:
        light.stop()
    print(f"up {up:.1f} s after overload began ({heavy.answered} answered, {heavy.refused} refused); down {down:.1f} s "
          f"after it ended ({light.answered} answered while it drained)")  # fmt: skip
    assert not light.failures and not light.refused, light.failures[:3]
    assert light.answered > 0


def _running(name: str) -> int:
    deployment = serve.status().applications[name].deployments["BouquetReplica"]
    return deployment.replica_states.get("RUNNING", 0)


def _registered(name: str) -> list[str]:
    addresses, _ = serve.get_deployment_handle("Registry", app_name=name).replicas.remote().result()
    return list(addresses)


def _tokens(url: str, replica: str) -> float:
    return _counter(httpx.get(f"{url}/metrics").text, "bouquet_gateway_replica_tokens_total", replica)


def _wait_until(condition: Callable[[], bool], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {seconds} s")
        time.sleep(0.5)


@pytest.mark.long
@pytest.mark.process
def test_a_gateway_killed_mid_load_costs_a_retry(cluster: str, texts: list[str], reference: dict[str, Any]) -> None:
    """Two gateways (ingress replicas), four clients, one gateway actor killed (as the OOM killer would). Ray
    Serve's proxy does not retry a request a replica had begun (it cannot know it is idempotent): the requests in
    flight on the killed one are answered 500, or their connection closes. Every embedding request is idempotent, so
    a client that retries a 5xx once, as the openai and cohere SDKs do by default, loses none: each is answered 200
    with the reference's vectors, and requests sent after the kill need no retry (the proxy routes only to the
    gateway left, then also to the one Ray Serve starts in its place). docs/scaling.md says what a client must retry."""
    with contextlib.suppress(Exception):
        serve.delete("scaling")  # the autoscaling test's replicas hold the CPUs
    with contextlib.suppress(Exception):
        serve.delete(APP)
    _deploy(cluster, {**ARGS, "gateways": "2", "min_replicas": "1", "max_replicas": "1"}, "gateways")
    expected = _rows(reference["embeddings"])
    load = _RetryingLoad(cluster, texts, expected, clients=4).start()
    try:
        time.sleep(3.0)
        (victim, *_) = [n for n in _actor_names() if n.startswith("SERVE_REPLICA::gateways#BouquetGateway#")]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        time.sleep(3.0)
        retried_by_then = load.retried
        time.sleep(3.0)
    finally:
        load.stop()
    print(f"{load.answered} answered, {load.retried} retried once ({load.seen}), {len(load.failures)} failed")
    assert not load.failures, load.failures[:3]
    assert load.answered >= 20
    assert load.retried == retried_by_then  # the last 3 s needed no retry: the proxy no longer routes to the dead one
    assert set(load.seen) <= {"500", "502", "503", "closed"}, load.seen


class _RetryingLoad(_Load):
    """`_Load`'s clients over plain HTTP, each request retried once after a 5xx or a closed connection (counted in
    `retried`, what the first answer was in `seen`)."""

    def __init__(self, url: str, texts: list[str], expected: np.ndarray, clients: int, size: int = 8):
        super().__init__(url, texts, expected, clients, size)
        self._url = url
        self.retried = 0
        self.seen: collections.Counter[str] = collections.Counter()

    def _run(self, client: int) -> None:
        start = client * self._size
        with httpx.Client(base_url=self._url, timeout=60) as http:
            while not self._stop.is_set():
                picked = [(start + i) % len(self._texts) for i in range(self._size)]
                start += 5
                body = {"model": MODEL, "input": [self._texts[i] for i in picked]}
                try:
                    reply = self._post(http, body)
                except Exception as error:  # the retry failed too
                    self.failures.append(repr(error))
                    continue
                if reply.status_code != 200:
                    self.failures.append(f"{reply.status_code} {reply.text[:200]}")
                    continue
                if row_cosines(_rows(reply.json()), self._expected[picked]).min() < 0.99999:
                    self.failures.append(f"wrong vectors for texts {picked}")
                self.answered += 1

    def _post(self, http: httpx.Client, body: dict[str, Any]) -> httpx.Response:
        try:
            reply = http.post("/v1/embeddings", json=body)
            if reply.status_code < 500:
                return reply
            self.seen[str(reply.status_code)] += 1
        except httpx.TransportError:
            self.seen["closed"] += 1
        self.retried += 1
        return http.post("/v1/embeddings", json=body)


@pytest.mark.long
@pytest.mark.process
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl is not installed")
def test_tls_between_gateway_and_replicas(
    cluster: str, texts: list[str], reference: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The replicas serve gRPC over TLS with a certificate for a name (made by openssl with a CA of the test's), the
    gateway trusts the CA and checks that name (the replicas listen on their nodes' addresses): the application
    answers as without TLS, and the replica's port refuses a plaintext call."""
    c = make_certificates(tmp_path_factory.mktemp("ray-tls"))
    for name in ("scaling", "gateways", APP):
        with contextlib.suppress(Exception):
            serve.delete(name)  # the CPUs for this one
    tls = {"tls_cert": str(c / "named.pem"), "tls_key": str(c / "named.key"), "replica_tls_ca": str(c / "ca.pem"),
           "replica_tls_server_name": "replica.bouquet.test"}  # fmt: skip
    _deploy(cluster, {**ARGS, **tls, "min_replicas": "1", "max_replicas": "1"}, "tls")
    client = openai.OpenAI(base_url=f"{cluster}/v1", api_key="unused", max_retries=0, timeout=120)
    rows = np.array([item.embedding for item in client.embeddings.create(model=MODEL, input=texts).data], np.float32)
    assert row_cosines(rows, _rows(reference["embeddings"])).min() >= 0.99999
    (address,) = _registered("tls")
    plain = embedding_pb2_grpc.EmbeddingStub(grpc.insecure_channel(address))
    with pytest.raises(grpc.RpcError) as refused:
        plain.Info(embedding_pb2.InfoRequest(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no answer
