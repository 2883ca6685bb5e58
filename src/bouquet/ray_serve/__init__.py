"""Ray Serve: bouquet as one Ray Serve application (docs/scaling.md, "Ray Serve"), started by one command:

    serve run bouquet.ray_serve:app model=/models/all-MiniLM-L6-v2 max_replicas=8 dtype=float32

- the gateway as the ingress deployment (gateway.py): the HTTP API of `bouquet serve`, on Ray Serve's proxy;
- the replicas as an autoscaled deployment (replica.py), each running a bouquet replica's gRPC server, scheduler
  and engine, found by the gateways through the registry (registry.py);
- the replicas scaled on the gateways' demand ratio (autoscaling.py), the signal docs/scaling.md gives KEDA.

Needs `ray[serve]` (the `ray` extra). `import bouquet` never imports this package or Ray."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    # `app` and `build_app` are imported when asked for, not with the package: the gateway's actor imports
    # gateway.py from here, and must not import the replicas' modules (and torch) with it.
    if name in ("app", "build_app"):
        from bouquet.ray_serve import application

        return getattr(application, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
