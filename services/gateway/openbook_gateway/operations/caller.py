"""Who a service-layer operation works for: the caller as the door found it.

Invariant: built once per transport request (:func:`caller_of`), from what the request
middleware (the request id) and the door (the principal, ``openbook_gateway.access``) put in
its state; the operations read nothing else of the request.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from starlette.requests import Request

from openbook_gateway.principal import Principal, principal_of


async def _never_disconnected() -> bool:
    return False  # a caller without a connection to watch (a test, a script)


@dataclass(frozen=True)
class Caller:
    """The principal an operation acts for, the request id it logs and sends to the services,
    and whether the client that asked is gone (a gone client's generation is cancelled)."""

    principal: Principal
    request_id: str
    is_disconnected: Callable[[], Awaitable[bool]] = _never_disconnected


def caller_of(request: Request) -> Caller:
    """The caller of an HTTP request (a REST or ``/v1`` route's, or the ``POST /mcp`` that
    carries a tool call)."""
    return Caller(principal_of(request), request.state.request_id, request.is_disconnected)
