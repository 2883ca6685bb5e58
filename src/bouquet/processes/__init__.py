"""The processes around the gateway and the replicas: `bouquet serve`, `bouquet gateway --workers N`, the
supervisor both use, and the lock that outlives serve (no HTTP and no model here)."""
