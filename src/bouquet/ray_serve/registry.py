"""The application's registry, one small deployment: what the replicas and the gateways tell each other through it.

- Replicas: each bouquet replica (its gRPC server on a free port of its node) renews its address here every
  `RENEW_SECONDS`; an address not renewed within `LEASE_SECONDS` is gone. A replica that stops says so at once; one
  killed outright stops renewing. The gateways follow the list as `--replicas-dns` follows a DNS name (the pool's
  health watch has noticed a dead replica long before its lease ends: this only tidies it away).
- Demand: each gateway reports what its admission sees (tokens waiting and admitted, tokens admitted at once); the
  replicas hand the ratio of the sums to Ray Serve's autoscaler (autoscaling.py), since requests reach them over
  gRPC, not through Ray Serve, whose own count of a replica's requests stays at zero.

The registry keeps all this in memory: restarted, it is empty until the next renewals, so for a lease it says its
list is not complete, and a gateway then adds what it lists but retires nothing."""

from __future__ import annotations

import time
from dataclasses import dataclass

from ray import serve

RENEW_SECONDS = 0.5
LEASE_SECONDS = 3.0
# A call to the registry abandoned after this long (one being restarted queues its calls), tried at the next turn.
CALL_SECONDS = 2.0


@dataclass(frozen=True)
class Demand:
    """One gateway's admission, as its metrics say (docs/scaling.md)."""

    wanted_tokens: float  # waiting for admission + admitted and not yet answered
    limit_tokens: float  # admitted at once


# Every gateway and replica calls it twice a second: no access log line for each.
@serve.deployment(
    num_replicas=1,
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,
    logging_config={"enable_access_log": False},
)
class Registry:
    # Its methods are coroutines so that Ray Serve runs them on the replica's event loop, one at a time, rather
    # than on a thread pool: the dicts need no lock.
    def __init__(self) -> None:
        self._started = time.monotonic()
        self._replicas: dict[str, tuple[str, float]] = {}  # replica id: (address, lease end)
        self._demand: dict[str, tuple[Demand, float]] = {}  # gateway id: (its demand, lease end)

    async def renew(self, replica_id: str, address: str) -> None:
        self._replicas[replica_id] = (address, time.monotonic() + LEASE_SECONDS)

    async def leave(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    async def replicas(self) -> tuple[list[str], bool]:
        """The addresses of the replicas serving now, and whether the list is complete (every replica alive has
        renewed since this registry started)."""
        now = time.monotonic()
        self._replicas = {key: entry for key, entry in self._replicas.items() if entry[1] > now}
        complete = now - self._started > LEASE_SECONDS
        return sorted(address for address, _ in self._replicas.values()), complete

    async def report_demand(self, gateway_id: str, demand: Demand) -> None:
        self._demand[gateway_id] = (demand, time.monotonic() + LEASE_SECONDS)

    async def demand_ratio(self) -> float | None:
        """Demand over capacity across the gateways: 1 is the replicas exactly busy; None before any report."""
        now = time.monotonic()
        self._demand = {key: entry for key, entry in self._demand.items() if entry[1] > now}
        if not self._demand:
            return None
        wanted = sum(demand.wanted_tokens for demand, _ in self._demand.values())
        limit = sum(demand.limit_tokens for demand, _ in self._demand.values())
        return wanted / max(limit, 1.0)
