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


class Cancelled(OpenbookError):
    """The caller went away before its result was ready."""

    code = grpc.StatusCode.CANCELLED


class TooLarge(OpenbookError):
    """The request alone needs more than the service's configured budget: it can never run as
    it is (the gateway's 413), unlike :class:`Overloaded`, which may succeed later (429)."""

    code = grpc.StatusCode.OUT_OF_RANGE


class Unauthenticated(OpenbookError):
    """An admin RPC without the right bearer token (or on a service with admin turned off)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class Unavailable(OpenbookError):
    """The service is up but cannot serve yet (still loading): callers should retry."""

    code = grpc.StatusCode.UNAVAILABLE


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
