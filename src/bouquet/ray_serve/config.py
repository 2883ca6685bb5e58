"""The Ray Serve application's arguments: what `serve run bouquet.ray_serve:app KEY=VALUE ...` or a Serve config
file's `args:` give, split into each part's config. A key is a config field's name, as `bouquet serve`'s options
are (`max_batch_tokens`, `admission_wait`, `model` ...), plus the deployment's own (`RayServeConfig`). On the
command line every value is a string, converted to the field's type here (a tuple's items comma-separated); a config
file's values come typed."""

from __future__ import annotations

import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from bouquet.config import (
    CudaGraphConfig,
    EngineConfig,
    GatewayConfig,
    ReplicaConfig,
    SchedulerConfig,
    default_model_path,
    flag,
)
from bouquet.flags import build

# What the application sets itself: where replicas listen and how the gateway finds them (the registry), the token
# between them, and the time to drain (`drain_seconds` below, for both). TLS between them is the user's (the
# replicas' tls_cert, tls_key, tls_client_ca; the gateways' replica_tls_*), files at the same path on every node.
_REPLICA_SETS = {"listen", "metrics_port", "drain_seconds", "token", "insecure"}
_GATEWAY_SETS = {
    "replicas", "replicas_dns", "dns_interval", "model_dirs", "host", "port", "workers", "drain_seconds", "api_key",
    "replica_token", "replicas_followed",
    # Ray Serve's proxy holds the HTTP connections (its port, TLS, timeouts and limits), not bouquet's server.
    "max_connections", "max_header_bytes", "header_timeout", "body_timeout", "body_min_rate", "idle_timeout",
    "tls_cert", "tls_key", "tls_client_ca",
}  # fmt: skip


@dataclass(frozen=True)
class RayServeConfig:
    """The deployments: how many replicas, on what, and how they scale."""

    min_replicas: int = flag(1, help="replicas the autoscaler keeps at least (1 or more: the gateway needs one)")
    max_replicas: int = flag(4, help="replicas the autoscaler starts at most")
    initial_replicas: int | None = flag(None, help="replicas at deployment (default: min_replicas)")
    cpus_per_replica: float = flag(1.0, help="CPUs a replica holds; its engine's threads unless num_threads says")
    gpus_per_replica: float = flag(0.0, help="GPUs a replica holds")
    gateways: int = flag(1, help="gateway (ingress) replicas; each holds no CPU of Ray's")
    # The demand ratio of docs/scaling.md: (tokens waiting + admitted) / tokens admitted at once, over the gateways.
    target_demand: float = flag(0.8, help="demand over capacity the autoscaler keeps a replica at")
    upscale_delay_s: float = flag(10.0, help="seconds demand must stay above the target before replicas are added")
    downscale_delay_s: float = flag(300.0, help="seconds demand must stay below it before replicas are removed")
    drain_seconds: float = flag(30.0, help="a replica that stops finishes its calls within this long")

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas} and {self.max_replicas}")
        initial = self.initial_replicas
        if initial is not None and not self.min_replicas <= initial <= self.max_replicas:
            raise ValueError(f"initial_replicas must be within [min_replicas, max_replicas], got {initial}")
        if self.cpus_per_replica < 0 or self.gpus_per_replica < 0 or self.gateways < 1:
            raise ValueError("cpus_per_replica and gpus_per_replica must be >= 0, gateways positive")
        if self.target_demand <= 0 or min(self.upscale_delay_s, self.downscale_delay_s, self.drain_seconds) < 0:
            raise ValueError("target_demand must be positive, the delays and drain_seconds >= 0")


@dataclass(frozen=True)
class AppConfig:
    """Each part's: the engine's and scheduler's field values (built on the replica, where `device: auto` is
    resolved), the replica's and the gateway's configs, and the deployments'."""

    engine: Mapping[str, Any]
    scheduler: Mapping[str, Any]
    replica: ReplicaConfig
    gateway: GatewayConfig
    serve: RayServeConfig


def app_config(args: Mapping[str, Any], token: str) -> AppConfig:
    """Every key of `args` taken by exactly one part, or refused naming the keys there are."""
    parts: dict[str, dict[str, Any]] = {name: {} for name in _ACCEPTS}
    for key, value in args.items():
        name = "model_path" if key == "model" else key
        owner = next((part for part, accepted in _ACCEPTS.items() if name in accepted), None)
        if owner is None:
            known = ", ".join(sorted(n for accepted in _ACCEPTS.values() for n in accepted))
            raise ValueError(f"unknown argument {key!r}; the application takes: model, {known}")
        parts[owner][name] = _parsed(_hint(_CONFIGS[owner], name), value, key)
    model = Path(parts["engine"].get("model_path") or default_model_path()).resolve()  # the same path on every node
    serve = build(RayServeConfig, parts["serve"])
    replica = {**parts["replica"], "listen": "0.0.0.0:0", "token": token, "drain_seconds": serve.drain_seconds}
    gateway = {
        **parts["gateway"], "replicas": (), "replicas_followed": True, "model_dirs": (model,), "replica_token": token,
        "api_key": os.environ.get("BOUQUET_API_KEY") or None,
    }  # fmt: skip
    config = AppConfig(
        engine={**parts["engine"], "model_path": str(model)}, scheduler=parts["scheduler"],
        replica=build(ReplicaConfig, replica), gateway=build(GatewayConfig, gateway), serve=serve,
    )  # fmt: skip
    if (config.replica.tls_cert is None) != (config.gateway.replica_tls_ca is None):
        raise ValueError(
            "TLS between gateways and replicas needs both ends: tls_cert and tls_key for the replicas, replica_tls_ca "
            "for the gateways (with replica_tls_server_name, the name in the replicas' certificate: they listen on "
            "their nodes' addresses, which a certificate made beforehand rarely lists)"
        )
    return config


_CONFIGS: dict[str, type] = {
    "engine": EngineConfig, "scheduler": SchedulerConfig, "replica": ReplicaConfig, "gateway": GatewayConfig,
    "serve": RayServeConfig,
}  # fmt: skip
_ACCEPTS: dict[str, set[str]] = {
    "engine": {f.name for f in fields(EngineConfig)},
    "scheduler": {f.name for f in fields(SchedulerConfig) if "help" in f.metadata},
    "replica": {f.name for f in fields(ReplicaConfig)} - _REPLICA_SETS,
    "gateway": {f.name for f in fields(GatewayConfig)} - _GATEWAY_SETS,
    "serve": {f.name for f in fields(RayServeConfig)},
}


def _hint(config: type, name: str) -> Any:
    hint = typing.get_type_hints(config)[name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _parsed(hint: Any, value: Any, key: str) -> Any:
    """`value` as the field's type: from the command line's strings, or as a config file typed it."""
    if hint is CudaGraphConfig:  # `cuda_graphs=false`, as `--no-cuda-graphs`
        return {"enabled": _parsed(bool, value, key)}
    if not isinstance(value, str):
        return value
    try:
        if typing.get_origin(hint) is tuple:
            (item, *_) = typing.get_args(hint)
            return tuple(_parsed(item, part.strip(), key) for part in value.split(",") if part.strip())
        if hint is bool:
            if value.lower() not in (*_TRUE, *_FALSE):
                raise ValueError(f"not a boolean: {value!r}")
            return value.lower() in _TRUE
        return hint(value)
    except ValueError as exc:
        raise ValueError(f"argument {key}={value}: {exc}") from exc
