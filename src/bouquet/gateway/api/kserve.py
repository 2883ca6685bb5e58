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
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import numpy as np
from msgspec import UNSET, Meta, UnsetType
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from bouquet.batch import RowOptions
from bouquet.gateway.api.fields import Count, Dimensions, Text, described
from bouquet.gateway.errors import InvalidRequest, NotFound, NotReady, Unavailable
from bouquet.gateway.http.body import read_body
from bouquet.gateway.http.decode import BodyDecoder, ResponseBody
from bouquet.gateway.http.endpoint import Handler, endpoint, json_response, unless_disconnected
from bouquet.gateway.http.error_responses import kserve_error_response
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service, embedding_model

INPUT_NAME, OUTPUT_NAME = "text", "embedding"
VERSION = "1"  # a served model has one version
HEADER_LENGTH = "inference-header-content-length"
_UINT32 = struct.Struct("<I")

# The protocol's objects are open: a field this server does not read is ignored, as the protocol's servers do, so
# these structs do not forbid unknown fields (the other routes' RequestBody does).


class KServeTensorParameters(msgspec.Struct):
    binary_data_size: (
        Annotated[Count, described("the tensor's bytes after the JSON header (binary extension)")] | None
    ) = None


class KServeInferInput(msgspec.Struct):
    name: Annotated[str, described("any: the model has one input")]
    shape: Annotated[list[Count], Meta(min_length=1, description="the texts' count (their product)")]
    datatype: Annotated[str, Meta(extra_json_schema={"enum": ["BYTES"]})]
    data: Annotated[list[Text | list[Text]], described("texts, row-major (nested or flat)")] | None = None
    parameters: KServeTensorParameters | None = None


class KServeOutputParameters(msgspec.Struct):
    binary_data: Annotated[bool, described("the embedding as raw float32 after a JSON header")] | None = None


class KServeInferOutput(msgspec.Struct):
    name: Annotated[str, Meta(extra_json_schema={"enum": [OUTPUT_NAME]})]
    parameters: KServeOutputParameters | None = None


class KServeInferParameters(msgspec.Struct):
    dimensions: Dimensions = None
    normalize: Annotated[bool, described("default: as the model's Normalize module says")] | None = None
    prompt_name: Annotated[str, described("one of the model's sentence-transformers prompts")] | None = None
    binary_data_output: Annotated[bool, described("the embedding as raw float32 after a JSON header")] | None = None


class KServeInferRequest(msgspec.Struct):
    """The infer request of an embedding model: one BYTES tensor of texts."""

    inputs: Annotated[list[KServeInferInput], Meta(min_length=1, max_length=1)]
    id: str | None = None
    parameters: KServeInferParameters | None = None
    outputs: list[KServeInferOutput] | None = None

    __openapi__: ClassVar[dict[str, Any]] = {
        "description": "Or, with the binary tensor data extension, this object as a JSON header of "
        "Inference-Header-Content-Length bytes followed by each BYTES element as a little-endian uint32 length and "
        "its UTF-8 bytes (the input's parameters.binary_data_size in all).",
        "example": {"inputs": [{"name": "text", "shape": [2], "datatype": "BYTES", "data": ["a query", "a document"]}]},
    }


INFER = BodyDecoder(KServeInferRequest, KServeInferRequest)  # open either way


class KServeLive(ResponseBody):
    live: Literal[True] = True


class KServeReady(ResponseBody):
    ready: Literal[True] = True


class KServeServerMetadata(ResponseBody):
    name: str
    version: str
    extensions: list[str]


class KServeTensorMetadata(ResponseBody):
    name: str
    datatype: str
    shape: Annotated[list[int], Meta(min_length=1, description="-1: any size")]


class KServeModelMetadata(ResponseBody):
    name: str
    versions: list[str]
    platform: str
    inputs: list[KServeTensorMetadata]
    outputs: list[KServeTensorMetadata]


class KServeModelReady(ResponseBody):
    name: str
    ready: Literal[True] = True


class KServeBinaryData(ResponseBody):
    binary_data_size: Count


class KServeOutput(ResponseBody):
    name: Literal["embedding"]
    datatype: Literal["FP32"]
    shape: Annotated[list[Count], Meta(min_length=2, max_length=2, description="[texts, width]")]
    data: Annotated[
        Any, Meta(extra_json_schema={"type": "array", "items": {"type": "number"}, "description": "row-major"})
    ] | UnsetType = UNSET  # fmt: skip
    parameters: KServeBinaryData | UnsetType = UNSET  # the output is binary: its bytes follow the JSON header


class KServeInferResponse(ResponseBody):
    model_name: str
    model_version: str
    id: str
    outputs: Annotated[list[KServeOutput], Meta(min_length=1, max_length=1)]


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
    return json_response(KServeLive())


async def _ready(service: Service, request: Request) -> Response:
    check_server_ready(service)
    return json_response(KServeReady())


async def _server_metadata(service: Service, request: Request) -> Response:
    return json_response(KServeServerMetadata("bouquet", "0.1.0", ["binary_tensor_data"]))


def served_model(service: Service, name: str, version: str | None) -> ServedModel:
    """The embedding model `name` at `version` (none or "": its one version)."""
    if version and version != VERSION:
        raise NotFound(f"the model has one version, {VERSION!r}, not {version!r}", "not_found", "version")
    return embedding_model(service, name)


def _model(service: Service, request: Request) -> ServedModel:
    return served_model(service, request.path_params["model"], request.path_params.get("version"))


async def _model_ready(service: Service, request: Request) -> Response:
    model = check_model_ready(service, request.path_params["model"], request.path_params.get("version"))
    return json_response(KServeModelReady(model.id))


# Readiness, as a Kubernetes readinessProbe reads it: false while the gateway drains (it takes no new work) and while
# no replica is healthy, before any has reported as after the last has gone. A gateway fronting several models is
# ready while any of them is (the protocol's server readiness is all of them): its sibling gateways see the same
# replicas, so leaving a Service would stop the models that do serve and help none that do not.
def check_server_ready(service: Service) -> None:
    """Returns if the server is ready for inference; else NotReady, saying why."""
    if service.draining:
        raise NotReady("the gateway is shutting down", "shutting_down")
    if not service.pool.any_healthy():
        raise NotReady("no replica is healthy", "no_healthy_replica")


def check_model_ready(service: Service, name: str, version: str | None) -> ServedModel:
    """The model, if it is ready for inference; else NotReady saying why (NotFound for a name or version never
    served, a 4xx too)."""
    if service.draining:
        raise NotReady("the gateway is shutting down", "shutting_down")
    try:
        model = served_model(service, name, version)
    except Unavailable as error:  # no replica has reported the model yet: not an error, not ready
        raise NotReady(error.message, error.code, error.param) from None
    if not service.pool.any_healthy(model.name):
        raise NotReady(f"no healthy replica serves the model {model.id!r}", "no_healthy_replica", "model")
    return model


async def _model_metadata(service: Service, request: Request) -> Response:
    model = _model(service, request)
    return json_response(KServeModelMetadata(
        model.id, [VERSION], "bouquet", [KServeTensorMetadata(INPUT_NAME, "BYTES", [-1])],
        [KServeTensorMetadata(OUTPUT_NAME, "FP32", [-1, model.dimension])],
    ))  # fmt: skip


async def _infer(service: Service, request: Request) -> Response:
    model = _model(service, request)
    parsed, binary = parse_infer(await read_body(service, request), request.headers.get(HEADER_LENGTH))
    texts, binary_output = tensor_texts(parsed.inputs[0], binary), _binary_output(parsed)
    parameters = parsed.parameters or KServeInferParameters()
    job = EmbedJob(
        model=request.path_params["model"],
        texts=texts,
        token_ids=None,
        options=RowOptions(parameters.dimensions, parameters.normalize),
        prompt_name=parameters.prompt_name,
    )
    _, rows, _ = await unless_disconnected(request, service.embed(job))
    return _infer_response(model, parsed, np.ascontiguousarray(rows, dtype="<f4"), binary_output)


def parse_infer(body: bytes | bytearray, header_length: str | None) -> tuple[KServeInferRequest, memoryview]:
    """The request, decoded from the whole body (tensors as JSON) or from a JSON header of `header_length` bytes,
    and the binary data after that header."""
    if header_length is None:
        return INFER.decode(body), memoryview(b"")
    if not header_length.isdigit() or int(header_length) > len(body):
        message = f"{HEADER_LENGTH} is {header_length!r}, but the body has {len(body)} bytes"
        raise InvalidRequest(message, "invalid_value", HEADER_LENGTH)
    split = int(header_length)
    return INFER.decode(memoryview(body)[:split]), memoryview(body)[split:]


def tensor_texts(tensor: KServeInferInput, binary: memoryview) -> list[str]:
    """The tensor's texts, from its JSON data or its binary data: what the types leave to check (the datatype's
    value, the shape against the texts, the binary elements' framing)."""
    if tensor.datatype != "BYTES":
        message = f"the input's datatype must be BYTES (texts), got {tensor.datatype!r}"
        raise InvalidRequest(message, "invalid_value", "inputs[0].datatype")
    size = None if tensor.parameters is None else tensor.parameters.binary_data_size
    if size is not None:
        values = _binary_texts(binary, size)
    elif tensor.data is not None:
        values = [text for item in tensor.data for text in ([item] if isinstance(item, str) else item)]
    else:
        message = "'inputs[0].data' is required unless the texts come as binary data (parameters.binary_data_size)"
        raise InvalidRequest(message, "missing_required_parameter", "inputs[0].data")
    if len(values) != math.prod(tensor.shape):
        message = f"'inputs[0]' has shape {tensor.shape} ({math.prod(tensor.shape)} elements) but {len(values)} texts"
        raise InvalidRequest(message, "invalid_value", "inputs[0].shape")
    if not values:
        raise InvalidRequest("'inputs[0]' holds no text", "empty_input", "inputs[0].data")
    if not all(values):  # a binary element of no bytes (JSON texts are at least a character by their type)
        raise InvalidRequest("'inputs[0]' holds an empty text", "empty_input", "inputs[0].data")
    return values


def _binary_texts(binary: memoryview, size: int) -> list[str]:
    if size > len(binary):
        message = f"binary_data_size {size} does not fit the {len(binary)} bytes after the JSON header"
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


def _binary_output(request: KServeInferRequest) -> bool:
    """Whether the embedding goes back as binary data: as its requested output says, else as the request's
    `binary_data_output` says."""
    for output in request.outputs or ():
        if output.name != OUTPUT_NAME:
            message = f"the model's one output is {OUTPUT_NAME!r}, not {output.name!r}"
            raise InvalidRequest(message, "invalid_value", "outputs")
        if output.parameters is not None and output.parameters.binary_data is not None:
            return output.parameters.binary_data
    return request.parameters is not None and request.parameters.binary_data_output is True


def _infer_response(model: ServedModel, request: KServeInferRequest, rows: np.ndarray, binary: bool) -> Response:
    data = rows.tobytes() if binary else b""
    output = KServeOutput(
        "embedding", "FP32", list(rows.shape), UNSET if binary else rows.ravel(),
        KServeBinaryData(len(data)) if binary else UNSET,
    )  # fmt: skip
    answer = KServeInferResponse(model.id, VERSION, request.id or str(uuid.uuid4()), [output])
    if not binary:
        return json_response(answer)
    header = msgspec.json.encode(answer)
    return Response(header + data, 200, {HEADER_LENGTH: str(len(header))}, media_type="application/octet-stream")
