"""Jina's multi-vector answer (gateway/api/jina.py): ColBERT per-token vectors, one row a kept token."""

from __future__ import annotations

from bouquet.gateway.openapi.pieces import (
    COUNT,
    NUMBER,
    STRING,
    array_of,
    named,
    response_schema,
)

_ROW = {"anyOf": [array_of(NUMBER), STRING], "description": "a token's vector: numbers, or base64 of its bytes"}
MULTI_VECTOR_RESPONSE = named("MultiVectorList", response_schema({
    "object": {"type": "string", "enum": ["list"]}, "model": STRING,
    "data": array_of(response_schema({
        "object": {"type": "string", "enum": ["embeddings"]}, "index": COUNT, "embeddings": array_of(_ROW),
    })),
    "usage": response_schema({"total_tokens": COUNT, "prompt_tokens": COUNT}),
}))  # fmt: skip
