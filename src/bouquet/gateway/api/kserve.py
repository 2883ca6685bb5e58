"""KServe's Open Inference Protocol (v2) over REST, as KServe and Triton clients call it: `GET /v2/health/live`,
`/v2/health/ready`, `/v2` (server metadata), `/v2/models/{model}` and `.../ready`, and `POST
/v2/models/{model}/infer` (also under `/versions/1/`), for embedding models: one BYTES input of N texts (any
name; "text" in the metadata), one FP32 output "embedding" of shape [N, width]. Request `parameters` may carry
`dimensions`, `normalize` and `prompt_name`, as the other embedding routes take them.

Both of the protocol's encodings: tensors as JSON, and the binary tensor data extension (Triton's client sends it by
default): the JSON header's length in `Inference-Header-Content-Length`, each binary input's bytes after it
(`binary_data_size`; a BYTES element is a little-endian uint32 length and its bytes), and an output asked for in
binary (`binary_data`, or the request's `binary_data_output`) answered as raw little-endian float32 after the
JSON header. Errors are the protocol's `{"error": message}`, with the status of their kind."""

from __future__ import annotations

import math
import struct
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.gateway.api.fields import optional_field
from bouquet.gateway.errors import InvalidRequest, NotFound, Unavailable, Unprocessable
from bouquet.gateway.http.body import parse_json_object, read_body
from bouquet.gateway.http.endpoint import Handler, endpoint, json_response, unless_disconnected
from bouquet.gateway.http.error_responses import kserve_error_response
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service, embedding_model

INPUT_NAME, OUTPUT_NAME = "text", "embedding"
VERSION = "1"  # a served model has one version
HEADER_LENGTH = "inference-header-content-length"
_UINT32 = struct.Struct("<I")


def routes() -> list[Route]:
    def get(path: str, handler: Handler, public: bool = False) -> Route:
        return Route(path, endpoint(path, handler, public=public, errors=kserve_error_response), methods=["GET"])

    def infer(path: str) -> Route:
        return Route(path, endpoint(path, _infer, work=True, errors=kserve_error_response), methods=["POST"])

    return [
        get("/v2/health/live", _live, public=True),
        get("/v2/health/ready", _ready, public=True),
        get("/v2", _server_metadata),
        infer("/v2/models/{model:path}/versions/{version}/infer"),
        infer("/v2/models/{model:path}/infer"),
        get("/v2/models/{model:path}/versions/{version}/ready", _model_ready, public=True),
        get("/v2/models/{model:path}/ready", _model_ready, public=True),
        get("/v2/models/{model:path}/versions/{version}", _model_metadata),
        get("/v2/models/{model:path}", _model_metadata),
    ]


async def _live(service: Service, request: Request) -> Response:
    return json_response({"live": True})


async def _ready(service: Service, request: Request) -> Response:
    if not service.pool.any_healthy():
        raise Unavailable("no replica is healthy", "no_healthy_replica")
    return json_response({"ready": True})


async def _server_metadata(service: Service, request: Request) -> Response:
    return json_response({"name": "bouquet", "version": "0.1.0", "extensions": ["binary_tensor_data"]})


def _model(service: Service, request: Request) -> ServedModel:
    version = request.path_params.get("version")
    if version is not None and version != VERSION:
        raise NotFound(f"the model has one version, {VERSION!r}, not {version!r}", "not_found", "version")
    return embedding_model(service, request.path_params["model"])


async def _model_ready(service: Service, request: Request) -> Response:
    model = _model(service, request)
    if not service.pool.any_healthy(model.name):
        raise Unavailable(f"no healthy replica serves the model {model.id!r}", "no_healthy_replica", "model")
    return json_response({"name": model.id, "ready": True})


async def _model_metadata(service: Service, request: Request) -> Response:
    model = _model(service, request)
    return json_response({
        "name": model.id, "versions": [VERSION], "platform": "bouquet",
        "inputs": [{"name": INPUT_NAME, "datatype": "BYTES", "shape": [-1]}],
        "outputs": [{"name": OUTPUT_NAME, "datatype": "FP32", "shape": [-1, model.dimension]}],
    })  # fmt: skip


@dataclass(frozen=True)
class InferRequest:
    texts: list[str]
    binary_output: bool
    request_id: str | None
    parameters: dict[str, Any]


async def _infer(service: Service, request: Request) -> Response:
    model = _model(service, request)
    parsed = parse_infer(await read_body(service, request), request.headers.get(HEADER_LENGTH))
    job = EmbedJob(
        model=request.path_params["model"],
        texts=parsed.texts,
        token_ids=None,
        options=RowOptions(
            optional_field(parsed.parameters, "dimensions", int), optional_field(parsed.parameters, "normalize", bool)
        ),
        prompt_name=optional_field(parsed.parameters, "prompt_name", str),
    )
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    return _infer_response(model, parsed, np.ascontiguousarray(rows, dtype="<f4"))


def parse_infer(body: bytes | bytearray, header_length: str | None) -> InferRequest:
    """The request's texts, from JSON tensors or from binary data after a JSON header of `header_length` bytes."""
    if header_length is None:
        header, binary = parse_json_object(body), memoryview(b"")
    else:
        if not header_length.isdigit() or int(header_length) > len(body):
            message = f"{HEADER_LENGTH} is {header_length!r}, but the body has {len(body)} bytes"
            raise InvalidRequest(message, "invalid_value", HEADER_LENGTH)
        split = int(header_length)
        header, binary = parse_json_object(memoryview(body)[:split]), memoryview(body)[split:]
    inputs = header.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise Unprocessable("'inputs' must hold one tensor: the BYTES texts to embed", "invalid_type", "inputs")
    parameters = _object(header.get("parameters"), "parameters")
    texts = _texts(inputs[0], binary)
    request_id = optional_field(header, "id", str)
    return InferRequest(texts, _binary_output(header, parameters), request_id, parameters)


def _texts(tensor: dict[str, Any], binary: memoryview) -> list[str]:
    if not isinstance(tensor.get("name"), str):
        raise Unprocessable("'inputs[0].name' must be a string", "invalid_type", "inputs[0].name")
    if tensor.get("datatype") != "BYTES":
        message = f"the input's datatype must be BYTES (texts), got {tensor.get('datatype')!r}"
        raise InvalidRequest(message, "invalid_value", "inputs[0].datatype")
    shape = tensor.get("shape")
    if not isinstance(shape, list) or not shape or not all(type(n) is int and n >= 0 for n in shape):
        raise Unprocessable("'inputs[0].shape' must be a list of sizes", "invalid_type", "inputs[0].shape")
    size = _object(tensor.get("parameters"), "inputs[0].parameters").get("binary_data_size")
    values = _binary_texts(binary, size) if size is not None else _json_texts(tensor.get("data"))
    if len(values) != math.prod(shape):
        message = f"'inputs[0]' has shape {shape} ({math.prod(shape)} elements) but {len(values)} texts"
        raise InvalidRequest(message, "invalid_value", "inputs[0].shape")
    if not values:
        raise InvalidRequest("'inputs[0]' holds no text", "empty_input", "inputs[0].data")
    if not all(values):
        raise InvalidRequest("'inputs[0]' holds an empty text", "empty_input", "inputs[0].data")
    return values


def _json_texts(data: Any) -> list[str]:
    flat: list[Any] = []
    pending = [data]
    while pending:  # row-major: nested lists flattened in order
        item = pending.pop()
        if isinstance(item, list):
            pending.extend(reversed(item))
        else:
            flat.append(item)
    if not isinstance(data, list) or not all(isinstance(text, str) for text in flat):
        raise Unprocessable("'inputs[0].data' must be a list of strings", "invalid_type", "inputs[0].data")
    return flat


def _binary_texts(binary: memoryview, size: Any) -> list[str]:
    if type(size) is not int or not 0 <= size <= len(binary):
        message = f"binary_data_size {size!r} does not fit the {len(binary)} bytes after the JSON header"
        raise InvalidRequest(message, "invalid_value", "inputs[0].parameters.binary_data_size")
    texts, offset = [], 0
    while offset < size:
        if offset + 4 > size:
            raise InvalidRequest("a BYTES element's length is cut short", "invalid_value", "inputs[0]")
        (length,) = _UINT32.unpack_from(binary, offset)
        start, offset = offset + 4, offset + 4 + length
        if offset > size:
            raise InvalidRequest("a BYTES element runs past binary_data_size", "invalid_value", "inputs[0]")
        try:
            texts.append(bytes(binary[start:offset]).decode())
        except UnicodeDecodeError as error:
            raise InvalidRequest(f"a text is not UTF-8: {error}", "invalid_utf8", "inputs[0]") from error
    return texts


def _object(value: Any, param: str) -> dict[str, Any]:
    """An optional object field: {} when left out or null."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise Unprocessable(f"'{param}' must be an object", "invalid_type", param)
    return value


def _binary_output(header: dict[str, Any], parameters: dict[str, Any]) -> bool:
    """Whether the embedding goes back as binary data: as its requested output says, else as the request's
    `binary_data_output` says."""
    outputs = header.get("outputs")
    outputs = [] if outputs is None else outputs
    if not isinstance(outputs, list) or not all(isinstance(output, dict) for output in outputs):
        raise Unprocessable("'outputs' must be a list of objects", "invalid_type", "outputs")
    for output in outputs:
        if output.get("name") != OUTPUT_NAME:
            message = f"the model's one output is {OUTPUT_NAME!r}, not {output.get('name')!r}"
            raise InvalidRequest(message, "invalid_value", "outputs")
        binary = optional_field(_object(output.get("parameters"), "outputs[].parameters"), "binary_data", bool)
        if binary is not None:
            return binary
    return optional_field(parameters, "binary_data_output", bool) is True


def _infer_response(model: ServedModel, request: InferRequest, rows: np.ndarray) -> Response:
    output: dict[str, Any] = {"name": OUTPUT_NAME, "datatype": "FP32", "shape": list(rows.shape)}
    answer = {"model_name": model.id, "model_version": VERSION, "id": request.request_id or str(uuid.uuid4())}
    if not request.binary_output:
        return json_response({**answer, "outputs": [{**output, "data": rows.ravel()}]})
    data = rows.tobytes()
    header = orjson.dumps({**answer, "outputs": [{**output, "parameters": {"binary_data_size": len(data)}}]})
    headers = {HEADER_LENGTH: str(len(header))}
    return Response(header + data, 200, headers, media_type="application/octet-stream")
