"""The gateway as the application's ingress: Ray Serve's proxy hands each HTTP request to this deployment, which
runs the gateway's own ASGI app (gateway/app.py: every route, tokenization, chunking, admission, the replica
pool with its retries elsewhere), so the API is `bouquet serve`'s: a second launch of that app beside
http/server.py, with Ray Serve's proxy in place of uvicorn. Like every gateway it imports no torch. Its replicas
are followed from the registry as `--replicas-dns` follows a name: a new one joins once its Info and health
answer, one that goes gets no new work and finishes its calls; an unreachable or restarting registry keeps the
last list. It reports its admission's demand to the registry for the replicas' autoscaler.

Ray Serve counts a replica of this deployment ready once its ASGI lifespan has started, and `serve.run` returns (and
`serve run` says "Deployed") when every deployment's are: so the gateway's startup also waits, up to
`FIRST_REPLICA_SECONDS`, for a healthy replica, and the application's first request is answered rather than refused
503 while the registry's list travels to the pool (about a second)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.applications import Starlette

from bouquet.config import GatewayConfig
from bouquet.gateway.app import create_app
from bouquet.gateway.service import Service
from bouquet.ray_serve.registry import CALL_SECONDS, RENEW_SECONDS, Demand

logger = logging.getLogger(__name__)

SOURCE = "ray-serve-registry"  # the pool's name for the registry's list, as a DNS name's would be
# Replicas load their model while the gateway starts; past this the gateway starts anyway, 503 until one joins.
FIRST_REPLICA_SECONDS = 120.0
_POLL_SECONDS = 0.05


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress()
class BouquetGateway:
    async def __init__(
        self, config: GatewayConfig, registry: DeploymentHandle[Any], replicas: DeploymentHandle[Any]
    ) -> None:
        # `replicas` is held only so that the replica deployment belongs to this application.
        self._app = create_app(config)
        self._service: Service = self._app.state.service
        self._registry = registry
        self._id = serve.get_replica_context().replica_tag
        self._following = asyncio.ensure_future(self._follow())

    def __serve_build_asgi_app__(self) -> Starlette:
        # Ray Serve runs its lifespan: the pool starts (and closes when this replica stops), then a replica joins.
        started = self._app.router.lifespan_context

        @contextlib.asynccontextmanager
        async def lifespan(app: Starlette) -> AsyncIterator[Any]:
            async with started(app) as state:
                await self._first_replica()
                yield state

        self._app.router.lifespan_context = lifespan
        return self._app

    async def _first_replica(self) -> None:
        """Returns once the pool has a healthy replica whose model is known, or after FIRST_REPLICA_SECONDS."""
        deadline = time.monotonic() + FIRST_REPLICA_SECONDS
        while not (self._service.pool.any_healthy() and self._service.catalog.ordered):
            if time.monotonic() > deadline:
                logger.warning("no replica joined within %.0f s; serving, 503 until one does", FIRST_REPLICA_SECONDS)
                return
            await asyncio.sleep(_POLL_SECONDS)

    async def _follow(self) -> None:
        followed: set[str] = set()
        while True:
            try:
                addresses, complete = await asyncio.wait_for(self._registry.replicas.remote(), CALL_SECONDS)
                # An incomplete list (a registry just restarted) adds, never removes.
                followed = set(addresses) if complete else followed | set(addresses)
                self._service.pool.follow(SOURCE, followed)
                await asyncio.wait_for(self._registry.report_demand.remote(self._id, self._demand()), CALL_SECONDS)
            except Exception as error:  # the registry restarting or unreachable: keep the last list
                logger.warning("the registry did not answer (%s); keeping its %d replicas", error, len(followed))
            await asyncio.sleep(RENEW_SECONDS)

    def _demand(self) -> Demand:
        """What the demand gauges say (docs/scaling.md): tokens waiting and admitted, over the admission limit."""
        metrics = self._service.metrics
        wanted = sum(
            sample.value
            for gauge in (metrics.admission_waiting_tokens, metrics.admission_admitted_tokens)
            for family in gauge.collect()
            for sample in family.samples
        )
        return Demand(wanted, float(self._service.admission.limit()))

    async def __del__(self) -> None:
        self._following.cancel()
