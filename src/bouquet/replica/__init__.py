"""The replica: a gRPC scheduler that batches first come, first served by token budget over one engine."""
