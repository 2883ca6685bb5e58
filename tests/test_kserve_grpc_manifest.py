"""docs/scaling.md's InferenceService addition for the Open Inference Protocol over gRPC, read from the doc and put
into deploy/kserve/inferenceservice.yaml's model spec: still valid against KServe's CRD schema, and the container
KServe builds from it (tests/test_kserve_manifests.py's merge) runs `bouquet serve` with the gRPC port its
second container port names, the HTTP port first (the one KServe's Service puts on port 80)."""

from __future__ import annotations

import copy
import re
import textwrap

import pytest
from test_kserve_manifests import (
    ROOT,
    RUNTIMES,
    SERVICES,
    _load,
    _merged_container,
    _of,
    _serve_args,
)
from test_kubernetes_manifests import _crd_schemas, _strict

from bouquet import cli

yaml = pytest.importorskip("yaml")


def _documented_addition() -> dict:
    text = (ROOT / "docs" / "scaling.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "--grpc-port" in b]
    return yaml.safe_load(textwrap.dedent(block))["model"]


def test_the_documented_grpc_port_reaches_serve() -> None:
    import jsonschema

    docs = _load()
    service = copy.deepcopy(_of(docs, SERVICES)["minilm"])
    service["spec"]["predictor"]["model"].update(_documented_addition())
    schema = _strict(_crd_schemas()[service["apiVersion"], service["kind"]])
    errors = [e.message for e in jsonschema.Draft4Validator(schema).iter_errors(service)]
    assert not errors, errors

    container = _merged_container(service, _of(docs, RUNTIMES)["bouquet"])
    args = _serve_args(container)
    gateway = cli.serve_config(args).gateway_config["gateway"]
    http, grpc = container["ports"]
    assert http["name"] == "http1" and http["containerPort"] == args.port == gateway["port"]
    assert grpc["containerPort"] == gateway["grpc_port"] == 8081
    assert grpc.get("protocol", "TCP") == "TCP"
