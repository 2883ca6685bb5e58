"""gRPC server reflection on the Open Inference Protocol's port, as both `grpc.reflection.v1alpha.ServerReflection`
and `grpc.reflection.v1.ServerReflection`. grpcio-reflection (1.85.1, the latest release) serves v1alpha only, and a
client that speaks v1 alone finds nothing there. v1 is v1alpha renamed: the same messages, field for field (names,
numbers, types, the two oneofs), so the same bytes. So v1alpha's servicer answers v1's method too, and v1's file,
v1alpha's descriptor under v1's package, is added to the descriptor pool, so that reflection also describes itself
under v1's name."""

from __future__ import annotations

from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2, reflection_pb2_grpc

V1_SERVICE_NAME = "grpc.reflection.v1.ServerReflection"
_V1_FILE = "grpc/reflection/v1/reflection.proto"
_V1ALPHA_PACKAGE, _V1_PACKAGE = ".grpc.reflection.v1alpha.", ".grpc.reflection.v1."


def add_reflection(server: grpc.aio.Server, service_names: Iterable[str]) -> None:
    """Reflection of `service_names` and of itself, under v1alpha's name and v1's."""
    _add_v1_file(descriptor_pool.Default())
    names = (*service_names, reflection.SERVICE_NAME, V1_SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names)
    reflection_pb2_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    info = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(V1_SERVICE_NAME, {"ServerReflectionInfo": info}),)
    )


def v1_file() -> descriptor_pb2.FileDescriptorProto:
    """grpc/reflection/v1/reflection.proto: v1alpha's file with v1's name and package, its type references moved."""
    proto = descriptor_pb2.FileDescriptorProto()
    reflection_pb2.DESCRIPTOR.CopyToProto(proto)
    proto.name, proto.package = _V1_FILE, _V1_PACKAGE.strip(".")
    for message in proto.message_type:
        for field in message.field:
            if field.HasField("type_name"):  # a message's field; set on a string's, an empty one is refused
                field.type_name = field.type_name.replace(_V1ALPHA_PACKAGE, _V1_PACKAGE)
    for method in proto.service[0].method:
        method.input_type = method.input_type.replace(_V1ALPHA_PACKAGE, _V1_PACKAGE)
        method.output_type = method.output_type.replace(_V1ALPHA_PACKAGE, _V1_PACKAGE)
    return proto


def _add_v1_file(pool: descriptor_pool.DescriptorPool) -> None:
    try:
        pool.FindFileByName(_V1_FILE)
    except KeyError:
        pool.AddSerializedFile(v1_file().SerializeToString())
