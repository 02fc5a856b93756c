"""Async gRPC clients for the retriever and generator, with deadlines and HTTP error mapping.

Every call carries a deadline and the request id; a gRPC failure becomes an ``HTTPException``
that names the service: bad input -> 422, overload -> 429, deadline -> 504, down -> 503.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc
from fastapi import HTTPException
from grpc_health.v1 import health_pb2, health_pb2_grpc

from openbook.serving.grpc_server import REQUEST_ID_HEADER
from openbook.v1 import generator_pb2_grpc, retriever_pb2_grpc

T = TypeVar("T")

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.NOT_FOUND: 422,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
}


def http_error(service: str, error: grpc.aio.AioRpcError) -> HTTPException:
    code = error.code()
    status = _HTTP_STATUS.get(code, 502)
    detail = error.details() or code.name
    if code == grpc.StatusCode.UNAVAILABLE:
        detail = f"{service} unavailable: {detail}"
    elif status == 429:
        detail = f"{service} is overloaded: {detail}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        detail = f"{service} did not answer within the deadline"
    elif status >= 500:
        detail = f"{service} failed: {detail}"
    headers = {"Retry-After": "1"} if status in (429, 503) else None
    return HTTPException(status_code=status, detail=detail, headers=headers)


class ServiceClient:
    """One gRPC channel to one service."""

    def __init__(self, name: str, addr: str, timeout_s: float, health_timeout_s: float) -> None:
        self.name = name
        self.addr = addr
        self.timeout_s = timeout_s
        self.health_timeout_s = health_timeout_s
        self.channel = grpc.aio.insecure_channel(
            addr,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                # Reconnect quickly after a service restart instead of backing off for minutes.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 2000),
            ],
        )
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def call(
        self,
        method: Callable[..., Awaitable[T]],
        request,
        request_id: str = "",
        timeout_s: float | None = None,
    ) -> T:
        metadata = ((REQUEST_ID_HEADER, request_id),) if request_id else None
        try:
            return await method(request, timeout=timeout_s or self.timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            raise http_error(self.name, error) from None

    async def healthy(self) -> bool:
        try:
            reply = await self.health.Check(
                health_pb2.HealthCheckRequest(), timeout=self.health_timeout_s
            )
        except grpc.aio.AioRpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    async def close(self) -> None:
        await self.channel.close()


class RetrieverClient(ServiceClient):
    def __init__(self, addr: str, timeout_s: float, health_timeout_s: float) -> None:
        super().__init__("retriever", addr, timeout_s, health_timeout_s)
        self.stub = retriever_pb2_grpc.RetrieverStub(self.channel)


class GeneratorClient(ServiceClient):
    def __init__(self, addr: str, timeout_s: float, health_timeout_s: float) -> None:
        super().__init__("generator", addr, timeout_s, health_timeout_s)
        self.stub = generator_pb2_grpc.GeneratorStub(self.channel)
