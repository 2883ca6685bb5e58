"""A local Ray cluster for the tests that need one."""

from __future__ import annotations

from typing import Any

import ray


def init_local_ray(**options: Any) -> None:
    """`ray.init` of a cluster of its own, whatever else runs on this machine; started once more if its raylet did
    not register within Ray's 30 s, as happened once in the long tier on a loaded 2-core VM."""
    try:
        ray.init(address="local", **options)
    except Exception as error:
        if "timed out during startup" not in str(error):
            raise
        ray.shutdown()
        ray.init(address="local", **options)
