"""The chunks waiting for room at a replica of a model (pool.py): a heap, smaller requests first, then in order of
arrival; the first in line looks again every few milliseconds (a replica back, an ejection over), the others sleep
until they are first. And the wait of a request that finds no replica serving its model while one went down only a
moment ago."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bouquet.gateway.replicas.replica import Replica

RECHECK_S = 0.05  # a waiting chunk looks again this often


@dataclass(order=True)
class Waiter:
    """A chunk waiting for room at a replica: smaller requests first, then in order of arrival."""

    priority: int
    arrival: int
    tried: set[Replica] = field(default_factory=set, compare=False)  # replicas it may not go back to
    event: asyncio.Event = field(default_factory=asyncio.Event, compare=False)


async def wait_turn(me: Waiter, queue: list[Waiter]) -> None:
    """The first in line looks again within `RECHECK_S`; the others sleep until they are first (`wake_next`)."""
    me.event.clear()
    if queue[0] is me:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(me.event.wait(), RECHECK_S)
    else:
        await me.event.wait()


def wake_next(queue: list[Waiter] | None) -> None:
    if queue:
        queue[0].event.set()


async def back_within(serving: Callable[[], bool], went_down: float | None, seconds: float) -> bool:
    """Whether `serving()`, now or once it is, until `seconds` after `went_down` (when the last of the replicas went
    down; None: none did). A replica that misses a keepalive ping on a loaded host is down for a moment, then serves
    again: requests arriving meanwhile wait for it rather than being answered 503."""
    while not serving():
        if went_down is None or time.monotonic() >= went_down + seconds:
            return False
        await asyncio.sleep(RECHECK_S)
    return True
