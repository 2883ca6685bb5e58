"""The Ray Serve application: the gateway as ingress, the replicas as an autoscaled deployment, the registry
between them; `app` is the builder `serve run bouquet.ray_serve:app KEY=VALUE ...` and a Serve config file's
`import_path` name (docs/scaling.md, "Ray Serve")."""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping
from typing import Any

from ray.serve import Application

from bouquet.ray_serve.autoscaling import DemandPolicy
from bouquet.ray_serve.config import AppConfig, app_config
from bouquet.ray_serve.gateway import BouquetGateway
from bouquet.ray_serve.registry import Registry
from bouquet.ray_serve.replica import BouquetReplica

# Ray Serve stops a replica this long after its drain at the latest.
_STOP_GRACE_S = 10.0


def app(args: Mapping[str, Any]) -> Application:
    """The application from `serve run`'s KEY=VALUE arguments (config.py says which)."""
    # Gateways and replicas share a token (as `bouquet serve`'s children do): the replicas listen on their node's
    # address, which the rest of the network may reach.
    token = os.environ.get("BOUQUET_REPLICA_TOKEN") or secrets.token_hex(32)
    return build_app(app_config(args, token))


def build_app(config: AppConfig) -> Application:
    serve = config.serve
    registry = Registry.bind()
    replicas = BouquetReplica.options(
        ray_actor_options={"num_cpus": serve.cpus_per_replica, "num_gpus": serve.gpus_per_replica},
        autoscaling_config=_autoscaling(config),
        # No request reaches a replica through Ray Serve: its health check and the autoscaler's stats are all.
        graceful_shutdown_wait_loop_s=0.1,
        graceful_shutdown_timeout_s=serve.drain_seconds + _STOP_GRACE_S,
    ).bind(config.engine, config.scheduler, config.replica, registry)
    gateway = BouquetGateway.options(
        num_replicas=serve.gateways,
        # Admission decides what a gateway takes on (429 over capacity): Ray Serve's own queue stays out of its way.
        max_ongoing_requests=config.gateway.max_concurrent_requests,
        graceful_shutdown_timeout_s=serve.drain_seconds + _STOP_GRACE_S,
    )
    return gateway.bind(config.gateway, registry, replicas)


def _autoscaling(config: AppConfig) -> dict[str, Any]:
    serve = config.serve
    return {
        "min_replicas": serve.min_replicas,
        "max_replicas": serve.max_replicas,
        "initial_replicas": serve.initial_replicas,
        "upscale_delay_s": serve.upscale_delay_s,
        "downscale_delay_s": serve.downscale_delay_s,
        "policy": {
            "policy_function": DemandPolicy,
            "policy_kwargs": {"target": serve.target_demand},
        },
    }
