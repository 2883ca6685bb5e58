"""Jina's multi-vector bodies (gateway/api/jina.py): ColBERT per-token vectors, one row a kept token."""

from __future__ import annotations

from bouquet.gateway.api.jina import EMBEDDING_TYPES
from bouquet.gateway.openapi.pieces import (
    BOOLEAN,
    COUNT,
    INTEGER,
    NUMBER,
    STRING,
    TEXT,
    array_of,
    json_object,
    named,
    nullable,
    response_schema,
)

_INPUT = {"anyOf": [TEXT, array_of({"anyOf": [TEXT, json_object({"text": TEXT}, ("text",))]}, 1)]}
MULTI_VECTOR_REQUEST = named("MultiVectorRequest", json_object(
    {
        "input": _INPUT,
        "model": nullable(STRING),
        "input_type": nullable({"type": "string", "enum": ["query", "document"], "description": "default document"}),
        "embedding_type": nullable({"type": "string", "enum": list(EMBEDDING_TYPES)}),
        "dimensions": nullable({**INTEGER, "description": "each token vector cut to this width, then normalised"}),
        "truncate": nullable({**BOOLEAN, "description": "false: an input over the model's length is a 400"}),
    },
    ("input",),
    description="Per-token (ColBERT) vectors; a field the route does not take is refused (400).",
))  # fmt: skip
_ROW = {"anyOf": [array_of(NUMBER), STRING], "description": "a token's vector: numbers, or base64 of its bytes"}
MULTI_VECTOR_RESPONSE = named("MultiVectorList", response_schema({
    "object": {"type": "string", "enum": ["list"]}, "model": STRING,
    "data": array_of(response_schema({
        "object": {"type": "string", "enum": ["embeddings"]}, "index": COUNT, "embeddings": array_of(_ROW),
    })),
    "usage": response_schema({"total_tokens": COUNT, "prompt_tokens": COUNT}),
}))  # fmt: skip
