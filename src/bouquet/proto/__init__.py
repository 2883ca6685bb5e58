"""The replica wire format: embedding.proto and its committed generated code, and the wire's version."""

from __future__ import annotations

import importlib.metadata

# Raised when a change to embedding.proto or to what its fields mean would let a gateway and a replica of different
# releases misread each other (a field renumbered, a meaning changed); added fields, which the other side ignores,
# leave it as it is. Sent in InfoResponse.wire_version.
WIRE_VERSION = 1


def bouquet_version() -> str:
    """This installation's release, as its package metadata says."""
    try:
        return importlib.metadata.version("bouquet")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
