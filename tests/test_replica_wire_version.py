"""A replica of another wire version (InfoResponse.wire_version: a release whose gateway and replicas can no longer
work together) is not used, and the gateway says why once at WARNING and in /health's 503; a replica from before
the field (0) speaks version 1. Real gRPC and HTTP on loopback, in one process (tests/in_process.py)."""

from __future__ import annotations

import asyncio
import logging

import grpc
import httpx
import in_process
import pytest

from bouquet.config import GatewayConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.app import create_app
from bouquet.gateway.replicas.catalog import ModelCatalog
from bouquet.gateway.replicas.replica import Incompatible, check_wire, unusable_cause
from bouquet.proto import WIRE_VERSION, embedding_pb2

MARKER = "cannot be used: "


def test_a_replica_of_another_wire_version_is_not_used_and_said_once(
    minilm_fp32: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway of the next wire version in front of this release's replica (the replica's Info says version 1)."""

    async def answers(replicas: tuple[str, ...]) -> tuple[httpx.Response, httpx.Response]:
        app = create_app(GatewayConfig(replicas=replicas, probe_interval=0.05))
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0.5)  # ten probes: the cause is said once however often it is seen
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                health = await client.get("/health")
                embedded = await client.post("/v1/embeddings", json={"input": ["a"]})
        return health, embedded

    with in_process.served([minilm_fp32]) as served:
        monkeypatch.setattr("bouquet.gateway.replicas.replica.WIRE_VERSION", WIRE_VERSION + 1)
        with caplog.at_level(logging.WARNING):
            future = asyncio.run_coroutine_threadsafe(answers(served.replicas), served.loop)  # type: ignore[arg-type]
            health, embedded = future.result(120)
    assert health.status_code == 503 and f"wire version {WIRE_VERSION} " in health.text, health.text
    assert f"this gateway {WIRE_VERSION + 1}" in health.text, health.text
    assert embedded.status_code == 503, embedded.text
    said = [record.getMessage() for record in caplog.records if MARKER in record.getMessage()]
    assert len(said) == 1 and "run gateways and replicas of one release" in said[0], said


def test_a_replica_from_before_the_field_speaks_version_one() -> None:
    check_wire(embedding_pb2.InfoResponse(wire_version=0))  # no error
    check_wire(embedding_pb2.InfoResponse(wire_version=WIRE_VERSION))
    with pytest.raises(Incompatible, match=r"bouquet 9\.9"):
        check_wire(embedding_pb2.InfoResponse(wire_version=WIRE_VERSION + 1, bouquet_version="9.9"))


def test_a_call_the_replica_does_not_implement_names_the_likely_cause() -> None:
    error = grpc.aio.AioRpcError(
        grpc.StatusCode.UNIMPLEMENTED, grpc.aio.Metadata(), grpc.aio.Metadata(), "Method not found!"
    )
    assert "another release" in unusable_cause(error)


def test_a_failure_taking_in_a_replicas_info_is_said_once_and_retried(
    minilm_fp32: Engine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A gateway bug on what a replica's Info says (here the catalog raising on its first three reads) costs that
    replica only while it lasts: said once, asked again at each probe, served once it passes. It used to end the
    replica's health watch for good, the model never served."""
    register = ModelCatalog.register
    failures = iter(range(3))

    def flaky(self: ModelCatalog, info: embedding_pb2.InfoResponse) -> object:
        if next(failures, None) is not None:
            raise RuntimeError("a bug in the gateway")
        return register(self, info)

    async def answers(replicas: tuple[str, ...]) -> tuple[httpx.Response, httpx.Response]:
        app = create_app(GatewayConfig(replicas=replicas, probe_interval=0.05))
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                for _ in range(200):  # 10 s at most
                    if (health := await client.get("/health")).status_code == 200:
                        break
                    await asyncio.sleep(0.05)
                embedded = await client.post("/v1/embeddings", json={"input": ["a"]})
        return health, embedded

    monkeypatch.setattr(ModelCatalog, "register", flaky)
    with in_process.served([minilm_fp32]) as served, caplog.at_level(logging.WARNING):
        future = asyncio.run_coroutine_threadsafe(answers(served.replicas), served.loop)  # type: ignore[arg-type]
        health, embedded = future.result(120)
    assert health.status_code == 200 and embedded.status_code == 200, (health.text, embedded.text)
    said = [record.getMessage() for record in caplog.records if MARKER in record.getMessage()]
    assert len(said) == 1 and "(RuntimeError: a bug in the gateway)" in said[0], said
