"""gRPC server reflection v1 (what current grpcurl and Postman ask first) and v1alpha, on a
running retriever. The v1 client here is compiled from the v1 reflection.proto of grpc-proto
into a pool of its own: it shares nothing with the server's code but the wire."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import descriptor_database, descriptor_pb2, descriptor_pool, message_factory
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from grpc_tools import protoc

from openbook_retriever.settings import RetrieverSettings
from openbook_testkit.stack import build_fact_indexes, retriever_service

# grpc/reflection/v1/reflection.proto of github.com/grpc/grpc-proto, without its comments.
V1_PROTO = """
syntax = "proto3";
package grpc.reflection.v1;
option go_package = "google.golang.org/grpc/reflection/grpc_reflection_v1";
option java_multiple_files = true;
option java_package = "io.grpc.reflection.v1";
option java_outer_classname = "ServerReflectionProto";
service ServerReflection {
  rpc ServerReflectionInfo(stream ServerReflectionRequest)
      returns (stream ServerReflectionResponse);
}
message ServerReflectionRequest {
  string host = 1;
  oneof message_request {
    string file_by_filename = 3;
    string file_containing_symbol = 4;
    ExtensionRequest file_containing_extension = 5;
    string all_extension_numbers_of_type = 6;
    string list_services = 7;
  }
}
message ExtensionRequest {
  string containing_type = 1;
  int32 extension_number = 2;
}
message ServerReflectionResponse {
  string valid_host = 1;
  ServerReflectionRequest original_request = 2;
  oneof message_response {
    FileDescriptorResponse file_descriptor_response = 4;
    ExtensionNumberResponse all_extension_numbers_response = 5;
    ListServiceResponse list_services_response = 6;
    ErrorResponse error_response = 7;
  }
}
message FileDescriptorResponse { repeated bytes file_descriptor_proto = 1; }
message ExtensionNumberResponse {
  string base_type_name = 1;
  repeated int32 extension_number = 2;
}
message ListServiceResponse { repeated ServiceResponse service = 1; }
message ServiceResponse { string name = 1; }
message ErrorResponse {
  int32 error_code = 1;
  string error_message = 2;
}
"""
V1_METHOD = "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo"


@pytest.fixture(scope="module")
def v1_proto(tmp_path_factory) -> descriptor_pb2.FileDescriptorProto:
    root = tmp_path_factory.mktemp("proto")
    (root / "grpc/reflection/v1").mkdir(parents=True)
    (root / "grpc/reflection/v1/reflection.proto").write_text(V1_PROTO)
    out = root / "v1.desc"
    assert (
        protoc.main(
            [
                "protoc",
                f"--proto_path={root}",
                f"--descriptor_set_out={out}",
                "grpc/reflection/v1/reflection.proto",
            ]
        )
        == 0
    )
    files = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return files.file[0]


class V1Client:
    """A grpc.reflection.v1.ServerReflection stub from the client's own messages."""

    def __init__(self, channel: grpc.Channel, proto: descriptor_pb2.FileDescriptorProto):
        pool = descriptor_pool.DescriptorPool()
        pool.Add(proto)
        self.request = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest")
        )
        response = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")
        )
        self.call = channel.stream_stream(
            V1_METHOD,
            request_serializer=self.request.SerializeToString,
            response_deserializer=response.FromString,
        )

    def ask(self, **request):
        (reply,) = list(self.call(iter([self.request(**request)]), timeout=30))
        return reply

    def files(self, **request) -> list[descriptor_pb2.FileDescriptorProto]:
        reply = self.ask(**request)
        assert reply.WhichOneof("message_response") == "file_descriptor_response", reply
        return [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in reply.file_descriptor_response.file_descriptor_proto
        ]


@pytest.fixture(scope="module")
def index_root(tmp_path_factory):
    root = tmp_path_factory.mktemp("indexes")
    build_fact_indexes(root)
    return root


@pytest.fixture
def retriever(index_root, redis_url):
    settings = RetrieverSettings(
        host="127.0.0.1",
        port=0,
        index_root=index_root,
        default_index="facts-a",
        redis_url=redis_url,
        admin_token="reflection-token",
    )
    with retriever_service(settings) as running:
        yield running


def fields(message: descriptor_pb2.DescriptorProto) -> list[tuple[str, int, int, str]]:
    return [(f.name, f.number, f.type, f.type_name) for f in message.field]


def test_reflection_v1_lists_services_and_describes_them(retriever, v1_proto):
    _, service, _ = retriever
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        client = V1Client(channel, v1_proto)
        reply = client.ask(list_services="")
        assert reply.original_request.list_services == ""  # echoed in the v1 message
        services = {s.name for s in reply.list_services_response.service}
        assert services == {
            "openbook.v1.Retriever",
            "grpc.health.v1.Health",
            "grpc.reflection.v1.ServerReflection",
            "grpc.reflection.v1alpha.ServerReflection",
        }

        # The service's file and those it imports, from the server alone, resolve into a
        # pool with the service and its RPCs.
        database = descriptor_database.DescriptorDatabase()
        for file in client.files(file_containing_symbol="openbook.v1.Retriever"):
            database.Add(file)
        described = descriptor_pool.DescriptorPool(database).FindServiceByName(
            "openbook.v1.Retriever"
        )
        assert {"Retrieve", "ListDocuments"} <= set(described.methods_by_name)
        assert described.file.package == "openbook.v1"
        by_name = client.files(file_by_filename=described.file.name)
        assert by_name[0].name == described.file.name and by_name[0].package == "openbook.v1"

        # The v1 reflection service describes itself as the v1 proto does.
        (served,) = client.files(file_containing_symbol="grpc.reflection.v1.ServerReflection")
        assert (served.name, served.package) == (v1_proto.name, "grpc.reflection.v1")
        assert {m.name: fields(m) for m in served.message_type} == {
            m.name: fields(m) for m in v1_proto.message_type
        }
        (method,) = served.service[0].method
        assert (method.input_type, method.output_type) == (
            ".grpc.reflection.v1.ServerReflectionRequest",
            ".grpc.reflection.v1.ServerReflectionResponse",
        )

        missing = client.ask(file_containing_symbol="openbook.v1.Nowhere")
        assert missing.error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_reflection_v1alpha_still_answers(retriever):
    _, service, _ = retriever
    with grpc.insecure_channel(f"127.0.0.1:{service.port}") as channel:
        database = ProtoReflectionDescriptorDatabase(channel)
        assert {"openbook.v1.Retriever", "grpc.reflection.v1.ServerReflection"} <= set(
            database.get_services()
        )
        described = descriptor_pool.DescriptorPool(database).FindServiceByName(
            "openbook.v1.Retriever"
        )
        assert "Retrieve" in described.methods_by_name
