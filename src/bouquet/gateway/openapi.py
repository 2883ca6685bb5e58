"""The OpenAPI description of the gateway's routes, written out (the routes check their bodies by hand), and
the interactive docs page that renders it, with Swagger UI's files served by the gateway itself."""

from __future__ import annotations

from functools import cache
from typing import Any

from swagger_ui_bundle import swagger_ui_path

_INPUT = {
    "oneOf": [
        {"type": "string"},
        {"type": "array", "items": {"type": "string"}},
        {"type": "array", "items": {"type": "integer"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
    ]
}
_ERROR = {
    "type": "object",
    "properties": {
        "error": {
            "type": "object",
            "properties": {k: {"type": "string", "nullable": True} for k in ("message", "type", "param", "code")},
        }
    },
}
_OPENAI_REQUEST = {
    "type": "object",
    "required": ["input"],
    "properties": {
        "input": _INPUT,
        "model": {"type": "string", "description": "a served model's id; GET /v1/models lists them"},
        "encoding_format": {"type": "string", "enum": ["float", "base64"], "default": "float"},
        "dimensions": {"type": "integer", "minimum": 1, "description": "keep the first N values, renormalised"},
        "user": {"type": "string"},
    },
}
_TEI_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "inputs": _INPUT,
        "model": {"type": "string", "description": "default: the first model the gateway found"},
        "normalize": {"type": "boolean", "default": True},
        "truncate": {"type": "boolean", "default": True, "description": "false: over-long input is a 413"},
        "truncation_direction": {"type": "string", "enum": ["right", "left"], "default": "right"},
        "prompt_name": {"type": "string", "description": "one of the model's sentence-transformers prompts"},
        "dimensions": {"type": "integer", "minimum": 1},
    },
}
_TOKENIZE_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "inputs": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
        "add_special_tokens": {"type": "boolean", "default": True},
        "prompt_name": {"type": "string"},
    },
}
_TEXTS = {"type": "array", "items": {"type": "string"}, "minItems": 1}
_INSTRUCTION = {"type": "string", "description": "a decoder reranker's (Qwen3-Reranker) instruction; default its own"}
_SEQUENCE = {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 2}  # a text, or a pair
_PREDICT_REQUEST = {
    "type": "object",
    "required": ["inputs"],
    "properties": {
        "inputs": {"oneOf": [{"type": "string"}, _SEQUENCE, {"type": "array", "items": _SEQUENCE, "minItems": 1}]},
        "model": {"type": "string"},
        "raw_scores": {"type": "boolean", "default": False, "description": "the logits, no softmax or sigmoid"},
        "truncate": {"type": "boolean", "default": True},
        "truncation_direction": {"type": "string", "enum": ["right", "left"], "default": "right"},
        "instruction": _INSTRUCTION,
    },
}
_TEI_RERANK_REQUEST = {
    "type": "object",
    "required": ["query", "texts"],
    "properties": {
        "query": {"type": "string"},
        "texts": _TEXTS,
        "model": {"type": "string"},
        "raw_scores": {"type": "boolean", "default": False, "description": "the logits, no activation"},
        "return_text": {"type": "boolean", "default": False},
        "truncate": {"type": "boolean", "default": True},
        "instruction": _INSTRUCTION,
    },
}
_RERANK_REQUEST = {
    "type": "object",
    "required": ["query", "documents"],
    "properties": {
        "query": {"type": "string"},
        "documents": {
            "type": "array",
            "minItems": 1,
            "items": {"oneOf": [{"type": "string"}, {"type": "object", "properties": {"text": {"type": "string"}}}]},
        },
        "model": {"type": "string"},
        "top_n": {"type": "integer", "minimum": 1},
        "return_documents": {"type": "boolean", "default": True},
        "instruction": _INSTRUCTION,
    },
}
_SCORE_REQUEST = {
    "type": "object",
    "required": ["text_1", "text_2"],
    "properties": {
        "model": {"type": "string"},
        "text_1": {"oneOf": [{"type": "string"}, _TEXTS]},
        "text_2": {"oneOf": [{"type": "string"}, _TEXTS]},
        "truncate": {"type": "boolean", "default": True},
        "instruction": _INSTRUCTION,
    },
}
_MODEL_PARAMETER = {"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}
_ERRORS = {
    str(status): {"description": text, "content": {"application/json": {"schema": _ERROR}}}
    for status, text in [
        (400, "invalid input"), (401, "missing or wrong API key"), (404, "unknown model"),
        (413, "over a size limit"), (422, "wrong type"), (429, "over capacity; see Retry-After"),
        (503, "no healthy replica"),
    ]
}  # fmt: skip


def _operation(summary: str, request: dict[str, Any] | None = None) -> dict[str, Any]:
    operation: dict[str, Any] = {"summary": summary, "responses": {"200": {"description": "OK"}, **_ERRORS}}
    if request is not None:
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": request}}}
    return operation


@cache
def openapi_spec() -> dict[str, Any]:
    return {
        "openapi": "3.0.3",
        "info": {"title": "bouquet", "version": "0.1.0", "description": "OpenAI- and TEI-compatible embeddings"},
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/embeddings": {"post": _operation("OpenAI: embed text or token ids", _OPENAI_REQUEST)},
            "/v1/models": {"get": _operation("OpenAI: the served models")},
            "/v1/models/{model}": {"get": {**_operation("OpenAI: one served model"), "parameters": [_MODEL_PARAMETER]}},
            "/v1/rerank": {"post": _operation("Cohere / Jina / vLLM: rerank documents", _RERANK_REQUEST)},
            "/rerank": {"post": _operation("TEI (texts) or Cohere / Jina (documents): rerank", _TEI_RERANK_REQUEST)},
            "/predict": {"post": _operation("TEI: a classifier's labels for texts or pairs", _PREDICT_REQUEST)},
            "/score": {"post": _operation("vLLM: score pairs with a cross-encoder", _SCORE_REQUEST)},
            "/v1/score": {"post": _operation("vLLM: score pairs with a cross-encoder", _SCORE_REQUEST)},
            "/embed": {"post": _operation("TEI: embed text or token ids", _TEI_REQUEST)},
            "/tokenize": {"post": _operation("TEI: tokens with their offsets", _TOKENIZE_REQUEST)},
            "/info": {"get": _operation("TEI: the model, its limits and pooling")},
            "/health": {"get": _operation("200 while a replica is healthy, else 503")},
            "/metrics": {"get": _operation("Prometheus metrics")},
        },
    }


# Swagger UI's own files, from the swagger-ui-bundle package and served by the gateway under /docs/: the machines
# it runs on may have no internet, so the page loads nothing from a CDN. Only these names are served.
DOCS_ASSETS = {"swagger-ui.css": "text/css", "swagger-ui-bundle.js": "text/javascript"}
DOCS_HTML = """<!doctype html>
<html><head><title>bouquet API</title><meta charset="utf-8">
<link rel="stylesheet" href="/docs/swagger-ui.css"></head>
<body><div id="ui"></div>
<script src="/docs/swagger-ui-bundle.js"></script>
<script>SwaggerUIBundle({url: "/openapi.json", dom_id: "#ui"});</script>
</body></html>
"""


@cache
def docs_asset(name: str) -> bytes:
    """One of DOCS_ASSETS, read once."""
    assert name in DOCS_ASSETS, f"{name!r} is not a docs asset"
    return (swagger_ui_path / name).read_bytes()
