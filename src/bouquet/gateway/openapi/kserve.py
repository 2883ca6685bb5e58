"""The Open Inference Protocol's (KServe v2) bodies for embedding models (gateway/api/kserve.py): the infer
request with its one BYTES tensor of texts, and the answers. The binary tensor data extension (a JSON header of
`Inference-Header-Content-Length` bytes, then raw tensors) is described in words: OpenAPI has no schema for it."""

from __future__ import annotations

from bouquet.gateway.openapi.pieces import (
    BOOLEAN,
    COUNT,
    INTEGER,
    NUMBER,
    STRING,
    TEXT,
    Schema,
    array_of,
    json_object,
    named,
    nullable,
    response_schema,
)

_PARAMETERS = json_object(
    {
        "dimensions": nullable({**INTEGER, "minimum": 1, "description": "keep the first k of each row"}),
        "normalize": nullable(BOOLEAN),
        "prompt_name": nullable(STRING),
        "binary_data_output": nullable({**BOOLEAN, "description": "the embedding as raw float32 after a JSON header"}),
    },
    closed=False,
    description="request parameters; others are ignored, as the protocol's servers do",
)
_TENSOR = json_object(
    {
        "name": {**STRING, "description": "any: the model has one input"},
        "shape": array_of({**INTEGER, "minimum": 0}, 1, description="the texts' count (their product)"),
        "datatype": {"type": "string", "enum": ["BYTES"]},
        "data": array_of({"anyOf": [TEXT, array_of(TEXT)]}, description="texts, row-major (nested or flat)"),
        "parameters": nullable(json_object({"binary_data_size": nullable(COUNT)}, closed=False)),
    },
    ("name", "shape", "datatype"),
    closed=False,
)
_BINARY = nullable(json_object({"binary_data": nullable(BOOLEAN)}, closed=False))
_OUTPUT = json_object(
    {"name": {"type": "string", "enum": ["embedding"]}, "parameters": _BINARY},
    ("name",),
    closed=False,
)
KSERVE_INFER_REQUEST = named("KServeInferRequest", json_object(
    {"id": nullable(STRING), "parameters": nullable(_PARAMETERS), "inputs": array_of(_TENSOR, 1, maxItems=1),
     "outputs": nullable(array_of(_OUTPUT))},
    ("inputs",),
    closed=False,
    description="Or, with the binary tensor data extension, this object as a JSON header of "
    "Inference-Header-Content-Length bytes followed by each BYTES element as a little-endian uint32 length and "
    "its UTF-8 bytes (the input's parameters.binary_data_size in all).",
    example={"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a query", "a document"]}]},
))  # fmt: skip
KSERVE_INFER_RESPONSE = named("KServeInferResponse", response_schema({
    "model_name": STRING, "model_version": STRING, "id": STRING,
    "outputs": array_of(json_object({
        "name": {"type": "string", "enum": ["embedding"]}, "datatype": {"type": "string", "enum": ["FP32"]},
        "shape": array_of(COUNT, 2, maxItems=2, description="[texts, width]"),
        "data": array_of(NUMBER, description="row-major; left out when the output is binary"),
        "parameters": response_schema({"binary_data_size": COUNT}),
    }, ("name", "datatype", "shape")), 1, maxItems=1),
}))  # fmt: skip
_TENSOR_METADATA = response_schema(
    {"name": STRING, "datatype": STRING, "shape": array_of(INTEGER, 1, description="-1: any size")}
)
KSERVE_MODEL_METADATA = named("KServeModelMetadata", response_schema({
    "name": STRING, "versions": array_of(STRING), "platform": STRING,
    "inputs": array_of(_TENSOR_METADATA), "outputs": array_of(_TENSOR_METADATA),
}))  # fmt: skip
KSERVE_SERVER_METADATA = named("KServeServerMetadata", response_schema(
    {"name": STRING, "version": STRING, "extensions": array_of(STRING)}
))  # fmt: skip
_TRUE: Schema = {"type": "boolean", "enum": [True]}
KSERVE_LIVE = named("KServeLive", response_schema({"live": _TRUE}))
KSERVE_READY = named("KServeReady", response_schema({"ready": _TRUE}))
KSERVE_MODEL_READY = named("KServeModelReady", response_schema({"name": STRING, "ready": _TRUE}))
KSERVE_ERROR_BODY: Schema = response_schema({"error": STRING})
KSERVE_VERSION_PATH: Schema = {
    "name": "version", "in": "path", "required": True, "schema": {"type": "string", "enum": ["1"]},
    "description": "a served model has one version",
}  # fmt: skip
