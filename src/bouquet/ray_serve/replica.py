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
from typing import Any

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from bouquet.config import ReplicaConfig, SchedulerConfig, create_engine_config
from bouquet.ray_serve.registry import RENEW_SECONDS

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
        # torch: only in the processes that compute, not in the one that builds the application
        from bouquet.engine.engine import Engine
        from bouquet.ray import actor_cpus
        from bouquet.replica.server import ReplicaServer

        self._registry = registry
        self._id = serve.get_replica_context().replica_tag
        self._drain_seconds = config.drain_seconds
        host = ray.util.get_node_ip_address()
        self._server = ReplicaServer(_listen(host), token=config.token)
        self.address = f"[{host}]:{self._server.port}" if ":" in host else f"{host}:{self._server.port}"
        await self._server.start()
        values = dict(engine)
        values.setdefault("num_threads", actor_cpus())  # the CPUs Ray gave this actor, as for Ray Data's Embedder
        try:
            engine_config = create_engine_config(values.pop("model_path"), **values)
            self._engine = await asyncio.to_thread(Engine, engine_config)
        except BaseException:
            await self._server.stop(0)  # a model that cannot load: Ray Serve skips __del__ and retries elsewhere
            raise
        scheduler_config = SchedulerConfig.for_device(engine_config.device, **scheduler)
        await self._server.attach(
            self._engine, scheduler_config, engine_config.dtype, engine_config.device, config.served_model_names
        )
        await self._registry.renew.remote(self._id, self.address)
        self._renewal = asyncio.ensure_future(self._renew())
        logger.info("bouquet replica %s serving %s on %s", self._id, self._engine.spec.name, self.address)

    async def _renew(self) -> None:
        """Keeps the lease on its address; a registry that is restarting is tried again at the next turn."""
        while True:
            await asyncio.sleep(RENEW_SECONDS)
            try:
                await self._registry.renew.remote(self._id, self.address)
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

    async def get_address(self) -> str:
        return self.address

    async def __del__(self) -> None:
        """A graceful stop: out of the registry, then the drain of `bouquet replica`."""
        self._renewal.cancel()
        # Bounded: when the whole application is deleted the registry may already be gone, and a call to it would
        # wait for it until Ray Serve's grace ran out.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._registry.leave.remote(self._id), _LEAVE_SECONDS)
        await self._server.stop(self._drain_seconds)
        self._engine.close()


def _listen(host: str) -> str:
    """The node's address the other nodes reach it by (not every interface), a free port."""
    return f"[{host}]:0" if ":" in host else f"{host}:0"
