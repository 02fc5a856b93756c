"""gRPC server reflection under both names clients ask for: ``grpc.reflection.v1`` (current
grpcurl, grpc_cli, Postman) and ``grpc.reflection.v1alpha`` (older clients).

grpcio-reflection serves only v1alpha (up to 1.85 at least; grpc/grpc#38576). The v1 protocol
is v1alpha under a new package name: the same messages with the same field numbers, so the
bytes on the wire are the same. One servicer therefore answers both: v1 calls reach it through
a generic handler with the v1alpha message codecs. So that a v1 client can also describe the v1
service itself (``file_containing_symbol("grpc.reflection.v1.ServerReflection")``), the v1 proto
file, derived from the v1alpha one by renaming its package, is added to the descriptor pool the
servicer reads, unless something already put the real one there.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_reflection.v1alpha import reflection
from grpc_reflection.v1alpha import reflection_pb2 as v1alpha_pb2
from grpc_reflection.v1alpha import reflection_pb2_grpc as v1alpha_grpc

V1ALPHA_SERVICE: str = reflection.SERVICE_NAME
V1_PACKAGE = "grpc.reflection.v1"
V1_FILE = "grpc/reflection/v1/reflection.proto"
V1_SERVICE = f"{V1_PACKAGE}.ServerReflection"
V1_METHOD = "ServerReflectionInfo"

_pool_lock = threading.Lock()


def _v1_file_proto() -> descriptor_pb2.FileDescriptorProto:
    """The v1 reflection proto: v1alpha's with the package (and every reference into it)
    renamed. Its language options (java_package, ...) are dropped: they name v1alpha's."""
    proto = descriptor_pb2.FileDescriptorProto()
    v1alpha_pb2.DESCRIPTOR.CopyToProto(proto)
    old_prefix = f".{proto.package}."
    new_prefix = f".{V1_PACKAGE}."

    def renamed(type_name: str) -> str:
        if type_name.startswith(old_prefix):
            return new_prefix + type_name[len(old_prefix) :]
        return type_name

    proto.name = V1_FILE
    proto.package = V1_PACKAGE
    proto.ClearField("options")
    for message in proto.message_type:
        for field in message.field:
            if field.type_name:
                field.type_name = renamed(field.type_name)
    for service in proto.service:
        for method in service.method:
            method.input_type = renamed(method.input_type)
            method.output_type = renamed(method.output_type)
    return proto


def add_v1_descriptor(pool: descriptor_pool.DescriptorPool) -> None:
    """Put the v1 reflection file in ``pool`` unless it is there already (idempotent)."""
    with _pool_lock:
        try:
            pool.FindFileByName(V1_FILE)
        except KeyError:
            pool.AddSerializedFile(_v1_file_proto().SerializeToString())


def enable_server_reflection(service_names: Iterable[str], server: grpc.Server) -> None:
    """Serve reflection on ``server`` (a sync one) for ``service_names`` and both reflection
    services, under ``grpc.reflection.v1`` and ``grpc.reflection.v1alpha``."""
    add_v1_descriptor(descriptor_pool.Default())
    names = dict.fromkeys((*service_names, V1_SERVICE, V1ALPHA_SERVICE))
    servicer = reflection.ReflectionServicer(tuple(names))
    v1alpha_grpc.add_ServerReflectionServicer_to_server(servicer, server)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                V1_SERVICE,
                {
                    V1_METHOD: grpc.stream_stream_rpc_method_handler(
                        servicer.ServerReflectionInfo,
                        request_deserializer=v1alpha_pb2.ServerReflectionRequest.FromString,
                        response_serializer=v1alpha_pb2.ServerReflectionResponse.SerializeToString,
                    )
                },
            ),
        )
    )
