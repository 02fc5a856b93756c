"""Errors that cross service boundaries, each with the gRPC status it maps to.

A service's boundary validates each request into a typed request (``openbook.validation.limits``)
and raises these for a client's mistakes; whatever else escapes an RPC is a bug in the service
and becomes INTERNAL (the gateway's 500), even a ``ValueError`` or ``LookupError`` from a
library. Library errors that do mean "the client asked for something wrong" wherever a
service meets them are declared once with :func:`client_errors`.

Inside ``openbook/`` too, invalid input is an :class:`InvalidArgument` (or a subclass) naming
the field or setting; a model or index directory that cannot be served is a declared load error,
a ``ValueError`` subclass (``openbook.rag.ModelLoadError``, ``openbook.index.IndexLoadError``);
a broken invariant of openbook's own code is an :class:`InternalError`. No module raises a bare
``ValueError`` (``tests/test_error_vocabulary.py``).
"""

from __future__ import annotations

import grpc


class OpenbookError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(OpenbookError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class InternalError(OpenbookError, RuntimeError):
    """An invariant of openbook's own code or state broke (a caller inside openbook passed
    what it promised not to, a record openbook wrote reads back wrong): a bug or damage,
    never the client's mistake, so INTERNAL (the gateway's 500 naming the request id), and a
    ``RuntimeError`` for the commands that report those."""

    code = grpc.StatusCode.INTERNAL


class NotFound(OpenbookError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(OpenbookError):
    """What the request would create exists already (an index of that name)."""

    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(OpenbookError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class Overloaded(OpenbookError):
    """Too much work to take this request now; ``retry_after_s``, when known, says when it
    could be taken (sent as ``retry-after`` trailing metadata, the gateway's Retry-After)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


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


# Library exception types declared as client errors, with their status (client_errors).
_CLIENT_ERRORS: dict[type[BaseException], grpc.StatusCode] = {}


def client_errors(
    *types: type[BaseException], code: grpc.StatusCode = grpc.StatusCode.INVALID_ARGUMENT
) -> None:
    """Declare library exceptions that a service raises only for a client's mistake (a
    checkpoint or index that a request named and that is refused), so they answer ``code``.
    For library types a service cannot raise as :class:`OpenbookError` subclasses."""
    for cls in types:
        _CLIENT_ERRORS[cls] = code


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The status an exception escaping an RPC answers: its own for :class:`OpenbookError`s
    and declared client errors, INTERNAL for anything else."""
    if isinstance(exc, OpenbookError):
        return exc.code
    for cls in type(exc).__mro__:
        if cls in _CLIENT_ERRORS:
            return _CLIENT_ERRORS[cls]
    return grpc.StatusCode.INTERNAL
