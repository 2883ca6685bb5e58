"""deploy/kubernetes/: every kustomization rendered by the real kustomize (`kubectl kustomize`, or a `kustomize`
binary), every object validated offline against the Kubernetes API's schemas (kubernetes-validate, strict: an
unknown field is an error), and what ties the objects to each other and to bouquet checked: selectors and labels,
ports against the flags, probes against the endpoints bouquet really serves, every flag against bouquet's own
parser, drain times against grace periods, references to the ConfigMap and Secret, and the images against the
Dockerfile. KEDA's and prometheus-operator's objects are validated against those projects' own CRD schemas
(tests/crd_schemas/, copied from their repositories), strictly too, and every metric their queries name is one
bouquet exports. No cluster is involved: what a cluster does with them (scheduling, DNS, probing, scaling,
alerting) is not tested here."""

from __future__ import annotations

import argparse
import asyncio
import base64
import functools
import json
import math
import os
import re
import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bouquet import cli
from bouquet.config import GatewayConfig, ReplicaConfig

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
AUTOSCALED = ("examples/keda", "examples/prometheus-adapter")  # the replicas' count follows demand
KUSTOMIZATIONS = ("base", "overlays/cpu", "overlays/gpu", "examples/model-pvc", *AUTOSCALED)
DEPLOYABLE = KUSTOMIZATIONS[1:]  # base has no image or resources of its own
CRD_SCHEMAS = ROOT / "tests" / "crd_schemas"
MONITORING_NAMESPACE = "monitoring"  # where the NetworkPolicy expects Prometheus
NAMESPACE = "bouquet"
# Native gRPC probes are GA from 1.27: the oldest Kubernetes the manifests are for, validated besides the newest.
OLDEST_KUBERNETES = "1.27.0"
TEST_SECRETS = {"api-key": "test-api-key", "replica-token": "test-replica-token"}

Doc = dict[str, Any]


def _kustomize() -> list[str] | None:
    if path := shutil.which("kustomize"):
        return [path, "build"]
    if path := shutil.which("kubectl"):
        return [path, "kustomize"]
    return None


def _render(tree: Path, name: str) -> subprocess.CompletedProcess[str]:
    command = _kustomize()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is on PATH: the kustomizations cannot be rendered")
    return subprocess.run([*command, str(tree / name)], capture_output=True, text=True, timeout=120, check=False)


def _copy_tree(tmp: Path, with_secrets: bool) -> Path:
    tree = tmp / "kubernetes"
    shutil.copytree(DEPLOY, tree, ignore=shutil.ignore_patterns("secrets.env"))
    if with_secrets:  # what an operator writes from secrets.env.example
        (tree / "base" / "secrets.env").write_text("".join(f"{k}={v}\n" for k, v in TEST_SECRETS.items()))
    return tree


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Doc]]:
    tree = _copy_tree(tmp_path_factory.mktemp("k8s"), with_secrets=True)
    out = {}
    for name in KUSTOMIZATIONS:
        result = _render(tree, name)
        assert result.returncode == 0, f"rendering {name} failed:\n{result.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    return out


# --- reading the rendered objects -------------------------------------------------------------------------------


def _all(docs: list[Doc], kind: str) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind]


def _one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [doc for doc in _all(docs, kind) if doc["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def _container(deployment: Doc) -> Doc:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"{deployment['metadata']['name']}: one container expected"
    return containers[0]


def _quantity(value: str | int) -> float:
    """A CPU quantity ("2", "500m") in cores."""
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _env(container: Doc, docs: list[Doc]) -> dict[str, str]:
    """The container's environment as the kubelet resolves it: values, ConfigMap and Secret keys, and the CPU limit
    for resourceFieldRef (rounded up, as the kubelet does); a reference that does not resolve fails here."""
    values: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            values[var["name"]] = var["value"]
        elif ref := source.get("configMapKeyRef"):
            data = _one(docs, "ConfigMap", ref["name"])["data"]
            assert ref["key"] in data, f"ConfigMap {ref['name']} has no key {ref['key']}"
            values[var["name"]] = data[ref["key"]]
        elif ref := source.get("secretKeyRef"):
            data = _one(docs, "Secret", ref["name"])["data"]
            assert ref["key"] in data, f"Secret {ref['name']} has no key {ref['key']}"
            values[var["name"]] = base64.b64decode(data[ref["key"]]).decode()
        elif ref := source.get("resourceFieldRef"):
            assert ref["containerName"] == container["name"]
            kind, _, resource = ref["resource"].partition(".")
            quantity = container.get("resources", {}).get(kind, {}).get(resource)
            if quantity is not None:  # unset: the node's allocatable CPU, known only on a node
                values[var["name"]] = str(math.ceil(_quantity(quantity) / _quantity(ref.get("divisor", "1"))))
        else:
            pytest.fail(f"{container['name']}: env {var['name']} comes from a source this test does not resolve")
    return values


def _args(container: Doc, docs: list[Doc]) -> list[str]:
    """The container's args with $(VAR) expanded from its environment, as the kubelet expands them."""
    assert "command" not in container, "the image's ENTRYPOINT (bouquet) is what runs; args are its arguments"
    env = _env(container, docs)
    args = [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg) for arg in container["args"]]
    unresolved = [arg for arg in args if "$(" in arg]
    assert not unresolved, f"{container['name']}: args reference variables it does not define: {unresolved}"
    return args


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return commands.choices[command]


def _parse(args: list[str]) -> argparse.Namespace:
    """bouquet's own parser on the args. Each flag must be spelled in full (argparse would take an abbreviation)
    and as --flag=value, so that a value is never read as a flag."""
    command, *flags = args
    known = _subparser(command)._option_string_actions
    for arg in flags:
        assert arg.startswith("--"), f"bouquet {command}: {arg!r} is not a --flag=value"
        flag = arg.split("=", 1)[0]
        assert flag in known, f"{flag} is not a flag of `bouquet {command}`"
    try:
        return cli.build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"`bouquet {' '.join(args)}` does not parse (argparse's message is above)")


def _deployment(docs: list[Doc], component: str) -> Doc:
    return _one(docs, "Deployment", f"bouquet-{component}")


def _parsed(docs: list[Doc], component: str) -> argparse.Namespace:
    container = _container(_deployment(docs, component))
    args = _parse(_args(container, docs))
    assert args.command == component
    return args


def _container_port(container: Doc, port: int | str) -> int:
    """A probe's or a Service's port, by number or by the container port's name."""
    ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
    if isinstance(port, str):
        assert port in ports, f"{container['name']} has no port named {port}"
        return ports[port]
    assert port in ports.values(), f"{container['name']} does not expose port {port}"
    return port


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _sleep_seconds(container: Doc) -> float:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep" and len(command) == 2, f"{container['name']}: preStop should be a plain sleep"
    return float(command[1])


def _dockerfile_stages() -> dict[str, list[str]]:
    """Each named stage's lines."""
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if match := re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.IGNORECASE):
            current = stages.setdefault(match[1] or f"#{len(stages)}", [])
        current.append(line)
    return stages


MONITORING = [
    ("ServiceMonitor", "bouquet-gateway"),
    ("PodMonitor", "bouquet-replica"),
    ("PrometheusRule", "bouquet"),
]


@functools.cache
def _crd_schemas() -> dict[tuple[str, str], Doc]:
    """Each custom resource's openAPIV3Schema by (apiVersion, kind), as its CRD declares it."""
    schemas = {}
    for path in sorted(CRD_SCHEMAS.glob("*.json")):
        crd = json.loads(path.read_text())
        schemas[crd["apiVersion"], crd["kind"]] = crd["schema"]
    return schemas


def _strict(schema: Any) -> Any:
    """The schema with unknown fields refused wherever it lists its fields, as `kubectl apply --validate=strict`
    refuses them (a structural schema would otherwise prune them silently)."""
    if isinstance(schema, list):
        return [_strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {key: _strict(value) for key, value in schema.items()}
    lists_fields = "properties" in schema and "additionalProperties" not in schema
    if lists_fields and not schema.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


def _least_replicas(docs: list[Doc]) -> int:
    """The fewest replicas there will be: the autoscaler's minimum where one owns the count (and the Deployment
    then states none, or re-applying it would reset the count), else the Deployment's."""
    replica = _deployment(docs, "replica")["spec"]
    scaled = [d["spec"]["minReplicaCount"] for d in _all(docs, "ScaledObject")]
    scaled += [
        d["spec"]["minReplicas"] for d in _all(docs, "HorizontalPodAutoscaler") if "replica" in d["metadata"]["name"]
    ]
    if scaled:
        assert "replicas" not in replica, "an autoscaled Deployment must not state its count"
        [least] = scaled
        return least
    return replica["replicas"]


def _pod_specs(docs: list[Doc]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d["spec"]["template"]["spec"] for d in _all(docs, "Deployment")}


# --- the tests ----------------------------------------------------------------------------------------------------


def test_render_refuses_without_secrets(tmp_path: Path) -> None:
    """base/secrets.env is not in git: until an operator writes it, no overlay renders, so the example's
    placeholder keys can never be deployed by mistake."""
    tree = _copy_tree(tmp_path, with_secrets=False)
    for name in DEPLOYABLE:
        result = _render(tree, name)
        assert result.returncode != 0 and "secrets.env" in result.stderr, result.stderr
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", "deploy/kubernetes/base/secrets.env"], cwd=ROOT, check=False
    ).returncode
    assert ignored == 0, "base/secrets.env must be git-ignored"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_objects_match_the_kubernetes_schemas(rendered: dict[str, list[Doc]], name: str) -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate (pip, the test extra) validates offline; not installed"
    )
    from kubernetes_validate.utils import latest_version

    newest = f"{latest_version()}.0"
    for doc in rendered[name]:
        if (doc["apiVersion"], doc["kind"]) in _crd_schemas():
            continue  # not the Kubernetes API's: test_custom_resources_match_their_crd_schemas
        for version in (OLDEST_KUBERNETES, newest):
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(f"{name}: {doc['kind']} {doc['metadata']['name']} is invalid in {version}: {error}")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_expected_objects_in_one_namespace(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    kinds = sorted((doc["kind"], re.sub(r"-[a-z0-9]{10}$", "", doc["metadata"]["name"])) for doc in docs)
    assert kinds == sorted(
        [
            ("Namespace", NAMESPACE),
            ("ConfigMap", "bouquet-config"),  # generated: the name carries its contents' hash
            ("Secret", "bouquet-secrets"),
            ("Deployment", "bouquet-replica"),
            ("Service", "bouquet-replicas"),
            ("PodDisruptionBudget", "bouquet-replica"),
            ("Deployment", "bouquet-gateway"),
            ("Service", "bouquet-gateway"),
            ("HorizontalPodAutoscaler", "bouquet-gateway"),
            ("PodDisruptionBudget", "bouquet-gateway"),
            ("NetworkPolicy", "bouquet-default-deny"),
            ("NetworkPolicy", "bouquet-replica"),
            ("NetworkPolicy", "bouquet-gateway"),
            *([("PersistentVolumeClaim", "bouquet-models")] if name == "examples/model-pvc" else []),
            *(MONITORING if name in AUTOSCALED else []),
            *([("ScaledObject", "bouquet-replica")] if name == "examples/keda" else []),
            *([("HorizontalPodAutoscaler", "bouquet-replica")] if name == "examples/prometheus-adapter" else []),
        ]
    )
    for doc in docs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, doc["metadata"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bouquet"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_selectors_match_their_pods(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in _all(docs, "Deployment")}
    for deployment in _all(docs, "Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert _selects(selector, pods[deployment["metadata"]["name"]])
        others = [other for other, labels in pods.items() if other != deployment["metadata"]["name"]]
        assert not any(_selects(selector, pods[other]) for other in others), "Deployments' pods must not overlap"
    expected = {
        ("Service", "bouquet-replicas"): "bouquet-replica",
        ("Service", "bouquet-gateway"): "bouquet-gateway",
        ("PodDisruptionBudget", "bouquet-replica"): "bouquet-replica",
        ("PodDisruptionBudget", "bouquet-gateway"): "bouquet-gateway",
    }
    for (kind, object_name), target in expected.items():
        spec = _one(docs, kind, object_name)["spec"]
        selector = spec["selector"] if kind == "Service" else spec["selector"]["matchLabels"]
        assert [pod for pod, labels in pods.items() if _selects(selector, labels)] == [target], (kind, object_name)
    hpa = _one(docs, "HorizontalPodAutoscaler", "bouquet-gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "bouquet-gateway"}
    for policy in _all(docs, "NetworkPolicy"):
        selector = policy["spec"]["podSelector"].get("matchLabels", {})
        selected = [pod for pod, labels in pods.items() if _selects(selector, labels)]
        name_ = policy["metadata"]["name"]
        assert selected == (sorted(pods) if name_ == "bouquet-default-deny" else [name_]), name_
    for monitor in _all(docs, "PodMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert [pod for pod, labels in pods.items() if _selects(selector, labels)] == ["bouquet-replica"]
    services = {d["metadata"]["name"]: d["metadata"]["labels"] for d in _all(docs, "Service")}
    for monitor in _all(docs, "ServiceMonitor"):
        selector = monitor["spec"]["selector"]["matchLabels"]
        assert [s for s, labels in services.items() if _selects(selector, labels)] == ["bouquet-gateway"]
    for scaled in _all(docs, "ScaledObject"):
        assert scaled["spec"]["scaleTargetRef"] == {"name": "bouquet-replica"}, "a Deployment (KEDA's default kind)"
    if name == "examples/prometheus-adapter":
        target = _one(docs, "HorizontalPodAutoscaler", "bouquet-replica")["spec"]["scaleTargetRef"]
        assert target == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "bouquet-replica"}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_ports_match_the_flags(rendered: dict[str, list[Doc]], name: str) -> None:
    docs = rendered[name]
    replica, gateway = _deployment(docs, "replica"), _deployment(docs, "gateway")
    replica_args, gateway_args = _parsed(docs, "replica"), _parsed(docs, "gateway")

    # The replica: gRPC on --listen's port, on every address of the pod; metrics on --metrics-port.
    host, _, port = replica_args.listen.rpartition(":")
    assert host in ("0.0.0.0", "[::]"), "the replica must listen on the pod's addresses, not loopback"
    listen_port = int(port)
    assert _container_port(_container(replica), "grpc") == listen_port
    assert _container_port(_container(replica), "metrics") == replica_args.metrics_port
    headless = _one(docs, "Service", "bouquet-replicas")["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    [service_port] = headless["ports"]
    assert service_port["port"] == listen_port
    assert _container_port(_container(replica), service_port["targetPort"]) == listen_port

    # The gateway: HTTP on --port, behind the Service's port 80; it finds the replicas through the headless
    # Service, by a name that resolves to it from this namespace, on the port the replicas listen on.
    assert gateway_args.host in ("0.0.0.0", "::")
    assert _container_port(_container(gateway), "http") == gateway_args.port
    [http] = _one(docs, "Service", "bouquet-gateway")["spec"]["ports"]
    assert http["port"] == 80
    assert _container_port(_container(gateway), http["targetPort"]) == gateway_args.port
    assert not gateway_args.replicas, "the gateways find the replicas by DNS, not by fixed address"
    for target in gateway_args.replicas_dns:
        dns_name, _, dns_port = target.rpartition(":")
        names = ("bouquet-replicas", f"bouquet-replicas.{NAMESPACE}", f"bouquet-replicas.{NAMESPACE}.svc")
        assert dns_name in (*names, f"bouquet-replicas.{NAMESPACE}.svc.cluster.local"), dns_name
        assert int(dns_port) == service_port["port"]

    # Prometheus scrapes each pod where its metrics are.
    for deployment, metrics_port in ((replica, replica_args.metrics_port), (gateway, gateway_args.port)):
        notes = deployment["spec"]["template"]["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert int(notes["prometheus.io/port"]) == metrics_port
        assert notes["prometheus.io/path"] == "/metrics"
        assert _container_port(_container(deployment), int(notes["prometheus.io/port"])) == metrics_port


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_configs_build_from_the_flags(
    rendered: dict[str, list[Doc]], name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The parsed flags build bouquet's configs as `bouquet replica` and `bouquet gateway` would (their checks
    included), with the Secret's token in the environment and its API key in the file the pod mounts."""
    docs = rendered[name]
    replica = _container(_deployment(docs, "replica"))
    monkeypatch.setenv("BOUQUET_REPLICA_TOKEN", _env(replica, docs)["BOUQUET_REPLICA_TOKEN"])
    sections = cli.replica_sections(_parsed(docs, "replica"))
    engine = cli.engine_config(sections["engine"])
    cli.scheduler_config(sections["scheduler"], engine.device)
    assert cli.replica_config(sections["replica"]).token == TEST_SECRETS["replica-token"]

    gateway = _container(_deployment(docs, "gateway"))
    assert _env(gateway, docs)["BOUQUET_REPLICA_TOKEN"] == TEST_SECRETS["replica-token"], "one shared token"
    args = _parsed(docs, "gateway")
    key_file = tmp_path / "api-key"
    key_file.write_text(_secret_file(docs, gateway, args.api_key_file))
    args.api_key_file = key_file
    config = cli.gateway_config(args)
    assert config.api_key == TEST_SECRETS["api-key"]
    assert config.replica_token == TEST_SECRETS["replica-token"]


def _secret_file(docs: list[Doc], container: Doc, path: Path) -> str:
    """What the pod finds at `path`: the Secret key a volume of the pod mounts there."""
    pod = next(d for d in _all(docs, "Deployment") if container in d["spec"]["template"]["spec"]["containers"])
    volumes = {v["name"]: v for v in pod["spec"]["template"]["spec"]["volumes"]}
    for mount in container["volumeMounts"]:
        if path.parent == Path(mount["mountPath"]) and "secret" in volumes[mount["name"]]:
            source = volumes[mount["name"]]["secret"]
            item = next(item for item in source["items"] if item["path"] == path.name)
            data = _one(docs, "Secret", source["secretName"])["data"]
            return base64.b64decode(data[item["key"]]).decode()
    pytest.fail(f"nothing mounts a Secret at {path}")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_replica_probes_ask_its_health_service(rendered: dict[str, list[Doc]], name: str) -> None:
    """The gRPC probes go to --listen's port and ask for a service the replica's health server knows (a real
    ReplicaServer, no engine: NOT_SERVING, as while a model loads), without the replica token, as the kubelet
    does; liveness goes to the same port."""
    from bouquet.replica.server import ReplicaServer

    docs = rendered[name]
    container = _container(_deployment(docs, "replica"))
    listen_port = int(_parsed(docs, "replica").listen.rpartition(":")[2])
    grpc_probes = [container[p]["grpc"] for p in ("startupProbe", "readinessProbe")]
    assert all(probe["port"] == listen_port for probe in grpc_probes)
    assert _container_port(container, container["livenessProbe"]["tcpSocket"]["port"]) == listen_port

    async def statuses() -> list[int]:
        server = ReplicaServer("127.0.0.1:0", token=TEST_SECRETS["replica-token"])
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = health_pb2_grpc.HealthStub(channel)
                return [
                    (await stub.Check(health_pb2.HealthCheckRequest(service=probe.get("service", "")))).status
                    for probe in grpc_probes
                ]
        finally:
            await server.stop(0)

    assert asyncio.run(statuses()) == [health_pb2.HealthCheckResponse.NOT_SERVING] * len(grpc_probes)


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_gateway_probes_hit_its_routes(rendered: dict[str, list[Doc]], name: str, tmp_path: Path) -> None:
    """The gateway's probe and scrape paths are routes of the app the manifest's flags build, answered without an
    API key (the kubelet and Prometheus send none). With no replica reachable, /health is 503 (readiness: out of
    the Service) while liveness still passes (no restart loop while the replicas are down)."""
    from starlette.testclient import TestClient

    from bouquet.gateway.app import create_app

    docs = rendered[name]
    container = _container(_deployment(docs, "gateway"))
    args = _parsed(docs, "gateway")
    key_file = tmp_path / "api-key"
    key_file.write_text(_secret_file(docs, container, args.api_key_file))
    args.api_key_file = key_file
    asyncio.set_event_loop(asyncio.new_event_loop())  # grpc.aio channels need one; an earlier asyncio.run cleared it
    app = create_app(cli.gateway_config(args))  # not started (no lifespan): no replica is reached
    client = TestClient(app)
    readiness, liveness = container["readinessProbe"]["httpGet"], container["livenessProbe"]["httpGet"]
    for probe in (readiness, liveness):
        assert _container_port(container, probe["port"]) == args.port
    assert readiness["path"] == "/health"
    assert client.get(readiness["path"]).status_code == 503
    assert client.get(liveness["path"]).status_code == 200
    scrape = _deployment(docs, "gateway")["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"]
    assert client.get(scrape).status_code == 200
    assert client.post("/v1/embeddings", json={"input": "x"}).status_code == 401, "the API key is required"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_grace_covers_prestop_and_drain(rendered: dict[str, list[Doc]], name: str) -> None:
    """terminationGracePeriodSeconds counts from the start of preStop: it must cover the sleep and bouquet's whole
    drain. And a liveness probe must not be able to kill a container inside its drain."""
    docs = rendered[name]
    defaults = {"replica": ReplicaConfig.drain_seconds, "gateway": GatewayConfig.drain_seconds}
    for component, default in defaults.items():
        deployment = _deployment(docs, component)
        container = _container(deployment)
        args = _parsed(docs, component)
        drain = args.drain_seconds if args.drain_seconds is not None else default
        sleep = _sleep_seconds(container)
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert sleep > 0 and grace > sleep + drain, (component, grace, sleep, drain)
        liveness = container["livenessProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= drain, component
        assert "readinessProbe" in container
    # A replica may take minutes to load: a startup probe holds liveness off until it serves.
    startup = _container(_deployment(docs, "replica"))["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_gpu_overlay_asks_for_a_gpu(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["overlays/gpu"]
    replica = _deployment(docs, "replica")
    limits = _container(replica)["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) >= 1
    args = _parsed(docs, "replica")
    assert (args.device, args.dtype) == ("cuda", "bfloat16")
    # No spare GPU assumed: a rollout must not wait for one.
    assert replica["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    assert "nvidia.com/gpu" not in str(_container(_deployment(docs, "gateway")).get("resources", {}))


def test_model_example_mounts_what_it_names(rendered: dict[str, list[Doc]]) -> None:
    """--model names a directory inside a read-only mount of a PersistentVolumeClaim that is rendered with it."""
    docs = rendered["examples/model-pvc"]
    replica = _deployment(docs, "replica")
    model = Path(_parsed(docs, "replica").model_path)
    volumes = {v["name"]: v for v in replica["spec"]["template"]["spec"]["volumes"]}
    [mount] = [m for m in _container(replica)["volumeMounts"] if model.is_relative_to(m["mountPath"])]
    assert mount["readOnly"] and model != Path(mount["mountPath"])
    claim = volumes[mount["name"]]["persistentVolumeClaim"]
    assert claim["readOnly"]
    assert _one(docs, "PersistentVolumeClaim", claim["claimName"])["spec"]["accessModes"] == ["ReadOnlyMany"]
    assert _parsed(rendered["overlays/cpu"], "replica").model_path is None, "the overlays serve the image's model"


def test_cpu_overlay_sizes_the_replica(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["overlays/cpu"]
    container = _container(_deployment(docs, "replica"))
    assert "nvidia.com/gpu" not in str(docs)
    assert _parsed(docs, "replica").device == "cpu"
    resources = container["resources"]
    assert resources["requests"] == resources["limits"], "Guaranteed QoS: whole cores for torch's threads"
    # torch's thread count follows the CPU limit, not the node's cores.
    assert _env(container, docs)["OMP_NUM_THREADS"] == str(math.ceil(_quantity(resources["limits"]["cpu"])))


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_scaling_leaves_room_for_disruptions(rendered: dict[str, list[Doc]], name: str) -> None:
    """A PodDisruptionBudget that asks for every pod blocks node drains forever: each component runs more pods
    than its budget keeps. The HPA owns the gateways' count (the Deployment states none) and needs a CPU request."""
    docs = rendered[name]
    hpa = _one(docs, "HorizontalPodAutoscaler", "bouquet-gateway")["spec"]
    gateway = _deployment(docs, "gateway")
    assert "replicas" not in gateway["spec"]
    assert "cpu" in _container(gateway)["resources"]["requests"]
    assert [m["resource"]["name"] for m in hpa["metrics"]] == ["cpu"]
    counts = {"bouquet-gateway": hpa["minReplicas"], "bouquet-replica": _least_replicas(docs)}
    for pdb in _all(docs, "PodDisruptionBudget"):
        assert counts[pdb["metadata"]["name"]] > pdb["spec"]["minAvailable"], pdb["metadata"]["name"]


@pytest.mark.parametrize("name", DEPLOYABLE)
def test_images_are_the_dockerfiles(rendered: dict[str, list[Doc]], name: str) -> None:
    """Each image is REGISTRY/bouquet:VERSION-TARGET for this package's version and a target the Dockerfile
    builds: CUDA for the GPU overlay's replicas, CPU for everything else. The pods run as the image's user."""
    docs = rendered[name]
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    stages = _dockerfile_stages()
    for component in ("replica", "gateway"):
        deployment = _deployment(docs, component)
        image = _container(deployment)["image"]
        target = "cuda" if (name, component) == ("overlays/gpu", "replica") else "cpu"
        assert re.fullmatch(rf"[\w.\-/:]+/bouquet:{re.escape(version)}-{target}", image), image
        lines = stages[target]
        assert 'ENTRYPOINT ["bouquet"]' in lines
        [user] = [line.split()[1] for line in lines if line.startswith("USER ")]
        security = deployment["spec"]["template"]["spec"]["securityContext"]
        assert user == f"{security['runAsUser']}:{security['runAsGroup']}" and security["runAsNonRoot"]


@pytest.mark.parametrize("name", AUTOSCALED)
def test_custom_resources_match_their_crd_schemas(rendered: dict[str, list[Doc]], name: str) -> None:
    """KEDA's ScaledObject and prometheus-operator's ServiceMonitor, PodMonitor and PrometheusRule against the
    openAPIV3Schema of the CRDs those projects ship (tests/crd_schemas/, each file naming its source and commit),
    with unknown fields refused. Only the CRD's schema: what a controller checks beyond it (PromQL syntax) is not."""
    import jsonschema

    schemas = _crd_schemas()
    custom = [doc for doc in rendered[name] if (doc["apiVersion"], doc["kind"]) in schemas]
    assert {doc["kind"] for doc in custom} >= {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
    for doc in custom:
        validator = jsonschema.Draft4Validator(_strict(schemas[doc["apiVersion"], doc["kind"]]))
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{doc['kind']} {doc['metadata']['name']}: {errors}"


# The prometheus scaler's metadata keys (kedacore/keda, pkg/scalers/prometheus_scaler.go, prometheusMetadata):
# the CRD takes any string map, so a misspelt key would only show in KEDA's log.
KEDA_PROMETHEUS_KEYS = {
    "serverAddress", "query", "queryParameters", "threshold", "activationThreshold", "namespace", "customHeaders",
    "ignoreNullValues", "unsafeSsl", "awsRegion", "timeout", "identityOwner",
}  # fmt: skip


def _queries(docs: list[Doc]) -> list[str]:
    """Every PromQL expression the manifests hold: the ScaledObject's and the alert rules'."""
    queries = [t["metadata"]["query"] for d in _all(docs, "ScaledObject") for t in d["spec"]["triggers"]]
    rules = [r for d in _all(docs, "PrometheusRule") for g in d["spec"]["groups"] for r in g["rules"]]
    return queries + [rule["expr"] for rule in rules]


def _exported_metrics() -> set[str]:
    """The sample names bouquet's gateways and replicas expose, as Prometheus stores them."""
    from bouquet.gateway.metrics import GatewayMetrics
    from bouquet.replica.metrics import ReplicaMetrics

    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_count", "_sum"], "gauge": [""]}
    families = [*GatewayMetrics().registry.collect(), *ReplicaMetrics().registry.collect()]
    return {family.name + suffix for family in families for suffix in suffixes[family.type]}


def _demand_ratio(docs: list[Doc]) -> str:
    [scaled] = _all(docs, "ScaledObject")
    [trigger] = scaled["spec"]["triggers"]
    return trigger["metadata"]["query"]


def test_autoscaling_reads_the_demand_bouquet_exports(rendered: dict[str, list[Doc]]) -> None:
    """The ScaledObject's prometheus trigger uses only keys KEDA reads, scales on the demand ratio as a Value (so
    the HPA multiplies the current count by ratio / threshold) and never to zero; every metric a query or an alert
    names is one bouquet exports, in the namespace the objects are rendered into. The prometheus-adapter example's
    rule is the same query and its HPA reads the metric that rule names."""
    docs = rendered["examples/keda"]
    [scaled] = _all(docs, "ScaledObject")
    [trigger] = scaled["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "Value"
    assert set(trigger["metadata"]) <= KEDA_PROMETHEUS_KEYS, set(trigger["metadata"]) - KEDA_PROMETHEUS_KEYS
    assert 0 < float(trigger["metadata"]["threshold"]) < 1, "below 1: headroom before admission refuses"
    assert scaled["spec"]["minReplicaCount"] >= 1 and "idleReplicaCount" not in scaled["spec"]
    assert scaled["spec"]["fallback"]["replicas"] >= scaled["spec"]["minReplicaCount"]
    exported = _exported_metrics()
    for name in AUTOSCALED:
        for query in _queries(rendered[name]) or [_demand_ratio(docs)]:
            named = set(re.findall(r"\bbouquet_\w+", query))
            assert named and named <= exported, f"not exported by bouquet: {named - exported}"
            assert set(re.findall(r'namespace="([^"]*)"', query)) == {NAMESPACE}, query

    values = yaml.safe_load((DEPLOY / "examples" / "prometheus-adapter" / "adapter-values.yaml").read_text())
    [rule] = values["rules"]["external"]
    hpa = _one(rendered["examples/prometheus-adapter"], "HorizontalPodAutoscaler", "bouquet-replica")["spec"]
    [metric] = hpa["metrics"]
    assert metric["type"] == "External" and metric["external"]["metric"]["name"] == rule["name"]["as"]
    assert metric["external"]["target"]["type"] == "Value"
    as_keda = (
        rule["metricsQuery"].replace(" by (<<.GroupBy>>) ", "").replace("<<.LabelMatchers>>", 'namespace="bouquet"')
    )
    assert as_keda.split() == _demand_ratio(docs).split(), "one demand ratio for both"


@pytest.mark.parametrize("name", AUTOSCALED)
def test_monitors_scrape_the_metrics_ports(rendered: dict[str, list[Doc]], name: str) -> None:
    """The ServiceMonitor's port is the gateway Service's port onto --port (where /metrics is a route, checked by
    test_gateway_probes_hit_its_routes), the PodMonitor's is the replica container's port for --metrics-port."""
    docs = rendered[name]
    [service_monitor] = _all(docs, "ServiceMonitor")
    [endpoint] = service_monitor["spec"]["endpoints"]
    [service_port] = [
        p for p in _one(docs, "Service", "bouquet-gateway")["spec"]["ports"] if p["name"] == endpoint["port"]
    ]
    gateway = _container(_deployment(docs, "gateway"))
    assert _container_port(gateway, service_port["targetPort"]) == _parsed(docs, "gateway").port
    [pod_monitor] = _all(docs, "PodMonitor")
    [endpoint_] = pod_monitor["spec"]["podMetricsEndpoints"]
    replica = _container(_deployment(docs, "replica"))
    assert _container_port(replica, endpoint_["port"]) == _parsed(docs, "replica").metrics_port
    assert endpoint["path"] == endpoint_["path"] == "/metrics"


def _policy_ports(rule: Doc, container: Doc) -> set[int]:
    return {_container_port(container, port["port"]) for port in rule["ports"]}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_network_policies_open_only_what_is_used(rendered: dict[str, list[Doc]], name: str) -> None:
    """Ingress is denied to every pod but for: the replicas' gRPC port from the gateways' pods only, their metrics
    port from the monitoring namespace only, and the gateways' HTTP port from anywhere."""
    docs = rendered[name]
    deny = _one(docs, "NetworkPolicy", "bouquet-default-deny")["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"] and not deny.get("ingress")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in _all(docs, "Deployment")}
    replica, gateway = _container(_deployment(docs, "replica")), _container(_deployment(docs, "gateway"))
    rules = _one(docs, "NetworkPolicy", "bouquet-replica")["spec"]["ingress"]
    opened = {}
    for rule in rules:
        [source] = rule["from"]
        assert set(source) in ({"podSelector"}, {"namespaceSelector"}), "one kind of peer a rule"
        for port in _policy_ports(rule, replica):
            opened[port] = source
    listen_port = int(_parsed(docs, "replica").listen.rpartition(":")[2])
    metrics_port = _parsed(docs, "replica").metrics_port
    assert set(opened) == {listen_port, metrics_port}
    gateways = [
        pod for pod, labels in pods.items() if _selects(opened[listen_port]["podSelector"]["matchLabels"], labels)
    ]
    assert gateways == ["bouquet-gateway"]
    assert opened[metrics_port] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": MONITORING_NAMESPACE}}
    }
    [http] = _one(docs, "NetworkPolicy", "bouquet-gateway")["spec"]["ingress"]
    assert "from" not in http and _policy_ports(http, gateway) == {_parsed(docs, "gateway").port}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_meet_the_restricted_pod_security_standard(rendered: dict[str, list[Doc]], name: str) -> None:
    """The namespace enforces Pod Security's "restricted" profile, and every pod template meets its rules (as
    kubernetes.io/docs/concepts/security/pod-security-standards lists them), so admission will not refuse one."""
    docs = rendered[name]
    labels = _one(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}  # fmt: skip
    for deployment, pod in _pod_specs(docs).items():
        assert not any(pod.get(key) for key in ("hostNetwork", "hostPID", "hostIPC")), deployment
        assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"]["type"] in ("RuntimeDefault", "Localhost")
        for volume in pod["volumes"]:
            assert set(volume) - {"name"} <= allowed_volumes, (deployment, volume)
        for container in pod["containers"] + pod.get("initContainers", []):
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and not security.get("privileged")
            assert security["capabilities"]["drop"] == ["ALL"]
            assert set(security["capabilities"].get("add", [])) <= {"NET_BIND_SERVICE"}
            assert not any(port.get("hostPort") for port in container.get("ports", []))


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pods_spread_over_nodes_and_bound_their_scratch(rendered: dict[str, list[Doc]], name: str) -> None:
    """Each Deployment spreads its own pods over nodes (kubernetes.io/hostname) and zones; the replicas on CPU
    nodes must be on different nodes (DoNotSchedule), GPU replicas and gateways prefer it. Every emptyDir has a
    sizeLimit, so a runaway cache evicts its pod rather than fill the node's disk."""
    docs = rendered[name]
    for deployment in _all(docs, "Deployment"):
        pod = deployment["spec"]["template"]
        spreads = {c["topologyKey"]: c for c in pod["spec"]["topologySpreadConstraints"]}
        assert set(spreads) == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        for constraint in spreads.values():
            assert constraint["maxSkew"] == 1
            assert _selects(constraint["labelSelector"]["matchLabels"], pod["metadata"]["labels"])
        required = deployment["metadata"]["name"] == "bouquet-replica" and name != "overlays/gpu"
        expected = "DoNotSchedule" if required else "ScheduleAnyway"
        assert spreads["kubernetes.io/hostname"]["whenUnsatisfiable"] == expected, deployment["metadata"]["name"]
        for volume in pod["spec"]["volumes"]:
            if "emptyDir" in volume:
                assert _quantity_bytes(volume["emptyDir"]["sizeLimit"]) > 0, volume


def _quantity_bytes(value: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
    return int(value[:-2]) * units[value[-2:]] if value[-2:] in units else int(value)


def test_gpu_overlay_runs_a_gateway_worker_a_core(rendered: dict[str, list[Doc]]) -> None:
    """docs/scaling.md: a GPU replica needs several gateway cores, with --workers equal to the gateway's cores.
    Requests equal limits, so the HPA's utilisation target is of whole cores the workers use."""
    docs = rendered["overlays/gpu"]
    gateway = _container(_deployment(docs, "gateway"))
    resources = gateway["resources"]
    cores = _quantity(resources["limits"]["cpu"])
    assert _quantity(resources["requests"]["cpu"]) == cores >= 2
    assert _parsed(docs, "gateway").workers == cores
    assert _parsed(rendered["overlays/cpu"], "gateway").workers == 1, "a CPU deployment's replicas need the cores"


# --- the image ----------------------------------------------------------------------------------------------------
# Built with podman and run with the CPU overlay's own arguments (ports renumbered, host network). Only as root,
# with podman and runc on PATH, and a base image at hand: $BOUQUET_TEST_BASE_IMAGE, else python:3.11-slim where it
# can be pulled, else a Debian bookworm with Python 3.11 that debootstrap makes (cached as TEST_BASE). Where pip
# reaches its index through a proxy with its own CA, or keeps wheels in $PIP_FIND_LINKS, the build gets those too.

TEST_BASE = "localhost/bouquet-test-base:bookworm"
TEST_IMAGE = "localhost/bouquet:test-cpu"


def _podman(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and result.returncode != 0:
        pytest.fail(f"podman {' '.join(args[:3])} ... failed:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    return result


def _base_image(tmp: Path) -> str:
    if base := os.environ.get("BOUQUET_TEST_BASE_IMAGE"):
        return base
    if _podman("image", "exists", TEST_BASE, check=False).returncode == 0:
        return TEST_BASE
    if _podman("pull", "docker.io/library/python:3.11-slim-bookworm", timeout=600, check=False).returncode == 0:
        return "docker.io/library/python:3.11-slim-bookworm"
    if shutil.which("debootstrap") is None:
        pytest.skip("no base image: python:3.11-slim cannot be pulled here and debootstrap is not installed")
    rootfs = tmp / "rootfs"
    subprocess.run(
        ["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates", "bookworm", str(rootfs)],
        capture_output=True, timeout=1200, check=True,
    )  # fmt: skip
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    subprocess.run(["podman", "import", "-", TEST_BASE], stdin=tar.stdout, capture_output=True, timeout=600, check=True)
    assert tar.wait() == 0
    return TEST_BASE


def _build_args(tmp: Path) -> list[str]:
    """The host's CA bundle and local wheel directories, lent to the build's RUN steps (never kept in the image);
    with torch's CPU wheel among those wheels, PyPI as torch's index (the +cpu wheel wins over PyPI's CUDA one)."""
    mounts, conf = [], ["[global]"]
    cert = Path("/etc/ssl/certs/ca-certificates.crt")
    if cert.exists():
        mounts += ["-v", f"{cert}:{cert}:ro"]
        conf.append(f"cert = {cert}")
    links = [d for d in os.environ.get("PIP_FIND_LINKS", "").split() if Path(d).is_dir()]
    for directory in links:
        mounts += ["-v", f"{directory}:{directory}:ro"]
    if links:
        conf.append(f"find-links = {' '.join(links)}")
    (tmp / "pip.conf").write_text("\n".join(conf) + "\n")
    mounts += ["-v", f"{tmp / 'pip.conf'}:/etc/pip.conf:ro"]
    if any(Path(d).glob("torch-2.13.0+cpu-*.whl") for d in map(Path, links)):
        mounts += ["--build-arg", "TORCH_CPU_INDEX_URL=https://pypi.org/simple"]
    return mounts


def _http(method: str, url: str, body: bytes | None = None, key: str | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    headers = {"content-type": "application/json", **({"authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, body, headers, method=method), timeout=30) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()
    except OSError:
        return 0, b""


@pytest.mark.slow
def test_image_builds_and_runs_the_manifests_args(rendered: dict[str, list[Doc]], tmp_path: Path) -> None:
    """The Dockerfile's cpu target, built, then run as the CPU overlay runs it: a replica and a gateway with the
    rendered args and environment (ports renumbered for the host network), read-only root filesystem, /tmp a
    tmpfs, the API key file mounted where the Secret is. The gateway finds the replica by DNS name and embeds; the
    replica's gRPC health (what the kubelet probes) says SERVING; each drains and exits 0 on SIGTERM, at once
    when idle; the pods' user is the image's."""
    import json
    import time

    from bouquet.gateway.testing import free_port

    if os.geteuid() != 0 or not shutil.which("podman") or not shutil.which("runc"):
        pytest.skip("needs root, podman and runc (Debian's packages)")
    base = _base_image(tmp_path)
    build = [
        "build", "--isolation", "chroot", "--network", "host", "--target", "cpu", "--build-arg",
        f"BASE_IMAGE={base}", *_build_args(tmp_path), "-t", TEST_IMAGE, str(ROOT),
    ]  # fmt: skip
    result = _podman(*build, timeout=1800, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    docs = rendered["overlays/cpu"]
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    renumber = {
        "--listen=0.0.0.0:50051": f"--listen=0.0.0.0:{grpc_port}",
        "--metrics-port=9100": f"--metrics-port={metrics_port}",
        "--port=8080": f"--port={http_port}",
        "--replicas-dns=bouquet-replicas:50051": f"--replicas-dns=localhost:{grpc_port}",
    }
    key_file = tmp_path / "api-key"
    key_file.write_text(TEST_SECRETS["api-key"])
    key_file.chmod(0o644)
    run = [
        "--runtime", "runc", "run", "-d", "--network", "host", "--read-only", "--tmpfs", "/tmp",
        # this sandbox's runtime may lower resource limits but not raise them
        "--ulimit", "nofile=16384:16384", "--ulimit", "nproc=4096:4096",
    ]  # fmt: skip
    names = []
    try:
        for component in ("replica", "gateway"):
            container = _container(_deployment(docs, component))
            args = [renumber.get(arg, arg) for arg in _args(container, docs)]
            assert set(renumber) & set(_args(container, docs)), "the manifests' ports changed: renumber them here"
            env = [f"--env={k}={v}" for k, v in _env(container, docs).items()]
            mount = ["-v", f"{key_file}:{_parse(args).api_key_file}:ro"] if component == "gateway" else []
            name = f"bouquet-test-{component}-{os.getpid()}"
            _podman(*run, "--name", name, *env, *mount, TEST_IMAGE, *args)
            names.append(name)

        base_url = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + 180
        while _http("GET", f"{base_url}/health")[0] != 200:
            assert time.monotonic() < deadline, _podman("logs", names[0], check=False).stderr[-3000:]
            time.sleep(1)
        status, body = _http("POST", f"{base_url}/v1/embeddings", b'{"input": ["a query"]}', TEST_SECRETS["api-key"])
        assert status == 200 and len(json.loads(body)["data"][0]["embedding"]) == 384
        assert _http("POST", f"{base_url}/v1/embeddings", b'{"input": ["a query"]}')[0] == 401
        assert b"bouquet_queue_tokens" in _http("GET", f"http://127.0.0.1:{metrics_port}/metrics")[1]

        async def health() -> int:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
                return (await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())).status

        assert asyncio.run(health()) == health_pb2.HealthCheckResponse.SERVING
        assert _podman("exec", names[0], "id", "-u").stdout.strip() == "10001"
        logs = _podman("logs", names[0]).stderr
        assert "attention cpu_varlen" in logs, "the prebuilt CPU kernel, loaded on a read-only root filesystem"

        for name in reversed(names):  # gateway first, as a rollout would not, but as a shutdown does
            started = time.monotonic()
            _podman("stop", "-t", "90", name, timeout=120)
            took = time.monotonic() - started
            code = _podman("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
            assert code == "0" and took < 10, (name, code, took)
    finally:
        for name in names:
            _podman("rm", "-f", name, check=False)
