"""The gateway's HTTP application: the service (service.py) and every API's routes (gateway/api/, one module a
dialect), behind the request-id and CORS middleware. Nothing but the server launch (http/server.py) and tests
import this module: routes reach the service through the request's app state."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from bouquet.config import GatewayConfig
from bouquet.gateway.api import cohere, flag_embedding, jina, kserve, openai, ops, perplexity, tei, tei_scores, vllm
from bouquet.gateway.api.kserve_grpc import OpenInferenceServer
from bouquet.gateway.http.endpoint import not_found
from bouquet.gateway.http.request_ids import RequestIds
from bouquet.gateway.metrics import GatewayMetrics
from bouquet.gateway.patch_embed import embed_texts
from bouquet.gateway.service import Service

# The most a gateway's start waits to hear from its replicas (each answers or fails in milliseconds; this bounds
# one that does neither, a blackholed address) before it takes requests: http/server.py listens only after.
_FIRST_ROUND_SECONDS = 10.0


def create_app(config: GatewayConfig, metrics: GatewayMetrics | None = None) -> Starlette:
    service = Service(config, metrics)
    service.text_conversations = embed_texts

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        service.start()
        await service.pool.first_round(_FIRST_ROUND_SECONDS)  # the models its replicas serve are known
        grpc_server = None
        if config.grpc_port is not None:  # the Open Inference Protocol's gRPC twin, on the same service
            grpc_server = OpenInferenceServer(service, config.host, config.grpc_port)
            await grpc_server.start()
            app.state.grpc_port = grpc_server.port
        yield
        if grpc_server is not None:  # its calls answered before the replicas' channels close
            await grpc_server.stop(config.drain_seconds)
        await service.close()

    app = Starlette(
        routes=routes(),
        lifespan=lifespan,
        middleware=_middleware(config),
        exception_handlers={404: not_found, 405: not_found},
    )
    app.state.service = service
    return app


def routes() -> list[Route]:
    """Every route of every API the gateway speaks."""
    return [
        *openai.routes(),
        *tei.routes(),
        *tei_scores.routes(),
        *cohere.routes(),
        *vllm.routes(health=tei.health),
        *perplexity.routes(),
        *kserve.routes(),
        *jina.routes(),
        *flag_embedding.routes(),
        *ops.routes(),
    ]


def _middleware(config: GatewayConfig) -> list[Middleware]:
    middleware = [Middleware(RequestIds)]
    if config.cors_allow_origin:
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(config.cors_allow_origin),
                allow_methods=["GET", "POST"],
                allow_headers=["*"],
                expose_headers=["x-request-id", "retry-after"],
                max_age=600,
            )
        )
    return middleware
