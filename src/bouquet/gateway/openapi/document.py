"""The errors each route can answer, the operations, and the document assembled from them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

from bouquet.gateway import errors
from bouquet.gateway.openapi.docs_page import DOCS_ASSETS
from bouquet.gateway.openapi.pieces import COMPONENTS, STRING, Schema, named, nullable, response_schema
from bouquet.gateway.openapi.requests import (
    COHERE_RERANK_REQUEST,
    COHERE_V2_EMBED_REQUEST,
    COHERE_V2_RERANK_REQUEST,
    COMPUTE_SCORE_REQUEST,
    CONTEXTUAL_REQUEST,
    DECODE_REQUEST,
    DETOKENIZE_REQUEST,
    EMBED_ALL_REQUEST,
    EMBED_SPARSE_REQUEST,
    ENCODE_REQUEST,
    IMAGE_EMBEDDINGS_REQUEST,
    KSERVE_INFER_REQUEST,
    MULTI_VECTOR_REQUEST,
    OPENAI_EMBEDDINGS_REQUEST,
    PREDICT_REQUEST,
    RERANK_REQUEST,
    SCORE_REQUEST,
    SIMILARITY_REQUEST,
    TEI_EMBED_REQUEST,
    TEI_ROOT_REQUEST,
    TOKENIZE_REQUEST,
)
from bouquet.gateway.openapi.responses import (
    COHERE_RANKING,
    COHERE_V2_EMBEDDINGS,
    COHERE_V2_RANKING,
    CONTEXTUAL,
    DECODED,
    DETOKENIZED,
    ENCODED,
    HEALTH,
    INFO,
    KSERVE_INFER_RESPONSE,
    KSERVE_LIVE,
    KSERVE_MODEL_METADATA,
    KSERVE_MODEL_READY,
    KSERVE_READY,
    KSERVE_SERVER_METADATA,
    MODE_SCORES,
    MODEL_CARD,
    MODELS,
    MULTI_VECTOR_RESPONSE,
    OPENAI_EMBEDDINGS,
    PREDICTIONS,
    SCORES,
    SIMILARITIES,
    SPARSE_ROWS,
    TEI_RANKING,
    TEI_ROWS,
    TEI_TOKENS,
    TOKEN_STATES,
    VLLM_TOKENS,
)

# Errors


def error_classes() -> list[type[errors.ApiError]]:
    found, stack = [], [errors.ApiError]
    while stack:
        cls = stack.pop()
        found.append(cls)
        stack.extend(cls.__subclasses__())
    return found


# OpenAI's `error.type` for each status, as errors.py's classes give it.
OPENAI_ERROR_TYPES: dict[int, set[str]] = {}
for _cls in error_classes():
    OPENAI_ERROR_TYPES.setdefault(_cls.status, set()).add(_cls.type)
OPENAI_ERROR_TYPES.setdefault(405, set()).add(errors.InvalidRequest.type)  # http/endpoint.not_found's 405
# TEI's `error_type` for each status on TEI's routes, as errors.tei_error maps them.
TEI_ERROR_TYPES: dict[int, tuple[str, ...]] = {
    400: ("Empty", "Validation"), 401: ("authentication_error",), 404: ("invalid_request_error",),
    408: ("invalid_request_error",), 413: ("Validation",), 415: ("invalid_request_error",), 422: ("Validation",),
    424: ("Backend",), 429: ("Overloaded",), 503: ("Unhealthy",),
}  # fmt: skip


def openai_error(status: int) -> Schema:
    return named(f"OpenAIError{status}", response_schema({
        "error": response_schema({
            "message": STRING, "type": {"type": "string", "enum": sorted(OPENAI_ERROR_TYPES[status])},
            "param": nullable({**STRING, "description": "the field at fault"}),
            "code": {**STRING, "description": "what went wrong: invalid_json, empty_input, model_not_found, ..."},
        })
    }))  # fmt: skip


def tei_error(status: int) -> Schema:
    error_type = {"type": "string", "enum": list(TEI_ERROR_TYPES[status])}
    return named(f"TEIError{status}", response_schema({"error": STRING, "error_type": error_type}))


STATUS_TEXT = {
    400: "invalid input: unreadable JSON, an empty input, an invalid value, a field the route does not take",
    401: "no valid API key (`Authorization: Bearer KEY`), where the server runs with --api-key",
    404: "no such model",
    408: "the headers or the body stopped arriving (then the connection closes)",
    413: "over a limit: body bytes, inputs, tokens, or an over-long input with truncate=false",
    415: "a Content-Encoding other than gzip",
    422: "a body or field of the wrong type",
    424: "the model cannot do this (a reranker asked to embed, or the reverse), or the replicas failed",
    429: "over capacity; retry after Retry-After",
    431: "the request line and headers are over the limit (then the connection closes)",
    503: "no healthy replica serves the model, or every connection is busy (with Retry-After)",
}
# What else TEI's mapping (errors.tei_error) answers with a status, on TEI's routes.
_TEI_ANSWERED = {
    400: "error_type Empty for an empty input, Validation for unreadable JSON",
    413: "also TEI's validation errors: a bad dimensions, prompt_name, token id or truncation_direction",
    422: "also a missing field, or one the route does not take",
}

# Error statuses by cause. Every route: the connection's own answers (http/protocol.py, OpenAI-shaped): 408 headers
# too slow, 431 headers too large, 503 every connection busy.
CONNECTION = frozenset({408, 431, 503})
BODY = frozenset({400, 408, 413, 415, 422})  # http/body.read_body and the route's parser
MODEL_LOOKUP = frozenset({404, 503})  # ModelCatalog.get: unknown model; no replica has reported yet
WORK = frozenset({429})  # max_concurrent_requests, and admission for those that compute
COMPUTE = BODY | MODEL_LOOKUP | WORK  # a body read, a model found, rows computed
TEI_COMPUTE = COMPUTE | {424}  # TEI's status for a model of the wrong task or a failed replica


@dataclass(frozen=True)
class Operation:
    """One route and method: its request, its 200 answer, and the error statuses it can answer."""

    path: str
    method: str
    summary: str
    tag: str
    ok: dict[str, Schema]  # media type -> the 200 body
    request: Schema | None = None
    statuses: frozenset[int] = frozenset()  # besides CONNECTION, and 401 where the key applies
    errors: str = "openai"  # "openai", "tei", "both" (/rerank and /tokenize: by the body), "cohere" or "kserve"
    public: bool = False  # no API key asked (TEI keeps these open)
    parameters: tuple[Schema, ...] = ()
    uploads: tuple[tuple[str, Schema], ...] = ()  # media types the request may also come in, besides JSON

    def error_statuses(self) -> list[int]:
        return sorted(self.statuses | CONNECTION | (set() if self.public else {401}))


_BINARY: Schema = {"type": "string", "format": "binary"}
# /embeddings_image's raw bytes (api/image_upload.py): a body that is one image file (any image/* type, or
# octet-stream) with the options in the query string, or a form of image files with the options as fields.
IMAGE_BODY_OPTIONS: tuple[Schema, ...] = tuple(
    {"name": name, "in": "query", "required": False, "schema": schema,
     "description": f"with a body that is an image's bytes: the JSON body's `{name}` (ignored with a JSON body)"}
    for name, schema in (("model", STRING), ("encoding_format", STRING), ("dimensions", {"type": "integer",
                                                                                         "minimum": 1}))
)  # fmt: skip
IMAGE_UPLOADS: tuple[tuple[str, Schema], ...] = (
    ("application/octet-stream", {**_BINARY, "description": "one image file (or Content-Type: image/png etc.)"}),
    ("multipart/form-data", {
        "type": "object", "required": ["input"],
        "properties": {
            "input": {"type": "array", "items": _BINARY, "minItems": 1,
                      "description": "image files, in order (a file part under any field name is an image)"},
            "model": STRING, "encoding_format": STRING, "dimensions": {"type": "integer", "minimum": 1},
        },
    }),
)  # fmt: skip


def _json(schema: Schema) -> dict[str, Schema]:
    return {"application/json": schema}


_MODEL_PATH = {
    "name": "model", "in": "path", "required": True, "schema": STRING, "example": "all-MiniLM-L6-v2",
    "description": "a model's id (its names may hold a slash: sentence-transformers/all-MiniLM-L6-v2)",
}  # fmt: skip
_MODEL_QUERY = {"name": "model", "in": "query", "required": False, "schema": STRING, "description": "default: first"}
_ASSET_PATH = {"name": "asset", "in": "path", "required": True, "schema": {"type": "string", "enum": list(DOCS_ASSETS)}}

KSERVE_ERROR_BODY: Schema = response_schema({"error": STRING})  # the Open Inference Protocol's
KSERVE_VERSION_PATH: Schema = {
    "name": "version", "in": "path", "required": True, "schema": {"type": "string", "enum": ["1"]},
    "description": "a served model has one version",
}  # fmt: skip
# KServe's routes with and without a version: /v2/models/{model}/... and /v2/models/{model}/versions/1/...
_KSERVE_VERSIONS: tuple[tuple[str, tuple[Schema, ...]], ...] = (
    ("", (_MODEL_PATH,)),
    ("/versions/{version}", (_MODEL_PATH, KSERVE_VERSION_PATH)),
)

OPERATIONS: tuple[Operation, ...] = (
    # OpenAI's, and Infinity's without the /v1 prefix
    *(
        Operation(path, "post", "OpenAI / Infinity: embed texts or token ids", "OpenAI", _json(OPENAI_EMBEDDINGS),
                  OPENAI_EMBEDDINGS_REQUEST, COMPUTE)
        for path in ("/v1/embeddings", "/embeddings")
    ),
    Operation("/embeddings_image", "post", "Infinity: embed images (data URIs, base64, or raw bytes)", "OpenAI",
              _json(OPENAI_EMBEDDINGS), IMAGE_EMBEDDINGS_REQUEST, COMPUTE, parameters=IMAGE_BODY_OPTIONS,
              uploads=IMAGE_UPLOADS),
    *(Operation(path, "get", "OpenAI / Infinity: the served models", "OpenAI", _json(MODELS)) for path in
      ("/v1/models", "/models")),
    Operation("/v1/models/{model}", "get", "OpenAI: one served model", "OpenAI", _json(MODEL_CARD),
              statuses=MODEL_LOOKUP, parameters=(_MODEL_PATH,)),
    # text-embeddings-inference's, with its error bodies
    Operation("/", "post", "TEI / Hugging Face Inference API: embed, or similarities", "TEI",
              _json({"oneOf": [TEI_ROWS, SIMILARITIES]}), TEI_ROOT_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/embed", "post", "TEI: embed texts or token ids", "TEI", _json(TEI_ROWS), TEI_EMBED_REQUEST,
              TEI_COMPUTE, "tei"),
    Operation("/embed_sparse", "post", "TEI: each input's sparse row (SPLADE, bge-m3's sparse head)", "TEI",
              _json(SPARSE_ROWS), EMBED_SPARSE_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/embed_all", "post", "TEI: every token's state, no pooling", "TEI", _json(TOKEN_STATES),
              EMBED_ALL_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/similarity", "post", "TEI: cosine of a sentence with others", "TEI", _json(SIMILARITIES),
              SIMILARITY_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/rerank", "post", "TEI (texts) or Cohere / Jina (documents): rerank with a cross-encoder", "Rerank",
              _json({"oneOf": [TEI_RANKING, COHERE_RANKING]}), RERANK_REQUEST, TEI_COMPUTE, "both"),
    Operation("/tokenize", "post", "TEI (inputs) or vLLM (prompt): tokens", "TEI",
              _json({"oneOf": [TEI_TOKENS, VLLM_TOKENS]}), TOKENIZE_REQUEST, COMPUTE, "both"),
    Operation("/decode", "post", "TEI: token ids back to text", "TEI", _json(DECODED), DECODE_REQUEST, COMPUTE, "tei"),
    Operation("/predict", "post", "TEI: a classifier's or cross-encoder's labels for texts or pairs", "Rerank",
              _json(PREDICTIONS), PREDICT_REQUEST, TEI_COMPUTE, "tei"),
    Operation("/info", "get", "TEI: the model, its limits and pooling", "TEI", _json(INFO), statuses=MODEL_LOOKUP,
              errors="tei", parameters=(_MODEL_QUERY,)),
    Operation("/health", "get", "200 while a replica is healthy, else 503", "Operations", _json(HEALTH),
              statuses=frozenset({503}), errors="tei", public=True),
    *(Operation("/ping", method, "vLLM's (SageMaker's probe): /health's answer", "Operations", _json(HEALTH),
                statuses=frozenset({503}), public=True) for method in ("get", "post")),
    # Cohere's, Jina's and vLLM's
    Operation("/v1/rerank", "post", "Cohere / Jina / vLLM: rerank documents with a cross-encoder", "Rerank",
              _json(COHERE_RANKING), COHERE_RERANK_REQUEST, COMPUTE),
    *(
        Operation(path, "post", "vLLM: score pairs with a cross-encoder", "Rerank", _json(SCORES), SCORE_REQUEST,
                  COMPUTE)
        for path in ("/score", "/v1/score")
    ),
    Operation("/detokenize", "post", "vLLM: token ids back to text", "vLLM", _json(DETOKENIZED),
              DETOKENIZE_REQUEST, COMPUTE),
    # Cohere's v2, with its error body
    Operation("/v2/embed", "post", "Cohere v2: embed texts, in each embedding type asked for", "Cohere",
              _json(COHERE_V2_EMBEDDINGS), COHERE_V2_EMBED_REQUEST, COMPUTE, "cohere"),
    Operation("/v2/rerank", "post", "Cohere v2: rerank documents with a cross-encoder", "Cohere",
              _json(COHERE_V2_RANKING), COHERE_V2_RERANK_REQUEST, COMPUTE, "cohere"),
    # Perplexity's
    Operation("/v1/contextualizedembeddings", "post", "Perplexity: late-chunked chunk embeddings per document",
              "Perplexity", _json(CONTEXTUAL), CONTEXTUAL_REQUEST, COMPUTE),
    # Jina's multi-vector: ColBERT's per-token vectors
    Operation("/v1/multi-vector", "post", "Jina: a ColBERT model's per-token vectors, as a query or a document",
              "Jina", _json(MULTI_VECTOR_RESPONSE), MULTI_VECTOR_REQUEST, COMPUTE),
    # FlagEmbedding's BGEM3FlagModel.encode: bge-m3's three outputs
    Operation("/encode", "post", "FlagEmbedding: bge-m3's dense, sparse and ColBERT outputs from one forward",
              "FlagEmbedding", _json(ENCODED), ENCODE_REQUEST, COMPUTE),
    Operation("/compute_score", "post", "FlagEmbedding: bge-m3's five scores of pairs (compute_score)",
              "FlagEmbedding", _json(MODE_SCORES), COMPUTE_SCORE_REQUEST, COMPUTE),
    # KServe's Open Inference Protocol (v2), with its error body
    Operation("/v2/health/live", "get", "KServe v2: the server is live", "KServe", _json(KSERVE_LIVE), public=True,
              errors="kserve"),
    Operation("/v2/health/ready", "get", "KServe v2: a replica is healthy and the gateway is not draining (else 400)",
              "KServe", _json(KSERVE_READY), statuses=frozenset({400}), public=True, errors="kserve"),
    Operation("/v2", "get", "KServe v2: the server's metadata", "KServe", _json(KSERVE_SERVER_METADATA),
              errors="kserve"),
    *(
        Operation(f"/v2/models/{{model}}{version}/infer", "post", "KServe v2: embed a BYTES tensor of texts", "KServe",
                  {**_json(KSERVE_INFER_RESPONSE), "application/octet-stream": {**STRING, "format": "binary"}},
                  KSERVE_INFER_REQUEST, COMPUTE, "kserve", parameters=parameters)
        for version, parameters in _KSERVE_VERSIONS
    ),
    *(
        Operation(f"/v2/models/{{model}}{version}/ready", "get",
                  "KServe v2: a healthy replica serves the model (else 4xx)", "KServe", _json(KSERVE_MODEL_READY),
                  statuses=MODEL_LOOKUP | {400}, errors="kserve", public=True, parameters=parameters)
        for version, parameters in _KSERVE_VERSIONS
    ),
    *(
        Operation(f"/v2/models/{{model}}{version}", "get", "KServe v2: the model's inputs and outputs", "KServe",
                  _json(KSERVE_MODEL_METADATA), statuses=MODEL_LOOKUP | {400}, errors="kserve", parameters=parameters)
        for version, parameters in _KSERVE_VERSIONS
    ),
    # public, as TEI keeps them
    Operation("/metrics", "get", "Prometheus metrics", "Operations", {"text/plain": STRING}, public=True),
    Operation("/openapi.json", "get", "this document", "Operations", _json({"type": "object"}), public=True),
    Operation("/docs", "get", "Swagger UI on this document", "Operations", {"text/html": STRING}, public=True),
    Operation("/docs/{asset}", "get", "Swagger UI's files, served by the gateway", "Operations",
              {"text/css": STRING, "text/javascript": STRING}, statuses=frozenset({404}), public=True,
              parameters=(_ASSET_PATH,)),
)  # fmt: skip

_HEADERS = {
    "x-request-id": {"description": "the client's, if it sent a usable one; else the gateway's", "schema": STRING},
    "Retry-After": {"description": "seconds to wait", "schema": {"type": "integer"}},
    "WWW-Authenticate": {"description": 'Bearer realm="bouquet"', "schema": STRING},
}


def _header(name: str, required: bool = False) -> Schema:
    return {"$ref": f"#/components/headers/{name}"} if not required else {**_HEADERS[name], "required": True}


def _error(operation: Operation, status: int) -> Schema:
    """The status's answer: TEI's shape where a TEI route answers it itself, OpenAI's where an OpenAI route does or
    the connection does (http/protocol.py answers before any route); /rerank and /tokenize answer either, by the
    body: OpenAI's to Cohere's body (`documents`) and to vLLM's (`prompt`), once the body is read."""
    own = operation.statuses | (set() if operation.public else {401})
    shapes = []
    if operation.errors in ("tei", "both") and status in own:
        shapes.append(tei_error(status))
    if operation.errors == "cohere" and status in own:
        shapes.append(named(f"CohereError{status}", response_schema({"message": STRING})))
    if operation.errors == "kserve" and status in own:
        shapes.append(named(f"KServeError{status}", KSERVE_ERROR_BODY))
    if operation.errors == "kserve" and status == 404:
        shapes.append(openai_error(404))  # a model name no route matches (a newline in it) gets the app's 404
    both = operation.errors == "both" and status in OPENAI_ERROR_TYPES
    if operation.errors == "openai" or status in CONNECTION or both:
        shapes.append(openai_error(status))
    text = STATUS_TEXT[status]
    if operation.errors in ("tei", "both") and status in _TEI_ANSWERED:
        text += f" ({_TEI_ANSWERED[status]})"
    headers = {"x-request-id": _header("x-request-id")}
    if status == 401:
        headers["WWW-Authenticate"] = _header("WWW-Authenticate", required=True)
    if status == 429:
        headers["Retry-After"] = _header("Retry-After", required=True)
    if status == 503:
        headers["Retry-After"] = _header("Retry-After")
    schema = shapes[0] if len(shapes) == 1 else {"oneOf": shapes}
    return {"description": text, "headers": headers, "content": {"application/json": {"schema": schema}}}


def _operation(operation: Operation) -> Schema:
    ok = {"description": "OK", "headers": {"x-request-id": _header("x-request-id")},
          "content": {media: {"schema": schema} for media, schema in operation.ok.items()}}  # fmt: skip
    responses = {"200": ok, **{str(status): _error(operation, status) for status in operation.error_statuses()}}
    described: Schema = {"summary": operation.summary, "tags": [operation.tag], "responses": responses}
    described["operationId"] = f"{operation.method}_{operation.path.strip('/').replace('/', '_') or 'root'}"
    described["operationId"] = described["operationId"].replace("{", "").replace("}", "").replace(".", "_")
    if operation.parameters:
        described["parameters"] = list(operation.parameters)
    if operation.request is not None:
        content = {"application/json": {"schema": operation.request}} | {m: {"schema": s} for m, s in operation.uploads}
        described["requestBody"] = {"required": True, "content": content}
    if operation.public:
        described["security"] = []
    return described


_TAGS = ("OpenAI", "TEI", "Rerank", "vLLM", "Cohere", "Jina", "FlagEmbedding", "Perplexity", "KServe", "Operations")


@cache
def openapi_spec() -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for operation in OPERATIONS:
        paths.setdefault(operation.path, {})[operation.method] = _operation(operation)  # names its error schemas
    return {
        "openapi": "3.0.3",
        "info": {
            "title": "bouquet",
            "version": "0.1.0",
            "description": "OpenAI-, vLLM-, Infinity-, TEI-, Cohere- and Perplexity-compatible embeddings and "
            "reranking. Errors are OpenAI's `{error: {message, type, param, code}}`, on TEI's routes TEI's "
            "`{error, error_type}` (OpenAI's again once a Cohere-shaped /rerank or a vLLM-shaped /tokenize body is "
            "read); the connection's own answers (408, 431, 503 at the connection cap) are OpenAI's on every route. "
            "A body is read as JSON whatever its Content-Type, and may be gzip-compressed "
            "(Content-Encoding: gzip; another encoding is a 415).",
        },
        "tags": [{"name": n} for n in _TAGS],
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "--api-key"}},
            "headers": _HEADERS,
            "schemas": dict(sorted(COMPONENTS.items())),
        },
        "security": [{"bearer": []}],
        "paths": paths,
    }
