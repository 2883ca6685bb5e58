"""KServe's Open Inference Protocol (v2) over gRPC, `inference.GRPCInferenceService` (proto/open_inference.proto),
served by the gateway process beside its HTTP routes on `--grpc-port`: the REST routes' twin (kserve.py) for
KServe's and Triton's gRPC clients. ServerLive, ServerReady, ModelReady, ServerMetadata, ModelMetadata and
ModelInfer: one BYTES input of N texts (as `raw_input_contents`, each element a little-endian uint32 length and its
bytes, or as `contents.bytes_contents`), one FP32 output "embedding" [N, width] as `raw_output_contents`, the same
embedding job as the REST route (Service.embed). Request parameters `dimensions` (int64), `normalize` (bool) and
`prompt_name` (string) are read; others are ignored, as the protocol's servers do.

Errors are the status codes of their kind (`status_code`): a model not served NOT_FOUND, a bad tensor or parameter
INVALID_ARGUMENT, overload RESOURCE_EXHAUSTED, no healthy replica or a drain that ended UNAVAILABLE (both worth a
retry), a missing API key UNAUTHENTICATED; each with the message the REST route gives. ServerReady and ModelReady
answer `ready: false` (status OK) where the REST routes answer a 4xx, as the protocol and Triton do: while the
gateway drains, while no replica (of the model) is healthy, and for a model or version not served.

Over TLS with the gateway's --tls-cert (mutual with --tls-client-ca), as its HTTPS port; with gRPC server reflection
(grpc.reflection.v1 and v1alpha: api/grpc_reflection.py), so grpcurl and grpcui list and call the service without the
.proto file; and with gRPC's health service (api/grpc_health.py) for Kubernetes' gRPC probes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import grpc
import numpy as np

from bouquet.batch import RowOptions
from bouquet.config import GatewayConfig
from bouquet.gateway.api.grpc_health import add_health
from bouquet.gateway.api.grpc_reflection import add_reflection
from bouquet.gateway.api.kserve import (
    INPUT_NAME,
    OUTPUT_NAME,
    VERSION,
    KServeInferInput,
    KServeTensorParameters,
    check_model_ready,
    check_server_ready,
    served_model,
    tensor_texts,
)
from bouquet.gateway.errors import (
    ApiError,
    ClientClosed,
    InternalError,
    InvalidRequest,
    NotFound,
    Overloaded,
    TooLarge,
    Unauthorized,
    Unavailable,
    shutting_down,
)
from bouquet.gateway.jobs import EmbedJob
from bouquet.gateway.replicas.catalog import ServedModel
from bouquet.gateway.service import Service
from bouquet.proto import open_inference_pb2 as pb
from bouquet.proto import open_inference_pb2_grpc as pb_grpc
from bouquet.tls import server_credentials

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
SERVICE_NAME = "inference.GRPCInferenceService"
SERVER_NAME, SERVER_VERSION = "bouquet", "0.1.0"
# The answer's bytes are bounded by the request's (max_inputs rows of a model's width): no cap of gRPC's own.
_UNLIMITED = -1

# The REST route's statuses, as gRPC's codes (the reverse of gRPC's own HTTP mapping where it has one).
_CODES: dict[type[ApiError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    TooLarge: grpc.StatusCode.INVALID_ARGUMENT,  # over a limit of this server: the same request fails again
    NotFound: grpc.StatusCode.NOT_FOUND,
    Unauthorized: grpc.StatusCode.UNAUTHENTICATED,
    Overloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Unavailable: grpc.StatusCode.UNAVAILABLE,
    ClientClosed: grpc.StatusCode.CANCELLED,
    InternalError: grpc.StatusCode.INTERNAL,
}


def status_code(error: ApiError) -> grpc.StatusCode:
    for kind in type(error).__mro__:
        if kind in _CODES:
            return _CODES[kind]
    return grpc.StatusCode.INVALID_ARGUMENT if error.status < 500 else grpc.StatusCode.INTERNAL


class OpenInferenceServicer(pb_grpc.GRPCInferenceServiceServicer):
    """Each call through `_answer`: the API key, the request lanes and metrics, errors as status codes."""

    def __init__(self, service: Service):
        self.service = service

    async def ServerLive(self, request: pb.ServerLiveRequest, context: grpc.aio.ServicerContext) -> Any:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request: pb.ServerReadyRequest, context: grpc.aio.ServicerContext) -> Any:
        async def ready() -> Any:
            return pb.ServerReadyResponse(ready=_ready(partial(check_server_ready, self.service)))

        return await self._answer("ServerReady", context, ready, public=True)

    async def ModelReady(self, request: pb.ModelReadyRequest, context: grpc.aio.ServicerContext) -> Any:
        async def ready() -> Any:
            check = partial(check_model_ready, self.service, request.name, request.version)
            return pb.ModelReadyResponse(ready=_ready(check))

        return await self._answer("ModelReady", context, ready, public=True)

    async def ServerMetadata(self, request: pb.ServerMetadataRequest, context: grpc.aio.ServicerContext) -> Any:
        async def metadata() -> Any:
            return pb.ServerMetadataResponse(name=SERVER_NAME, version=SERVER_VERSION)

        return await self._answer("ServerMetadata", context, metadata)

    async def ModelMetadata(self, request: pb.ModelMetadataRequest, context: grpc.aio.ServicerContext) -> Any:
        async def metadata() -> Any:
            model = self._model(request.name, request.version)
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=model.id, versions=[VERSION], platform="bouquet",
                inputs=[tensor(name=INPUT_NAME, datatype="BYTES", shape=[-1])],
                outputs=[tensor(name=OUTPUT_NAME, datatype="FP32", shape=[-1, model.dimension])],
            )  # fmt: skip

        return await self._answer("ModelMetadata", context, metadata)

    async def ModelInfer(self, request: pb.ModelInferRequest, context: grpc.aio.ServicerContext) -> Any:
        return await self._answer("ModelInfer", context, lambda: self._infer(request), work=True)

    def _model(self, name: str, version: str) -> ServedModel:
        return served_model(self.service, name, version)

    async def _infer(self, request: pb.ModelInferRequest) -> Any:
        model = self._model(request.model_name, request.model_version)
        texts = request_texts(request)
        for output in request.outputs:
            if output.name != OUTPUT_NAME:
                message = f"the model's one output is {OUTPUT_NAME!r}, not {output.name!r}"
                raise InvalidRequest(message, "invalid_value", "outputs")
        dimensions, normalize, prompt_name = _parameters(request.parameters)
        job = EmbedJob(
            model=request.model_name, texts=texts, token_ids=None, options=RowOptions(dimensions, normalize),
            prompt_name=prompt_name,
        )  # fmt: skip
        _, rows, _ = await drainable(self.service, self.service.embed(job))
        rows = np.ascontiguousarray(rows, dtype="<f4")
        output = pb.ModelInferResponse.InferOutputTensor(name=OUTPUT_NAME, datatype="FP32", shape=list(rows.shape))
        return pb.ModelInferResponse(
            model_name=model.id, model_version=VERSION, id=request.id, outputs=[output],
            raw_output_contents=[rows.tobytes()],
        )  # fmt: skip

    async def _answer(
        self, method: str, context: grpc.aio.ServicerContext, answer: Callable[[], Awaitable[_T]],
        public: bool = False, work: bool = False,
    ) -> _T:  # fmt: skip
        """The answer, or the call aborted with the status code of the error; counted in the gateway's request
        metrics under the route `/inference.GRPCInferenceService/METHOD` with the REST route's status."""
        service, route = self.service, f"/{SERVICE_NAME}/{method}"
        started, status = time.perf_counter(), 200
        service.metrics.in_flight.inc()
        try:
            if not public:
                _authorize(service, context)
            if work and service.draining:  # the HTTP server stops taking requests at once: this port alike
                raise shutting_down()
            if work:
                with service.admission.request():
                    return await answer()
            return await answer()
        except ApiError as error:
            status = error.status
            await context.abort(status_code(error), error.message)
            raise  # abort raises; this line is for the type checker
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception:
            logger.exception("%s failed", route)
            status = 500
            await context.abort(grpc.StatusCode.INTERNAL, "internal error; see the gateway's log")
            raise
        finally:
            service.metrics.in_flight.dec()
            service.metrics.requests.labels(route, str(status)).inc()
            service.metrics.request_seconds.labels(route).observe(time.perf_counter() - started)


def _ready(check: Callable[[], object]) -> bool:
    """True if `check` passes; False where the REST route answers a 4xx for it (the protocol's "false")."""
    try:
        check()
    except ApiError as error:
        if error.status >= 500:
            raise
        return False
    return True


def request_texts(request: pb.ModelInferRequest) -> list[str]:
    """The one input's texts, checked as the REST route checks its tensor (api/kserve.py's `tensor_texts`): from
    `raw_input_contents` (length-prefixed elements) or `contents.bytes_contents`."""
    if len(request.inputs) != 1:
        message = f"the model takes one input, a BYTES tensor of texts; got {len(request.inputs)}"
        raise InvalidRequest(message, "invalid_value", "inputs")
    tensor = request.inputs[0]
    if not tensor.shape or min(tensor.shape) < 0:
        message = f"'inputs[0]' has shape {list(tensor.shape)}: give each dimension, at least one"
        raise InvalidRequest(message, "invalid_value", "inputs[0].shape")
    shape = list(tensor.shape)
    if request.raw_input_contents:
        if len(request.raw_input_contents) != 1:
            message = f"raw_input_contents has {len(request.raw_input_contents)} entries for the one input"
            raise InvalidRequest(message, "invalid_value", "raw_input_contents")
        raw = request.raw_input_contents[0]
        parameters = KServeTensorParameters(binary_data_size=len(raw))
        return tensor_texts(
            KServeInferInput(tensor.name, shape, tensor.datatype, parameters=parameters), memoryview(raw)
        )
    if not tensor.HasField("contents") or not tensor.contents.bytes_contents:
        message = "the input's texts go in raw_input_contents or in inputs[0].contents.bytes_contents; neither is set"
        raise InvalidRequest(message, "missing_required_parameter", "inputs[0].contents")
    data: list[str | list[str]] = [_utf8(element) for element in tensor.contents.bytes_contents]
    return tensor_texts(KServeInferInput(tensor.name, shape, tensor.datatype, data=data), memoryview(b""))


def _utf8(element: bytes) -> str:
    try:
        return element.decode()
    except UnicodeDecodeError as error:
        raise InvalidRequest(f"a text is not UTF-8: {error}", "invalid_utf8", "inputs[0]") from error


def _parameters(parameters: Any) -> tuple[int | None, bool | None, str | None]:
    """The request's `dimensions`, `normalize` and `prompt_name`, each of its kind or refused."""
    kinds = {"dimensions": ("int64_param", "uint64_param"), "normalize": ("bool_param",),
             "prompt_name": ("string_param",)}  # fmt: skip
    values: dict[str, Any] = {}
    for name, accepted in kinds.items():
        if name not in parameters:
            continue
        kind = parameters[name].WhichOneof("parameter_choice")
        if kind not in accepted:
            message = f"the parameter {name!r} must be {' or '.join(accepted)}, got {kind or 'no value'}"
            raise InvalidRequest(message, "invalid_value", name)
        values[name] = getattr(parameters[name], kind)
    dimensions = values.get("dimensions")
    if dimensions is not None and dimensions < 1:
        raise InvalidRequest(f"dimensions must be positive, got {dimensions}", "invalid_value", "dimensions")
    return dimensions, values.get("normalize"), values.get("prompt_name")


def _authorize(service: Service, context: grpc.aio.ServicerContext) -> None:
    """The REST routes' `Authorization: Bearer KEY`, as the call's `authorization` metadata."""
    key = service.config.api_key
    if not key:
        return
    given = dict(context.invocation_metadata() or ()).get("authorization", "")
    scheme, _, token = str(given).strip().partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise Unauthorized(
            "a valid API key is required: send the metadata 'authorization: Bearer KEY'", "invalid_api_key"
        )


async def drainable(service: Service, work: Awaitable[_T]) -> _T:
    """`work`, cancelled with the rest of the work in hand when the gateway's drain ends: then UNAVAILABLE, which a
    client retries. A client that goes away cancels the call, and with it `work` and its chunks at the replicas."""
    task = asyncio.ensure_future(work)
    service.work.add(task)
    task.add_done_callback(service.work.discard)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        if task.cancelled() and service.drain_ended:
            raise shutting_down() from None
        task.cancel()
        raise


class OpenInferenceServer:
    """The gRPC server of the protocol, on `host:port` (SO_REUSEPORT, gRPC's default, so a gateway's workers share
    the port as they share the HTTP one), over TLS when the gateway has a certificate."""

    def __init__(self, service: Service, host: str, port: int):
        self.service = service
        options = [
            ("grpc.max_receive_message_length", service.config.max_payload_bytes),  # the REST body's limit
            ("grpc.max_send_message_length", _UNLIMITED),
        ]
        self.server = grpc.aio.server(options=options)
        pb_grpc.add_GRPCInferenceServiceServicer_to_server(OpenInferenceServicer(service), self.server)
        health = add_health(self.server, service, SERVICE_NAME)
        add_reflection(self.server, (SERVICE_NAME, health))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.tls = service.config.tls_cert is not None
        self.port = _add_port(self.server, address, service.config)
        if self.port == 0:
            raise ValueError(f"cannot listen for gRPC on {address}")
        self.host = host

    async def start(self) -> None:
        await self.server.start()
        over = " over TLS" if self.tls else ""
        print(
            f"bouquet gateway: Open Inference Protocol (gRPC{over}) on {self.host}:{self.port}",
            file=sys.stderr, flush=True,
        )  # fmt: skip

    async def stop(self, grace: float) -> None:
        """New calls refused; the calls in hand go on within `grace` (the drain's end answers them UNAVAILABLE)."""
        await self.server.stop(grace)


def _add_port(server: grpc.aio.Server, address: str, config: GatewayConfig) -> int:
    """The port bound: with the HTTPS port's certificate and client CA when the gateway has them."""
    if config.tls_cert is None or config.tls_key is None:
        return int(server.add_insecure_port(address))
    credentials = server_credentials(config.tls_cert, config.tls_key, config.tls_client_ca)
    return int(server.add_secure_port(address, credentials))
