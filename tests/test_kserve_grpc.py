"""KServe's Open Inference Protocol over gRPC (gateway/api/kserve_grpc.py) on a real gRPC port beside the gateway's HTTP
routes, real replicas in this process (tests/in_process.py; the bundled MiniLM), called through the stub generated
from proto/open_inference.proto: health and metadata; infer with the texts as `raw_input_contents` and as
`contents.bytes_contents`, equal to the REST infer route's rows and to sentence-transformers'; request parameters;
each bad request its status code and message; readiness on both twins while no replica is healthy and while the
gateway drains; the service listed, described and called through gRPC server reflection alone, as grpcurl does (README's
example). Triton's own gRPC client against processes: test_kserve_grpc_client.py; TLS: test_kserve_grpc_tls.py."""

from __future__ import annotations

import asyncio
import base64
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
from conftest import row_cosines
from google.protobuf import descriptor_pool, json_format, message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.descriptor_pb2 import FileDescriptorProto
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from in_process import Served, served

from bouquet.config import GatewayConfig
from bouquet.engine.engine import Engine
from bouquet.gateway.api.kserve_grpc import drainable, status_code
from bouquet.gateway.app import create_app
from bouquet.gateway.errors import ClientClosed, InvalidRequest, NotFound, Overloaded, TooLarge, Unavailable
from bouquet.gateway.service import Service
from bouquet.gateway.testing import free_port
from bouquet.proto import open_inference_pb2 as pb
from bouquet.proto import open_inference_pb2_grpc as pb_grpc

MODEL = "all-MiniLM-L6-v2"
KEY = "oip-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
TEXTS = ["Packed sequences run without padding.", "Lisbon is mild in December.", "one", "naïve café ☕"]


@pytest.fixture(scope="module")
def running(minilm_path: Path, minilm_fp32: Engine) -> Iterator[Served]:
    # one request at a time (a process's cap, HTTP's and gRPC's together): overload is made without a race
    options = {"api_key": KEY, "grpc_port": 0, "max_inputs": 8, "max_concurrent_requests": 1}
    with served([minilm_fp32], model_dirs=(minilm_path,), listen=True, **options) as running:
        yield running


@pytest.fixture(scope="module")
def stub(running: Served) -> Iterator[pb_grpc.GRPCInferenceServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
        yield pb_grpc.GRPCInferenceServiceStub(channel)


@pytest.fixture(scope="module")
def rest_rows(running: Served) -> np.ndarray:
    body = {"inputs": [{"name": "text", "shape": [len(TEXTS)], "datatype": "BYTES", "data": TEXTS}]}
    answer = running.client.post(f"/v2/models/{MODEL}/infer", json=body)
    assert answer.status_code == 200, answer.text
    output = answer.json()["outputs"][0]
    return np.array(output["data"], np.float32).reshape(output["shape"])


def raw_bytes(texts: list[str]) -> bytes:
    """The protocol's BYTES serialization: each element a little-endian uint32 length and its bytes."""
    return b"".join(struct.pack("<I", len(text.encode())) + text.encode() for text in texts)


def infer_request(texts: list[str], raw: bool = True, **parameters: pb.InferParameter) -> pb.ModelInferRequest:
    tensor = pb.ModelInferRequest.InferInputTensor(name="text", datatype="BYTES", shape=[len(texts)])
    request = pb.ModelInferRequest(model_name=MODEL, id="request-7", inputs=[tensor], parameters=parameters)
    if raw:
        request.raw_input_contents.append(raw_bytes(texts))
    else:
        tensor = request.inputs[0]
        tensor.contents.bytes_contents.extend(text.encode() for text in texts)
    return request


def rows_of(response: pb.ModelInferResponse) -> np.ndarray:
    (output,) = response.outputs
    assert (output.name, output.datatype) == ("embedding", "FP32")
    return np.frombuffer(response.raw_output_contents[0], "<f4").reshape(tuple(output.shape))


def refusal(call, request, metadata=AUTH) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(request, metadata=metadata, timeout=60)
    return caught.value


def test_health_and_metadata(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    assert stub.ServerLive(pb.ServerLiveRequest()).live  # the health calls need no key, as on REST
    assert stub.ServerReady(pb.ServerReadyRequest()).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL)).ready
    assert stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version="1")).ready
    server = stub.ServerMetadata(pb.ServerMetadataRequest(), metadata=AUTH)
    assert server.name == "bouquet"
    metadata = stub.ModelMetadata(pb.ModelMetadataRequest(name=MODEL), metadata=AUTH)
    assert (metadata.name, list(metadata.versions), metadata.platform) == (MODEL, ["1"], "bouquet")
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.inputs] == [("text", "BYTES", [-1])]
    assert [(t.name, t.datatype, list(t.shape)) for t in metadata.outputs] == [("embedding", "FP32", [-1, 384])]


@pytest.mark.parametrize("raw", [True, False], ids=["raw_input_contents", "bytes_contents"])
def test_infer_equals_the_rest_route(
    stub: pb_grpc.GRPCInferenceServiceStub, rest_rows: np.ndarray, sentence_transformer, raw: bool
) -> None:
    response = stub.ModelInfer(infer_request(TEXTS, raw), metadata=AUTH, timeout=60)
    assert (response.model_name, response.model_version, response.id) == (MODEL, "1", "request-7")
    rows = rows_of(response)
    assert rows.shape == (len(TEXTS), 384)
    np.testing.assert_array_equal(rows, rest_rows)  # the same job on the same replica: the same floats
    expected = sentence_transformer.encode(TEXTS, convert_to_numpy=True, normalize_embeddings=True)
    assert row_cosines(rows, expected).min() > 0.99999


def test_parameters(stub: pb_grpc.GRPCInferenceServiceStub, rest_rows: np.ndarray) -> None:
    parameters = {"dimensions": pb.InferParameter(int64_param=64), "normalize": pb.InferParameter(bool_param=True),
                  "priority": pb.InferParameter(uint64_param=1)}  # fmt: skip  # Triton's priority: ignored
    rows = rows_of(stub.ModelInfer(infer_request(TEXTS, **parameters), metadata=AUTH, timeout=60))
    assert rows.shape == (len(TEXTS), 64)
    cut = rest_rows[:, :64] / np.linalg.norm(rest_rows[:, :64], axis=1, keepdims=True)
    np.testing.assert_allclose(rows, cut, atol=1e-6)
    # a shape of more than one dimension holds its texts row-major, as on REST
    request = infer_request(TEXTS)
    request.inputs[0].shape[:] = [2, 2]
    np.testing.assert_array_equal(rows_of(stub.ModelInfer(request, metadata=AUTH, timeout=60)), rest_rows)


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_grpcurl_body() -> str:
    """The JSON of README's `grpcurl ... -d '...' ... ModelInfer` example."""
    text = README.read_text()
    start = text.index("-d '", text.index("grpcurl -plaintext -d")) + len("-d '")
    return text[start : text.index("'", start)]


def reflected(channel: grpc.Channel) -> tuple[list[str], ServiceDescriptor]:
    """What grpcurl reads from the server's reflection: the services listed, and the protocol's, described."""
    database = ProtoReflectionDescriptorDatabase(channel)
    services = list(database.get_services())
    return services, descriptor_pool.DescriptorPool(database).FindServiceByName("inference.GRPCInferenceService")


def test_reflection_lists_and_describes_the_service(running: Served) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
        services, service = reflected(channel)
    assert sorted(services) == [
        "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection",
        "inference.GRPCInferenceService",
    ]  # fmt: skip
    methods = {method.name: (method.input_type.full_name, method.output_type.full_name) for method in service.methods}
    assert methods == {
        name: (f"inference.{name}Request", f"inference.{name}Response")
        for name in ("ServerLive", "ServerReady", "ModelReady", "ServerMetadata", "ModelMetadata", "ModelInfer")
    }
    reflected_fields = {f.name: f.number for f in service.methods_by_name["ModelInfer"].input_type.fields}
    assert reflected_fields == {f.name: f.number for f in pb.ModelInferRequest.DESCRIPTOR.fields}


def _v1(name: str) -> type:
    return message_factory.GetMessageClass(
        descriptor_pool.Default().FindMessageTypeByName(f"grpc.reflection.v1.{name}")
    )


def test_reflection_v1_as_a_client_that_speaks_only_v1(running: Served) -> None:
    # v1's messages as grpc's reflection/v1/reflection.proto numbers them: a request's file_containing_symbol 4 and
    # list_services 7, a response's file_descriptor_response 4, list_services_response 6, error_response 7
    request_class, response_class = _v1("ServerReflectionRequest"), _v1("ServerReflectionResponse")
    numbers = {f.name: f.number for c in (request_class, response_class) for f in c.DESCRIPTOR.fields}
    assert {k: numbers[k] for k in ("file_containing_symbol", "list_services", "file_descriptor_response",
            "list_services_response", "error_response")} == {"file_containing_symbol": 4, "list_services": 7,
            "file_descriptor_response": 4, "list_services_response": 6, "error_response": 7}  # fmt: skip
    asked = [
        request_class(list_services=""),
        request_class(file_containing_symbol="inference.GRPCInferenceService"),
        request_class(file_containing_symbol="grpc.reflection.v1.ServerReflection"),
        request_class(file_containing_symbol="no.such.Service"),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
        info = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=request_class.SerializeToString, response_deserializer=response_class.FromString,
        )  # fmt: skip
        listed, inference, itself, missing = list(info(iter(asked), timeout=30))
    assert "grpc.reflection.v1.ServerReflection" in {service.name for service in listed.list_services_response.service}
    files = [FileDescriptorProto.FromString(raw) for raw in inference.file_descriptor_response.file_descriptor_proto]
    (service,) = [service for file in files for service in file.service if service.name == "GRPCInferenceService"]
    assert "ModelInfer" in {method.name for method in service.method}
    (own,) = [FileDescriptorProto.FromString(raw) for raw in itself.file_descriptor_response.file_descriptor_proto]
    assert own.package == "grpc.reflection.v1" and own.service[0].method[0].input_type == (
        ".grpc.reflection.v1.ServerReflectionRequest"
    )
    assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_readmes_grpcurl_call_through_reflection_alone(running: Served, sentence_transformer) -> None:
    # as grpcurl runs it: the messages built from the reflected descriptors (no generated code, no .proto), the body
    # parsed from README's JSON by protobuf's JSON mapping (bytes as base64), the answer printed back as JSON
    with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
        method = reflected(channel)[1].methods_by_name["ModelInfer"]
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        request = json_format.Parse(readme_grpcurl_body(), request_class())
        request.model_name = MODEL  # README's serve names it minilm
        call = channel.unary_unary(
            f"/{method.containing_service.full_name}/{method.name}",
            request_serializer=request_class.SerializeToString, response_deserializer=response_class.FromString,
        )  # fmt: skip
        printed = json_format.MessageToDict(call(request, metadata=AUTH, timeout=60))
    (output,) = printed["outputs"]
    assert (output["name"], output["datatype"], output["shape"]) == ("embedding", "FP32", ["2", "384"])
    rows = np.frombuffer(base64.b64decode(printed["rawOutputContents"][0]), "<f4").reshape(2, 384)
    expected = sentence_transformer.encode(["a query", "a document"], normalize_embeddings=True)
    assert row_cosines(rows, expected).min() > 0.99999


def _bad(**changes) -> pb.ModelInferRequest:
    request = infer_request(TEXTS[:2])
    for name, value in changes.items():
        if name == "raw":
            request.raw_input_contents[:] = value
        elif name == "datatype":
            request.inputs[0].datatype = value
        elif name == "shape":
            request.inputs[0].shape[:] = value
        elif name == "output":
            request.outputs.add(name=value)
        else:
            request.parameters[name].CopyFrom(value)
    return request


@pytest.mark.parametrize(
    ("request_", "code", "message"),
    [
        (_bad(datatype="FP32"), "INVALID_ARGUMENT", "datatype must be BYTES"),
        (_bad(shape=[3]), "INVALID_ARGUMENT", "has shape [3] (3 elements) but 2 texts"),
        (_bad(shape=[]), "INVALID_ARGUMENT", "give each dimension"),
        (_bad(raw=[b"\x05\x00\x00"]), "INVALID_ARGUMENT", "length is cut short"),
        (_bad(raw=[b"\x09\x00\x00\x00abc"]), "INVALID_ARGUMENT", "runs past"),
        (_bad(raw=[raw_bytes(["a"]) + b"\x02\x00\x00\x00\xff\xfe"]), "INVALID_ARGUMENT", "not UTF-8"),
        (_bad(raw=[raw_bytes(["a", ""])]), "INVALID_ARGUMENT", "holds an empty text"),
        (_bad(raw=[]), "INVALID_ARGUMENT", "neither is set"),
        (_bad(raw=[raw_bytes(TEXTS[:2]), b""]), "INVALID_ARGUMENT", "2 entries for the one input"),
        (_bad(output="scores"), "INVALID_ARGUMENT", "one output is 'embedding', not 'scores'"),
        (
            _bad(dimensions=pb.InferParameter(string_param="64")),
            "INVALID_ARGUMENT",
            "int64_param or uint64_param, got string_param",
        ),
        (_bad(dimensions=pb.InferParameter(int64_param=999)), "INVALID_ARGUMENT", "dimensions must be between 1"),
        (_bad(prompt_name=pb.InferParameter(string_param="nope")), "INVALID_ARGUMENT", "nope"),
        (infer_request(["a"] * 9), "INVALID_ARGUMENT", "9 inputs, over the limit of 8"),
    ],
)
def test_bad_requests_get_their_status(
    stub: pb_grpc.GRPCInferenceServiceStub, request_: pb.ModelInferRequest, code: str, message: str
) -> None:
    error = refusal(stub.ModelInfer, request_)
    assert error.code() == grpc.StatusCode[code] and message in error.details(), error.details()


def test_unknown_model_version_and_key(stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    request = infer_request(TEXTS[:1])
    request.model_name = "no-such-model"
    error = refusal(stub.ModelInfer, request)
    assert error.code() == grpc.StatusCode.NOT_FOUND and "no-such-model" in error.details()
    error = refusal(stub.ModelMetadata, pb.ModelMetadataRequest(name=MODEL, version="2"))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "one version, '1', not '2'" in error.details()
    # readiness is an answer, not an error (the protocol's, and Triton's): a model or version not served is not ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name="no-such-model")).ready
    assert not stub.ModelReady(pb.ModelReadyRequest(name=MODEL, version="2")).ready
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        error = refusal(stub.ModelInfer, infer_request(TEXTS[:1]), metadata)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in error.details()


def test_a_message_over_the_payload_limit_is_refused(running: Served) -> None:
    # gRPC's own receive limit is the REST body's (--max-payload-bytes): refused before it is parsed
    with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
        stub = pb_grpc.GRPCInferenceServiceStub(channel)
        error = refusal(stub.ModelInfer, infer_request(["x" * (3 * 1024 * 1024)]))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_overload_is_resource_exhausted(running: Served, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    # an HTTP request whose body has not come holds the process's one request slot; the gRPC call meanwhile is
    # refused as the REST route refuses it (429), and served once the slot is free
    host, port = running.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as held:
        held.sendall(f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())  # fmt: skip
        error = refusal(stub.ModelInfer, infer_request(TEXTS[:1]))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error.details()
        assert "its limit" in error.details()
    for _ in range(200):  # the server notices the closed connection when it next reads from it
        try:
            stub.ModelInfer(infer_request(TEXTS[:1]), metadata=AUTH, timeout=60)
            break
        except grpc.RpcError as refused:
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(0.05)
    else:
        raise AssertionError("the slot was never given back")


def readiness(client: httpx.Client, stub: pb_grpc.GRPCInferenceServiceStub) -> dict[str, object]:
    """The server's and the model's readiness on both twins: REST's status and error, gRPC's `ready`."""
    answers: dict[str, object] = {}
    for name, path in (("server", "/v2/health/ready"), ("model", f"/v2/models/{MODEL}/ready")):
        reply = client.get(path)
        answers[f"rest {name}"] = (reply.status_code, reply.json().get("error"))
    answers["grpc server"] = stub.ServerReady(pb.ServerReadyRequest(), timeout=30).ready
    answers["grpc model"] = stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=30).ready
    return answers


def test_a_drain_is_not_ready_and_refuses_new_calls_unavailable(minilm_path: Path, minilm_fp32: Engine) -> None:
    with served([minilm_fp32], model_dirs=(minilm_path,), grpc_port=0) as running:
        assert running.app is not None and running.loop is not None
        service = running.app.state.service
        with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
            stub = pb_grpc.GRPCInferenceServiceStub(channel)
            before = readiness(running.client, stub)
            running.loop.call_soon_threadsafe(service.begin_drain, 30.0)  # as SIGTERM starts it
            for _ in range(100):  # until the loop has run the drain's start
                if service.draining:
                    break
                time.sleep(0.01)
            during = readiness(running.client, stub)
            error = refusal(stub.ModelInfer, infer_request(TEXTS[:1]), ())
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30).status
    assert health == health_pb2.HealthCheckResponse.NOT_SERVING  # Kubernetes' gRPC probe takes the pod out
    assert before == {"rest server": (200, None), "rest model": (200, None), "grpc server": True, "grpc model": True}
    shutting_down = (400, "the gateway is shutting down")  # the protocol's "false" on REST: a 4xx (Triton's 400)
    assert during == {"rest server": shutting_down, "rest model": shutting_down, "grpc server": False,
                      "grpc model": False}  # fmt: skip
    assert error.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in error.details()


def test_grpc_health_says_serving_for_the_server_and_its_service(running: Served) -> None:
    """grpc.health.v1 as Kubernetes' gRPC probes and grpc-health-probe call it: SERVING for "" and the inference
    service while ready, NOT_FOUND for another name, and Watch's first message the same status."""
    request = health_pb2.HealthCheckRequest
    with grpc.insecure_channel(f"127.0.0.1:{running.app.state.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        statuses = [
            health.Check(request(service=name), timeout=30).status for name in ("", "inference.GRPCInferenceService")
        ]
        with pytest.raises(grpc.RpcError) as unknown:
            health.Check(request(service="no.such.Service"), timeout=30)
        listed = health.List(health_pb2.HealthListRequest(), timeout=30).statuses
        watch = health.Watch(request(), timeout=30)
        first = next(watch).status
        watch.cancel()
    assert statuses == [health_pb2.HealthCheckResponse.SERVING] * 2 and first == health_pb2.HealthCheckResponse.SERVING
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
    serving = health_pb2.HealthCheckResponse.SERVING
    everything = dict.fromkeys(("", "inference.GRPCInferenceService"), serving)
    assert {name: listed[name].status for name in listed} == everything


def test_not_ready_while_no_replica_is_healthy(running: Served) -> None:
    # a gateway whose one replica never answers, as before any replica reports: not ready on either twin, yet live
    async def answers() -> tuple[dict[str, object], bool, grpc.StatusCode]:
        config = GatewayConfig(replicas=(f"127.0.0.1:{free_port()}",), grpc_port=0, drain_seconds=1.0)
        app = create_app(config)
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
                rest = {path: await client.get(path) for path in ("/v2/health/ready", f"/v2/models/{MODEL}/ready")}
            async with grpc.aio.insecure_channel(f"127.0.0.1:{app.state.grpc_port}") as channel:
                stub = pb_grpc.GRPCInferenceServiceStub(channel)
                live = (await stub.ServerLive(pb.ServerLiveRequest(), timeout=30)).live
                ready = (await stub.ServerReady(pb.ServerReadyRequest(), timeout=30)).ready
                model = (await stub.ModelReady(pb.ModelReadyRequest(name=MODEL), timeout=30)).ready
                health = health_pb2_grpc.HealthStub(channel)
                serving = (await health.Check(health_pb2.HealthCheckRequest(), timeout=30)).status
                try:
                    await stub.ModelInfer(infer_request(TEXTS[:1]), timeout=30)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as error:
                    code = error.code()
        status = {path: (reply.status_code, reply.json()["error"]) for path, reply in rest.items()}
        return {**status, "grpc server": ready, "grpc model": model, "grpc health": serving}, live, code

    found, live, infer = asyncio.run_coroutine_threadsafe(answers(), running.loop).result(120)
    assert found == {
        "/v2/health/ready": (400, "no replica is healthy"),
        f"/v2/models/{MODEL}/ready": (400, "no replica has reported its model yet"),
        "grpc server": False, "grpc model": False, "grpc health": health_pb2.HealthCheckResponse.NOT_SERVING,
    }  # fmt: skip
    assert live and infer == grpc.StatusCode.UNAVAILABLE


def test_calls_are_counted_beside_the_http_routes(running: Served, stub: pb_grpc.GRPCInferenceServiceStub) -> None:
    stub.ModelInfer(infer_request(TEXTS[:1]), metadata=AUTH, timeout=60)
    refusal(stub.ModelMetadata, pb.ModelMetadataRequest(name="no-such-model"))
    metrics = running.client.get("/metrics").text
    assert 'bouquet_gateway_requests_total{route="/inference.GRPCInferenceService/ModelInfer",status="200"}' in metrics
    assert 'route="/inference.GRPCInferenceService/ModelMetadata",status="404"' in metrics


def test_work_in_hand_at_the_drains_end_is_unavailable_and_a_gone_client_cancels_it() -> None:
    # the service's own drain (begin_drain, as SIGTERM calls it) ends the work of a call, which is then told to
    # retry; a call its client cancels cancels its work
    async def run() -> None:
        service = Service(GatewayConfig(replicas=("127.0.0.1:9",)))
        work = asyncio.ensure_future(asyncio.sleep(60))
        call = asyncio.ensure_future(drainable(service, work))
        await asyncio.sleep(0)
        assert service.work == {work}
        service.begin_drain(0.0)
        with pytest.raises(Unavailable, match="shutting down"):
            await call
        assert work.cancelled() and not service.work
        await service.close()

        service = Service(GatewayConfig(replicas=("127.0.0.1:9",)))
        work = asyncio.ensure_future(asyncio.sleep(60))
        call = asyncio.ensure_future(drainable(service, work))
        await asyncio.sleep(0)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.sleep(0)
        assert work.cancelled() and not service.work
        await service.close()

    asyncio.run(run())


def test_status_codes_follow_the_rest_statuses() -> None:
    # overload is worth a retry later, no healthy replica (or a drain's end) at once elsewhere
    assert status_code(Overloaded("busy", "overloaded")) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert status_code(Unavailable("down", "no_healthy_replica")) == grpc.StatusCode.UNAVAILABLE
    assert status_code(TooLarge("big", "too_many_tokens")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(InvalidRequest("bad", "invalid_value")) == grpc.StatusCode.INVALID_ARGUMENT
    assert status_code(NotFound("who", "not_found")) == grpc.StatusCode.NOT_FOUND
    assert status_code(ClientClosed("gone", "client_closed")) == grpc.StatusCode.CANCELLED
