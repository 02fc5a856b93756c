"""Async gRPC clients for the retriever and generator, with deadlines and HTTP error mapping.

Every call carries a deadline and the request id, and admin RPCs (SwapIndex, ReloadModel, ...)
the admin token; a gRPC failure becomes an ``HTTPException`` that names the service: bad
input -> 422, overload -> 429, deadline -> 504, down -> 503, a bug in the service -> 500
(its message stays in the service's log, under the request id).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import grpc
from fastapi import HTTPException
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pydantic import SecretStr

from openbook.serving.grpc_server import (
    ADMIN_RPCS,
    GENERATOR_SERVICE,
    REQUEST_ID_HEADER,
    RETRIEVER_SERVICE,
    RETRY_AFTER_TRAILER,
    bearer_metadata,
    deadline_metadata,
)
from openbook.serving.tracing import trace_metadata
from openbook.v1 import (
    common_pb2,
    generator_pb2,
    generator_pb2_grpc,
    retriever_pb2_grpc,
)

T = TypeVar("T")

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.NOT_FOUND: 422,
    grpc.StatusCode.FAILED_PRECONDITION: 409,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    # The request alone exceeds a service's budget (openbook.errors.TooLarge): it will never
    # run as it is, so not a 429 to retry but a 413 saying what to change.
    grpc.StatusCode.OUT_OF_RANGE: 413,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.CANCELLED: 503,
    # Whatever the service did not raise on purpose: a bug there, not the client's mistake.
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNKNOWN: 500,
}


# The documents API names resources in its paths (/indexes/{index}/documents/{doc_id}): what the
# retriever does not have is a 404 there. Elsewhere an unknown index is a field of the body
# (``"index": "nope"``): a 422 naming it.
DOCUMENT_HTTP_STATUS = {**_HTTP_STATUS, grpc.StatusCode.NOT_FOUND: 404}


def http_error(
    service: str,
    error: grpc.aio.AioRpcError,
    statuses: dict[grpc.StatusCode, int] = _HTTP_STATUS,
) -> HTTPException:
    code = error.code()
    status = statuses.get(code, 502)
    detail = error.details() or code.name
    if code == grpc.StatusCode.UNAUTHENTICATED:
        # The caller's token was right (the gateway checked it); this one is the gateway's
        # own configuration: a 502, not a 401.
        detail = (
            f"{service} refused the gateway's admin token ({detail}): OPENBOOK_ADMIN_TOKEN "
            "must be the same on the gateway, the retriever and the generator"
        )
    elif code == grpc.StatusCode.UNAVAILABLE:
        detail = f"{service} unavailable: {detail}"
    elif status == 429:
        detail = f"{service} is overloaded: {detail}"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        detail = f"{service} did not answer within the deadline"
    elif status == 500:
        detail = f"internal error in the {service}"
    elif status >= 500:
        detail = f"{service} failed: {detail}"
    headers = {"Retry-After": retry_after(error)} if status in (429, 503) else None
    return HTTPException(status_code=status, detail=detail, headers=headers)


# The longest Retry-After the gateway passes on: a service's estimate beyond it is no promise.
MAX_RETRY_AFTER_S = 600


def retry_after(error: grpc.aio.AioRpcError) -> str:
    """Seconds a client should wait before retrying: the service's own estimate (its
    ``retry-after`` trailer: the generator's expected wait at the speed it measures), else 1."""
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_TRAILER:
            text = value.decode() if isinstance(value, bytes) else str(value)
            if text.isdigit():
                return str(min(MAX_RETRY_AFTER_S, max(1, int(text))))
    return "1"


class ServiceClient:
    """One gRPC channel to one service, and its ``stub``. Calls to the stub's admin RPCs
    (``ADMIN_RPCS``) carry ``authorization: Bearer <admin_token>``; no other call does.

    A subclass per service names it: ``name`` (in errors), ``stub_class`` and ``service`` (its
    full gRPC name)."""

    name: str
    stub_class: type
    service: str

    def __init__(
        self,
        addr: str,
        timeout_s: float,
        health_timeout_s: float,
        admin_token: SecretStr | str | None = None,
    ) -> None:
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
        self.stub = self.stub_class(self.channel)
        self._admin_metadata = bearer_metadata(admin_token)
        # A stub's methods are created once, so ``call`` recognises them by identity.
        self._admin_calls = {id(getattr(self.stub, rpc)) for rpc in ADMIN_RPCS[self.service]}

    async def call(
        self,
        method: Callable[..., Awaitable[T]],
        request,
        request_id: str = "",
        timeout_s: float | None = None,
        statuses: dict[grpc.StatusCode, int] = _HTTP_STATUS,
    ) -> T:
        timeout_s = timeout_s or self.timeout_s
        metadata = self._metadata(timeout_s, request_id)
        if id(method) in self._admin_calls:
            metadata += self._admin_metadata
        try:
            return await method(request, timeout=timeout_s, metadata=metadata)
        except grpc.aio.AioRpcError as error:
            raise http_error(self.name, error, statuses) from None

    @staticmethod
    def _metadata(timeout_s: float, request_id: str) -> tuple[tuple[str, str], ...]:
        """Every call's metadata: its deadline, the current span (W3C traceparent, with
        tracing on) and the request's id (if any)."""
        metadata = (*deadline_metadata(timeout_s), *trace_metadata())
        if request_id:
            metadata += ((REQUEST_ID_HEADER, request_id),)
        return metadata

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
    name = "retriever"
    stub_class = retriever_pb2_grpc.RetrieverStub
    service = RETRIEVER_SERVICE


class GeneratorClient(ServiceClient):
    name = "generator"
    stub_class = generator_pb2_grpc.GeneratorStub
    service = GENERATOR_SERVICE

    async def generate(
        self, request: generator_pb2.GenerateRequest, request_id: str
    ) -> generator_pb2.GenerateResponse:
        """The answer to ``request`` (:func:`~openbook_gateway.mapping.generate_request`)."""
        return await self.call(self.stub.Generate, request, request_id)

    async def generate_stream(
        self, request: generator_pb2.GenerateRequest, request_id: str
    ) -> AsyncIterator[generator_pb2.GenerateEvent]:
        """GenerateStream's events for ``request`` (as :meth:`generate`); leaving the iteration
        early cancels the call (the generator then drops the request from its batch)."""
        metadata = self._metadata(self.timeout_s, request_id)
        call = self.stub.GenerateStream(request, timeout=self.timeout_s, metadata=metadata)
        try:
            async for event in call:
                yield event
        except grpc.aio.AioRpcError as error:
            raise http_error(self.name, error) from None
        finally:
            call.cancel()  # a no-op once the stream ended

    async def reload_model(self, path: str, request_id: str, timeout_s: float) -> str:
        """Load the checkpoint ``path`` names; returns the version now served."""
        request = common_pb2.ReloadModelRequest(path=path)
        reply = await self.call(self.stub.ReloadModel, request, request_id, timeout_s)
        return reply.model_version
