"""deploy/kserve/: the ServingRuntimes and InferenceServices validated offline against KServe's own CRD schemas
(tests/crd_schemas/, copied from kserve/kserve's config/crd/full at a named commit), strictly (an unknown field is
an error), and what ties them to bouquet and to KServe checked: each InferenceService's runtime, model format and
protocol as KServe's controller matches them; the container KServe builds from the two (the runtime's container,
the InferenceService's model fields over it, args concatenated, {{.Name}} filled in) parsed by `bouquet serve`'s
own parser and built into serve's configs; its port against --port; --model against the mount KServe puts the
model at; the probes against the routes of the gateway app that `serve` starts with those flags (the Open
Inference Protocol's health routes, answered without an API key); the security context against the restricted
Pod Security profile and the image's user; threads against the CPU limit; the grace period against the drain; the
runtime's container against what Knative accepts. No cluster, KServe or Knative is involved: what they do with the
objects (storage initializer, scheduling, routing, scaling) is not tested here."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from test_kubernetes_manifests import _crd_schemas, _strict  # the CRD schemas, read and made strict once

from bouquet import cli
from bouquet.config import default_model_path
from bouquet.flags import write_config_file

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kserve"
RUNTIMES = "serving.kserve.io/v1alpha1", "ServingRuntime"
SERVICES = "serving.kserve.io/v1beta1", "InferenceService"
EXPECTED = {RUNTIMES: {"bouquet", "bouquet-gpu"}, SERVICES: {"minilm", "minilm-gpu"}}
NAMESPACE = "models"  # any: the manifests name none, `kubectl apply -n` chooses

# KServe (kserve/kserve at the commit tests/crd_schemas/serving.kserve.io_* name): the container the InferenceService
# merges into (pkg/constants InferenceServiceContainerName), where the storage initializer puts storageUri
# (DefaultModelLocalMountPath), and the ModelSpec fields that are not the container's (predictor_model.go).
KSERVE_CONTAINER = "kserve-container"
KSERVE_MODEL_MOUNT = Path("/mnt/models")
MODEL_SPEC_FIELDS = {"modelFormat", "runtime", "runtimeVersion", "protocolVersion", "storageUri", "storage"}
STORAGE_SCHEMES = ("hf://", "s3://", "gs://", "pvc://", "https://", "http://", "oci://")
ISVC_NAME = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")  # DNS-1035, as KServe's webhook asks
STANDARD_MODES = ("Standard", "RawDeployment")  # a plain Deployment; "RawDeployment" before KServe 0.16

# Knative (knative/serving 98e5ef90aa, pkg/apis/serving/fieldmask.go ContainerMask, k8s_validation.go): the container
# fields a Knative revision keeps (a runtime used in Knative mode must hold no other), its port names, and the env
# sources it takes without the kubernetes.podspec-fieldref feature.
KNATIVE_CONTAINER_FIELDS = {
    "name", "args", "command", "env", "workingDir", "envFrom", "image", "imagePullPolicy", "livenessProbe",
    "ports", "readinessProbe", "resources", "securityContext", "startupProbe", "terminationMessagePath",
    "terminationMessagePolicy", "volumeMounts",
}  # fmt: skip
KNATIVE_PORT_NAMES = ("", "http1", "h2c")

# The Open Inference Protocol v2's REST routes bouquet's gateway serves (src/bouquet/gateway/api/kserve.py).
OIP_ROUTES = {
    ("GET", "/v2/health/live"),
    ("GET", "/v2/health/ready"),
    ("GET", "/v2"),
    ("GET", "/v2/models/{model}"),
    ("GET", "/v2/models/{model}/ready"),
    ("POST", "/v2/models/{model}/infer"),
}

Doc = dict[str, Any]


# --- reading the objects ------------------------------------------------------------------------------------------


def _load() -> list[Doc]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    return docs


@pytest.fixture(scope="module")
def docs() -> list[Doc]:
    return _load()


def _of(docs: list[Doc], kind: tuple[str, str]) -> dict[str, Doc]:
    return {d["metadata"]["name"]: d for d in docs if (d["apiVersion"], d["kind"]) == kind}


def _runtime_container(runtime: Doc) -> Doc:
    containers = runtime["spec"]["containers"]
    assert [c["name"] for c in containers] == [KSERVE_CONTAINER], "one container, the one KServe merges into"
    return containers[0]


def _merged_container(service: Doc, runtime: Doc) -> Doc:
    """The container KServe runs (pkg/controller/v1beta1/inferenceservice/utils MergeRuntimeContainers,
    ReplacePlaceholders, UpdateImageTag): the runtime's, with the InferenceService's model fields patched over it
    (env by name, resources by key), args concatenated, {{.Name}} and {{.Namespace}} filled in from the
    InferenceService, and the image's tag replaced by runtimeVersion where one is given."""
    base = _runtime_container(runtime)
    model = service["spec"]["predictor"]["model"]
    over = {key: value for key, value in model.items() if key not in MODEL_SPEC_FIELDS}
    merged = {**base, **{key: value for key, value in over.items() if key not in ("args", "env", "resources")}}
    merged["args"] = [*base.get("args", []), *over.get("args", [])]
    env = {var["name"]: var for var in [*base.get("env", []), *over.get("env", [])]}
    merged["env"] = list(env.values())
    resources = base.get("resources", {})
    merged["resources"] = {
        key: {**resources.get(key, {}), **over.get("resources", {}).get(key, {})}
        for key in {*resources, *over.get("resources", {})}
    }
    fields = {"Name": service["metadata"]["name"], "Namespace": NAMESPACE}
    text = re.sub(r"\{\{\s*\.(\w+)\s*\}\}", lambda m: fields[m[1]], json.dumps(merged))
    assert "{{" not in text, f"a placeholder KServe's ObjectMeta does not fill: {text}"
    container = json.loads(text)
    if version := model.get("runtimeVersion"):
        container["image"] = re.sub(r":[\w.\-]*$", "", container["image"]) + f":{version}"
    return container


def _pairs(docs: list[Doc]) -> list[tuple[Doc, Doc, Doc]]:
    """Each InferenceService with the runtime it names and the container KServe builds from the two."""
    runtimes = _of(docs, RUNTIMES)
    out = []
    for service in _of(docs, SERVICES).values():
        name = service["spec"]["predictor"]["model"].get("runtime")
        assert name in runtimes, f"{service['metadata']['name']}: runtime {name!r} is not in deploy/kserve"
        out.append((service, runtimes[name], _merged_container(service, runtimes[name])))
    return out


def _env(container: Doc) -> dict[str, str]:
    """Literal values only: a runtime in Knative mode takes ConfigMap and Secret references, and this test reads
    none."""
    values = {}
    for var in container.get("env", []):
        assert "valueFrom" not in var or set(var["valueFrom"]) <= {"configMapKeyRef", "secretKeyRef"}, var
        if "value" in var:
            values[var["name"]] = var["value"]
    return values


def _subparser(command: str) -> argparse.ArgumentParser:
    parser = cli.build_parser()
    commands = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return commands.choices[command]


def _parse(args: list[str]) -> argparse.Namespace:
    """bouquet's own parser on the args. Each flag spelled in full (argparse would take an abbreviation) and as
    --flag=value, so that a value is never read as a flag."""
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


def _serve_args(container: Doc) -> argparse.Namespace:
    assert "command" not in container, "the image's ENTRYPOINT (bouquet) is what runs; args are its arguments"
    args = _parse(container["args"])
    assert args.command == "serve"
    return args


def _quantity(value: str | int) -> float:
    """A CPU quantity ("2", "500m") in cores."""
    text = str(value)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _dockerfile_stages() -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {}
    current: list[str] = []
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if match := re.match(r"FROM\s+\S+(?:\s+AS\s+(\S+))?", line, re.IGNORECASE):
            current = stages.setdefault(match[1] or f"#{len(stages)}", [])
        current.append(line)
    return stages


def _uses_gpu(container: Doc) -> bool:
    return "nvidia.com/gpu" in container.get("resources", {}).get("limits", {})


# --- the tests ----------------------------------------------------------------------------------------------------


def test_objects_match_kserves_crd_schemas(docs: list[Doc]) -> None:
    """Every object under deploy/kserve is a ServingRuntime or an InferenceService, valid against the
    openAPIV3Schema of KServe's CRD (tests/crd_schemas/, naming its source and commit) with unknown fields refused.
    Only the schema: what KServe's webhooks check beyond it is checked by the tests below where it matters."""
    import jsonschema

    schemas = _crd_schemas()
    found = {kind: set(_of(docs, kind)) for kind in EXPECTED}
    assert found == EXPECTED
    assert len(docs) == sum(map(len, EXPECTED.values())), "an object of another kind is under deploy/kserve"
    for doc in docs:
        validator = jsonschema.Draft4Validator(_strict(schemas[doc["apiVersion"], doc["kind"]]))
        errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{doc['kind']} {doc['metadata']['name']}: {errors}"
        assert "namespace" not in doc["metadata"], "the namespace is the operator's (kubectl apply -n)"
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "bouquet"


def test_services_find_their_runtimes(docs: list[Doc]) -> None:
    """As KServe's controller matches them (predictor.go, predictor_model.go, servingruntime_webhook.go): the runtime
    an InferenceService names supports its model format (and version, when it gives one) and its protocol; v2 is
    the only protocol the runtimes claim, since bouquet serves no v1 (`/v1/models/{m}:predict`) and no gRPC v2;
    no two runtimes auto-select one format at one priority (the webhook refuses the second), and the GPU runtime
    is never auto-selected."""
    from starlette.routing import Match

    from bouquet.gateway.app import routes

    for service, runtime, _ in _pairs(docs):
        name = service["metadata"]["name"]
        assert ISVC_NAME.fullmatch(name) and len(name) <= 63, name
        model = service["spec"]["predictor"]["model"]
        formats = runtime["spec"]["supportedModelFormats"]
        labels = {f["name"] for f in formats} | {f"{f['name']}:{f['version']}" for f in formats if "version" in f}
        wanted = model["modelFormat"]["name"]
        if "version" in model["modelFormat"]:
            wanted += f":{model['modelFormat']['version']}"
        assert wanted in labels, f"{name}: {runtime['metadata']['name']} does not support {wanted}"
        assert model["protocolVersion"] in runtime["spec"]["protocolVersions"]
        assert not runtime["spec"].get("disabled")
        assert not runtime["spec"].get("multiModel"), "one model a server"

    scope = {"type": "http", "method": "POST", "path": "/v1/models/minilm:predict"}
    assert not any(route.matches(scope)[0] == Match.FULL for route in routes()), "bouquet serves v1 now: add it"
    auto = []
    for runtime in _of(docs, RUNTIMES).values():
        assert runtime["spec"]["protocolVersions"] == ["v2"]
        for fmt in runtime["spec"]["supportedModelFormats"]:
            assert fmt["name"] == "sentence-transformers"
            if fmt.get("autoSelect"):
                auto.append((fmt["name"].lower(), fmt.get("version"), fmt.get("priority")))
                assert not _uses_gpu(_runtime_container(runtime)), "a GPU runtime is asked for by name"
    assert len(auto) == len(set(auto)) == 1, auto


def test_args_are_serve_flags_and_build_its_configs(docs: list[Doc]) -> None:
    """The container KServe builds runs `bouquet serve` with flags its parser takes, serving the model where KServe
    puts it under the InferenceService's name, on all the pod's addresses at the one container port, and the flags
    build serve's configs (each replica's engine, scheduler and replica config, the gateway's) as `serve` does."""
    for service, _, container in _pairs(docs):
        name = service["metadata"]["name"]
        args = _serve_args(container)
        assert [Path(model) for model in args.model] == [KSERVE_MODEL_MOUNT], "the model KServe mounts, alone"
        assert args.served_model_name == [name], "/v2/models/{the InferenceService's name}/infer"
        assert service["spec"]["predictor"]["model"]["storageUri"].startswith(STORAGE_SCHEMES)
        mounts = [Path(m["mountPath"]) for m in container.get("volumeMounts", [])]
        assert not any(KSERVE_MODEL_MOUNT.is_relative_to(m) for m in mounts), "KServe mounts /mnt/models itself"
        assert args.host in ("0.0.0.0", "::"), "the pod's addresses, not loopback"
        [port] = container["ports"]
        assert port["containerPort"] == args.port, "KServe's Service sends traffic to the container port"
        assert port.get("protocol", "TCP") == "TCP" and port.get("name", "") in KNATIVE_PORT_NAMES
        assert "grpc" not in port.get("name", ""), "KServe would take a port named grpc for gRPC"

        config = cli.serve_config(args)
        assert config.device == ("cuda" if _uses_gpu(container) else "cpu")
        assert len(config.replica_configs) == 1
        for sections in config.replica_configs:
            engine = cli.engine_config(sections["engine"])
            assert engine.model_path == KSERVE_MODEL_MOUNT
            cli.scheduler_config(sections["scheduler"], engine.device)
            assert cli.replica_config(sections["replica"]).served_model_names == (name,)
        assert config.gateway_config["gateway"]["port"] == args.port


def test_probes_and_metrics_hit_the_gateways_routes(docs: list[Doc], tmp_path: Path) -> None:
    """The probes go to --port, on the Open Inference Protocol's health routes, which are routes of the gateway app
    that `serve` starts with these flags (its config as serve hands it to its gateway, built by `bouquet gateway
    --config`), answered without an API key even where one is set (the kubelet sends none). With no replica
    reachable, readiness is 400 (the protocol's 4xx: out of the Service) while startup and liveness pass (no
    restart while the replica reloads). KServe's metrics annotations name /metrics on --port;
    /v2/models/{name}/infer is a POST route."""
    from starlette.routing import Match
    from starlette.testclient import TestClient

    from bouquet.gateway.app import create_app, routes

    served = {(method, route.path) for route in routes() for method in (getattr(route, "methods", None) or ())}
    missing = {(m, p) for m, p in OIP_ROUTES if (m, p.replace("{model}", "{model:path}")) not in served}
    assert not missing, f"the gateway does not serve {missing}"

    for service, runtime, container in _pairs(docs):
        name = service["metadata"]["name"]
        args = _serve_args(container)
        args.model = [str(default_model_path())]  # the storage initializer's download, stood in for
        gateway = cli.serve_config(args).gateway_config["gateway"]
        sections = {"gateway": {**gateway, "replicas": [f"unix:{tmp_path}/replica0.sock"]}}  # nothing listens
        config_file = write_config_file(tmp_path / f"{name}-gateway.json", sections)
        monkey = pytest.MonkeyPatch()
        monkey.setenv("BOUQUET_API_KEY", "test-api-key")  # as an operator may set: the probes still pass
        try:
            config = cli.gateway_config(cli.build_parser().parse_args(["gateway", "--config", str(config_file)]))
        finally:
            monkey.undo()
        assert config.api_key == "test-api-key" and config.port == args.port
        asyncio.set_event_loop(asyncio.new_event_loop())  # grpc.aio channels need one
        client = TestClient(create_app(config))  # not started (no lifespan): no replica is reached
        expected = {"startupProbe": 200, "readinessProbe": 400, "livenessProbe": 200}
        for probe, status in expected.items():
            get = container[probe]["httpGet"]
            assert get["port"] == args.port and get.get("scheme", "HTTP") == "HTTP", probe
            assert ("GET", get["path"]) in OIP_ROUTES, f"{probe}: {get['path']} is not an OIP health route"
            assert client.get(get["path"]).status_code == status, (name, probe, get["path"])
        assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
        assert client.get(f"/v2/models/{name}").status_code == 401, "the API key guards all but health"

        notes = runtime["spec"]["annotations"]
        assert int(notes["prometheus.kserve.io/port"]) == args.port
        assert client.get(notes["prometheus.kserve.io/path"]).status_code == 200
        scope = {"type": "http", "method": "POST", "path": f"/v2/models/{name}/infer"}
        assert any(route.matches(scope)[0] == Match.FULL for route in routes())


def test_containers_meet_the_restricted_profile_and_run_the_images(docs: list[Doc]) -> None:
    """As deploy/kubernetes' pods (Pod Security "restricted"), on the container, since a ServingRuntime carries no
    pod securityContext: non-root as the image's user, no privilege escalation, every capability dropped, the
    runtime's seccomp profile, a read-only root filesystem with an emptyDir (size-limited) for what bouquet
    writes. The image is REGISTRY/bouquet:VERSION-TARGET for this package's version: cuda for a GPU runtime, cpu
    otherwise."""
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    stages = _dockerfile_stages()
    for runtime in _of(docs, RUNTIMES).values():
        container = _runtime_container(runtime)
        security = container["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] != 0
        assert security["allowPrivilegeEscalation"] is False and not security.get("privileged")
        assert security["capabilities"]["drop"] == ["ALL"] and not security["capabilities"].get("add")
        assert security["seccompProfile"]["type"] == "RuntimeDefault"
        assert security["readOnlyRootFilesystem"] is True
        volumes = {v["name"]: v for v in runtime["spec"].get("volumes", [])}
        writable = []
        for mount in container["volumeMounts"]:
            volume = volumes[mount["name"]]
            assert set(volume) == {"name", "emptyDir"}, volume
            assert volume["emptyDir"]["sizeLimit"], volume
            writable.append(Path(mount["mountPath"]))
        assert Path("/tmp") in writable, "serve's private directory (tempfile) is under /tmp"
        assert Path(_env(container)["XDG_CACHE_HOME"]).is_relative_to(Path("/tmp"))

        target = "cuda" if _uses_gpu(container) else "cpu"
        assert re.fullmatch(rf"[\w.\-/:]+/bouquet:{re.escape(version)}-{target}", container["image"])
        lines = stages[target]
        assert 'ENTRYPOINT ["bouquet"]' in lines
        [user] = [line.split()[1] for line in lines if line.startswith("USER ")]
        assert user == f"{security['runAsUser']}:{security['runAsGroup']}"


def test_threads_and_processes_fit_the_cpu_limit(docs: list[Doc]) -> None:
    """Requests equal limits (Guaranteed QoS). `serve` hands each replica $OMP_NUM_THREADS whole: on a CPU the
    replicas' threads are the CPU limit (the gateway's share is small: a gateway core feeds ~35 replica cores,
    docs/scaling.md), with one gateway process; on a GPU each replica has its GPU and the threads plus a gateway
    process a core fit in the limit, with more than one gateway process (docs/scaling.md)."""
    for service, _, container in _pairs(docs):
        name = service["metadata"]["name"]
        args = _serve_args(container)
        resources = container["resources"]
        assert resources["requests"] == {k: v for k, v in resources["limits"].items() if k != "nvidia.com/gpu"}
        cores = math.ceil(_quantity(resources["limits"]["cpu"]))
        threads = int(_env(container)["OMP_NUM_THREADS"]) * args.replicas
        if _uses_gpu(container):
            assert args.device == "cuda" and int(resources["limits"]["nvidia.com/gpu"]) == args.replicas, name
            assert args.workers >= 2 and threads + args.workers <= cores, (name, threads, args.workers, cores)
        else:
            assert args.device == "cpu" and threads == cores and args.workers == 1, (name, threads, cores)


def test_grace_covers_prestop_and_drain(docs: list[Doc]) -> None:
    """terminationGracePeriodSeconds counts from preStop's start: it covers the sleep and serve's drain. Liveness
    cannot kill a draining container, the startup probe waits for a model to load (serve's --ready-timeout), and
    preStop (which Knative refuses) is only where the InferenceService asks for a plain Deployment."""
    for service, runtime, container in _pairs(docs):
        name = service["metadata"]["name"]
        args = _serve_args(container)
        drain = args.drain_seconds
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep" and len(command) == 2
        sleep = float(command[1])
        grace = service["spec"]["predictor"]["terminationGracePeriodSeconds"]
        assert sleep > 0 and grace > sleep + drain, (name, grace, sleep, drain)
        assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] in STANDARD_MODES
        liveness, startup = container["livenessProbe"], container["startupProbe"]
        assert liveness["periodSeconds"] * liveness["failureThreshold"] >= drain, name
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, name
        assert "lifecycle" not in _runtime_container(runtime), "the runtime stays one Knative takes"


def test_runtimes_are_what_knative_accepts(docs: list[Doc]) -> None:
    """A ServingRuntime serves InferenceServices in either of KServe's modes: its container holds only the fields a
    Knative revision keeps, one port of a name Knative takes, env from values, ConfigMaps or Secrets only (field
    references need a Knative feature flag)."""
    for runtime in _of(docs, RUNTIMES).values():
        container = _runtime_container(runtime)
        extra = set(container) - KNATIVE_CONTAINER_FIELDS
        assert not extra, f"{runtime['metadata']['name']}: Knative refuses {extra}"
        [port] = container["ports"]
        assert port.get("name", "") in KNATIVE_PORT_NAMES
        _env(container)
