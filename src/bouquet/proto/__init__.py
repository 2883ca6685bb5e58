"""The replica wire format: embedding.proto and its committed generated code."""
