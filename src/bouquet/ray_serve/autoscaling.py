"""The replicas' autoscaling policy: the demand ratio of docs/scaling.md, as KEDA's ScaledObject reads it there.

Requests reach the replicas over gRPC from the gateways, not through Ray Serve, so Ray Serve's own signal (its
requests ongoing at a replica) stays at zero; and a replica's own queue misses demand, which admission holds and
refuses at the gateways. So the replicas report the gateways' demand ratio, (tokens waiting for admission + tokens
admitted) / tokens admitted at once, summed over the gateways (registry.py), and this policy wants
`ceil(replicas * ratio / target)`: at a target of 0.8 the replicas keep a fifth of headroom, and under overload the
waiting tokens push the ratio past 1, so the count grows with the excess. Ray Serve applies min and max replicas
and the up- and downscale delays around it.

Ray Serve pickles this module by value into its controller: it imports nothing of bouquet's or Ray's."""

from __future__ import annotations

import math
from typing import Any

METRIC = "demand_ratio"


class DemandPolicy:
    """Ray Serve's custom policy: built once with `policy_kwargs`, called each autoscaling tick."""

    def __init__(self, target: float = 0.8):
        self.target = target

    def __call__(self, ctx: Any) -> tuple[int, dict[str, Any]]:  # ctx: ray.serve.config.AutoscalingContext
        """The replicas wanted; unchanged while no replica has reported (starting, or none running)."""
        replicas = ctx.current_num_replicas
        reported = (ctx.aggregated_metrics or {}).get(METRIC, {})
        if not reported or replicas == 0:
            return ctx.target_num_replicas, {}
        ratio = max(reported.values())  # every replica relays the same application-wide figure
        return max(1, math.ceil(replicas * ratio / self.target)), {}
