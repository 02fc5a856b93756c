"""Running a gRPC method handler inside a context manager: what a server interceptor that
observes every call (``grpc_server.ErrorInterceptor``, ``tracing.RequestIdInterceptor``)
does to the handler it is given.

The unary-unary and unary-stream handlers (every RPC of ``proto/openbook/v1``) are wrapped; a
server-streaming call is one call, so the context manager is around the whole stream and sees
the client going away as ``GeneratorExit``. A handler of another call type, or none, is
returned as it is.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import grpc

# What to run each call in, given the call's context.
Around = Callable[[grpc.ServicerContext], AbstractContextManager[object]]


def wrap_handler(
    handler: grpc.RpcMethodHandler | None, around: Around
) -> grpc.RpcMethodHandler | None:
    """``handler`` with every call of it run inside ``around(context)`` (module docstring)."""
    if handler is None:
        return handler
    if handler.unary_unary is not None:
        inner = handler.unary_unary

        def unary(request, context: grpc.ServicerContext):
            with around(context):
                return inner(request, context)

        return grpc.unary_unary_rpc_method_handler(
            unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    if handler.unary_stream is not None:
        streaming = handler.unary_stream

        def stream(request, context: grpc.ServicerContext):
            # The whole stream is one call: an error before or between events ends it; the
            # client going away closes the handler's iterator.
            with around(context):
                yield from streaming(request, context)

        return grpc.unary_stream_rpc_method_handler(
            stream,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
    return handler
