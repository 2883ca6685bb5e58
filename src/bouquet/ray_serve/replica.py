"""A bouquet replica as a Ray Serve deployment: each Serve replica (an actor) runs the same gRPC server, scheduler
and engine as `bouquet replica`, on a free port of its node's address, and renews that address in the registry
while it serves. The gateways call it over gRPC as they call any replica, so their pool's balancing, retries
elsewhere and ejection work unchanged; Ray Serve places, restarts and scales the replicas.

On a graceful stop (scaled down, redeployed) it leaves the registry and drains as `bouquet replica` does on
SIGTERM: health NOT_SERVING at once (the gateways send it nothing new), the calls in hand finished within
`drain_seconds`. One killed outright loses its calls in flight; the gateways retry each on another replica."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from bouquet.config import ReplicaConfig, SchedulerConfig, create_engine_config
from bouquet.ray_serve.registry import CALL_SECONDS, RENEW_SECONDS
from bouquet.tls import server_credentials

if TYPE_CHECKING:
    from bouquet.engine.engine import Engine

logger = logging.getLogger(__name__)

_LEAVE_SECONDS = 1.0


@serve.deployment(ray_actor_options={"num_cpus": 1})
class BouquetReplica:
    async def __init__(
        self,
        engine: Mapping[str, Any],
        scheduler: Mapping[str, Any],
        config: ReplicaConfig,
        registry: DeploymentHandle[Any],
    ) -> None:
        from bouquet.replica.server import ReplicaServer  # imports torch: only in the processes that compute

        self._registry = registry
        self._id = serve.get_replica_context().replica_tag
        self._drain_seconds = config.drain_seconds
        host = ray.util.get_node_ip_address()
        # The node's address, which the other nodes reach it by (not every interface); a free port.
        credentials = None
        if config.tls_cert is not None and config.tls_key is not None:
            credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
        self._server = ReplicaServer(_address(host, 0), token=config.token, credentials=credentials)
        self.address = _address(host, self._server.port)
        self._engine: Engine | None = None
        await self._server.start()
        try:
            await self._load(engine, scheduler, config.served_model_names)
            await self._registry.renew.remote(self._id, self.address)
        except BaseException:
            await self._close(0)  # Ray Serve skips __del__ after a failed start, and tries again elsewhere
            raise
        self._renewal = asyncio.ensure_future(self._renew())
        logger.info("bouquet replica %s serving on %s", self._id, self.address)

    async def _load(self, engine: Mapping[str, Any], scheduler: Mapping[str, Any], names: tuple[str, ...]) -> None:
        from bouquet.engine.engine import Engine
        from bouquet.ray import actor_cpus

        values = dict(engine)
        values.setdefault("num_threads", actor_cpus())  # the CPUs Ray gave this actor, as for Ray Data's Embedder
        engine_config = create_engine_config(values.pop("model_path"), **values)
        self._engine = await asyncio.to_thread(Engine, engine_config)
        scheduler_config = SchedulerConfig.for_device(engine_config.device, **scheduler)
        await self._server.attach(self._engine, scheduler_config, engine_config.dtype, engine_config.device, names)

    async def _renew(self) -> None:
        """Keeps the lease on its address; a registry that is restarting is tried again at the next turn."""
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            try:
                await asyncio.wait_for(self._registry.renew.remote(self._id, self.address), CALL_SECONDS)
            except Exception as error:  # anything Ray raises: the next renewal may reach it
                logger.warning("renewing %s in the registry failed: %s", self.address, error)

    async def check_health(self) -> None:
        """Ray Serve's probe: a replica whose renewals stopped is not reachable by new gateways; replace it."""
        if self._renewal.done():
            raise RuntimeError(f"the registry renewal of {self.address} stopped: {self._renewal!r}")

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """The application's demand ratio (registry.py), for the autoscaling policy (autoscaling.py); none reported
        yet: 0, demand the replicas already meet."""
        ratio = await self._registry.demand_ratio.remote()
        return {"demand_ratio": 0.0 if ratio is None else ratio}

    async def __del__(self) -> None:
        """A graceful stop: out of the registry, then the drain of `bouquet replica`."""
        self._renewal.cancel()
        # Bounded: when the whole application is deleted the registry may already be gone, and a call to it would
        # wait for it until Ray Serve's grace ran out.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._registry.leave.remote(self._id), _LEAVE_SECONDS)
        await self._close(self._drain_seconds)

    async def _close(self, drain_seconds: float) -> None:
        await self._server.stop(drain_seconds)
        if self._engine is not None:
            self._engine.close()


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
