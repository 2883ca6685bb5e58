"""The event loop every bouquet process runs on: uvloop where it is installed (a dependency), else asyncio's.

uvloop's cross-thread wake-up (`call_soon_threadsafe`, which hands each finished engine step to the replica's
loop) and its socket handling are cheaper than asyncio's; on a short query that is a measurable share of the
replica's added latency (docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; asyncio's own loop also works
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on the fastest available loop."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
