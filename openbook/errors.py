"""Errors that cross service boundaries, each with the gRPC status it maps to.

Libraries raise ``ValueError`` subclasses for bad input (the index and RAG libraries do);
services raise these when they need a specific status.
"""

from __future__ import annotations

import grpc


class OpenbookError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(OpenbookError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(OpenbookError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class FailedPrecondition(OpenbookError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(OpenbookError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DeadlineExceeded(OpenbookError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, OpenbookError):
        return exc.code
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, LookupError):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.INTERNAL
