"""gRPC's standard health service (grpc.health.v1) on the Open Inference Protocol port, so that Kubernetes' own
gRPC probes (`readinessProbe.grpc`), grpc-health-probe and service meshes can ask the port what ServerReady says.

Check answers SERVING while the server is ready for inference (kserve.check_server_ready: not draining, some
replica healthy), NOT_SERVING otherwise, for the service "" (the whole server) and for the inference service's
name; any other name is NOT_FOUND, as the health protocol asks. List gives both; Watch sends the status, then each
change, looked at every WATCH_SECONDS."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bouquet.gateway.api.kserve import check_server_ready
from bouquet.gateway.errors import ApiError
from bouquet.gateway.service import Service

WATCH_SECONDS = 1.0
_SERVING: int = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING: int = health_pb2.HealthCheckResponse.NOT_SERVING


class InferenceHealth:
    """Check and Watch of grpc.health.v1 (added to a server by `add_health`)."""

    def __init__(self, service: Service, inference_service: str):
        self.service = service
        self.names = {"", inference_service}

    def status(self) -> int:
        try:
            check_server_ready(self.service)
        except ApiError:
            return _NOT_SERVING
        return _SERVING

    async def Check(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthCheckResponse:
        if request.service not in self.names:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no service {request.service!r} here")
        return health_pb2.HealthCheckResponse(status=self.status())

    async def List(self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext) -> object:
        status = health_pb2.HealthCheckResponse(status=self.status())
        return health_pb2.HealthListResponse(statuses={name: status for name in self.names})

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[health_pb2.HealthCheckResponse]:
        unknown = request.service not in self.names
        last = None
        while True:  # ends when the client cancels the stream (or the server stops)
            status = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN if unknown else self.status()
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_SECONDS)


def add_health(server: grpc.aio.Server, service: Service, inference_service: str) -> str:
    """Serves grpc.health.v1 beside the inference service; returns its name (for reflection's list)."""
    health_pb2_grpc.add_HealthServicer_to_server(InferenceHealth(service, inference_service), server)
    return str(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
