"""A 429's Retry-After is the service's own estimate of the wait (the generator's
``retry-after`` trailer, openbook.errors.Overloaded.retry_after_s), not a constant."""

from __future__ import annotations

import grpc
import pytest

from openbook.serving.grpc_server import RETRY_AFTER_TRAILER
from openbook_gateway.clients import MAX_RETRY_AFTER_S, http_error


def _error(code: grpc.StatusCode, trailers: tuple = ()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(
        code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), details="busy"
    )


@pytest.mark.parametrize(
    ("trailer", "expected"),
    [("37", "37"), ("0", "1"), ("100000", str(MAX_RETRY_AFTER_S)), ("soon", "1"), (None, "1")],
)
def test_a_429_carries_the_generator_s_estimate(trailer, expected):
    trailers = () if trailer is None else ((RETRY_AFTER_TRAILER, trailer),)
    exc = http_error("generator", _error(grpc.StatusCode.RESOURCE_EXHAUSTED, trailers))
    assert exc.status_code == 429
    assert exc.headers == {"Retry-After": expected}
    assert "generator is overloaded" in exc.detail


def test_an_unavailable_service_says_retry_in_a_second():
    exc = http_error("retriever", _error(grpc.StatusCode.UNAVAILABLE))
    assert (exc.status_code, exc.headers) == (503, {"Retry-After": "1"})


def test_other_errors_carry_no_retry_after():
    exc = http_error(
        "generator", _error(grpc.StatusCode.OUT_OF_RANGE, ((RETRY_AFTER_TRAILER, "5"),))
    )
    assert exc.status_code == 413 and exc.headers is None
