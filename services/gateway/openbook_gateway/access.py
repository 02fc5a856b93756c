"""The gateway's door (issue 43): who a request is, and whether its route lets it in.

One decision, :func:`admit`, for every request before its handler runs: the app's dependency
:func:`check_access` makes it for every FastAPI route (REST, ``/v1``, the admin API), the
``/mcp`` endpoint (an ASGI route of its own) makes it before the MCP layer reads a byte. No
route checks a key by hand; a route reads who is asking from ``request.state.principal``
(:func:`principal_of`) only to narrow what it shows (the indexes a key may name), and the MCP
write tools ask it for their scope (:func:`require_scope`).

Who a request is (:func:`identify`), from its ``Authorization: Bearer <token>``
(:mod:`openbook.security.auth`'s rules: exact, constant time):

* the admin token (``OPENBOOK_ADMIN_TOKEN``): scope ``admin``;
* one of ``OPENBOOK_GATEWAY_API_KEYS``: scope ``ask``;
* a key made with ``POST /admin/keys`` (``obk_<name>.<secret>``, :mod:`openbook_gateway.api_keys`):
  its scopes and indexes, read from Redis on every request (nothing cached: a deleted key is
  refused at once by every gateway). Redis unreachable: 503, never open;
* anything else (nothing, another scheme, an unknown token, an OpenAI client's placeholder):
  anonymous.

Scopes: ``ask`` (answers, chat, responses, embeddings, models, MCP's read tools, reading
indexes and documents), ``write`` (documents and uploads), ``admin`` (everything the admin
token does: the admin API, creating and deleting indexes, keys; it includes the other two).

What a route needs is :data:`RULES` (method and path template -> scope and door), one table,
the one in docs/security.md. A route the table does not name needs ``admin`` (fail closed;
tests/services/test_api_keys.py checks that every route is named). Doors:

* ``PUBLIC``: never a key (``/healthz``, ``/readyz``, ``/metrics``, the page and its files);
* ``OPEN``: a key only with ``OPENBOOK_GATEWAY_REQUIRE_KEYS=true`` (``/answer``, reads);
* ``API``: as ``OPEN``, and also while ``OPENBOOK_GATEWAY_API_KEYS`` is set (``/v1``, ``/mcp``,
  as before keys had scopes);
* ``CLOSED``: always (writes, the admin API).

Behind a door that is shut, no credential is a 401; a credential without the scope a 403. A key
with ``indexes`` may name only those: any other is a 404, as an index that does not exist is
(its name does not leak), in a path (here) or a body (:meth:`Principal.index_for`, which the
answer pipeline, ``/v1`` and the MCP tools call); a request naming no index gets the key's
first. Listings (``GET /indexes``, ``/v1/models``, MCP ``list_indexes``) show only its indexes.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from openbook.errors import InvalidArgument
from openbook.security.auth import bearer_token, token_matches
from openbook.state.api_keys_state_aio import read_api_key, touch_api_key
from openbook.validation.metadata_filter import parse_filter
from openbook_gateway import api_keys, key_limits, openai_format
from openbook_gateway.api_keys import LastUsed
from openbook_gateway.openai_schemas import OpenAIRequestError
from openbook_gateway.principal import (
    ADMIN,
    ADMIN_TOKEN_NAME,
    ANONYMOUS,
    API_KEY_NAME,
    ASK,
    INDEXES_CREATE,
    WRITE,
    Principal,
    principal_of,
)
from openbook_gateway.services import Services, get_services
from openbook_gateway.settings import GatewaySettings

log = logging.getLogger(__name__)


class Door(Enum):
    PUBLIC = "public"
    OPEN = "open"
    API = "api"
    CLOSED = "closed"


@dataclass(frozen=True)
class Rule:
    scope: str | None  # None: PUBLIC
    door: Door


_PUBLIC = Rule(None, Door.PUBLIC)
_READ = Rule(ASK, Door.OPEN)
_API = Rule(ASK, Door.API)
_WRITE = Rule(WRITE, Door.CLOSED)
_CREATE = Rule(INDEXES_CREATE, Door.CLOSED)
_ADMIN = Rule(ADMIN, Door.CLOSED)
_DOCUMENT = "/indexes/{index}/documents/{doc_id:path}"

# (method, the route's path template) -> what it needs. docs/security.md, "Keys and scopes".
RULES: dict[tuple[str, str], Rule] = {
    ("GET", "/"): _PUBLIC,
    ("GET", "/static/{name}"): _PUBLIC,
    ("GET", "/healthz"): _PUBLIC,
    ("GET", "/readyz"): _PUBLIC,
    ("GET", "/metrics"): _PUBLIC,
    # FastAPI's own pages: the API's description, open as /answer is
    ("GET", "/openapi.json"): _READ,
    ("GET", "/docs"): _READ,
    ("GET", "/docs/oauth2-redirect"): _READ,
    ("GET", "/redoc"): _READ,
    ("POST", "/answer"): _READ,
    ("GET", "/indexes"): _READ,
    ("GET", "/indexes/{index}/documents"): _READ,
    ("GET", _DOCUMENT): _READ,
    ("PUT", _DOCUMENT): _WRITE,
    ("DELETE", _DOCUMENT): _WRITE,
    ("POST", "/indexes/{index}/documents:batch"): _WRITE,
    ("POST", "/indexes/{index}/documents"): _WRITE,  # an upload
    ("POST", "/indexes"): _CREATE,
    ("DELETE", "/indexes/{name}"): _ADMIN,
    ("POST", "/admin/swap-index"): _ADMIN,
    ("POST", "/admin/reload-model"): _ADMIN,
    ("GET", "/admin/replicas"): _ADMIN,
    ("POST", "/admin/keys"): _ADMIN,
    ("GET", "/admin/keys"): _ADMIN,
    ("DELETE", "/admin/keys/{name}"): _ADMIN,
    ("GET", "/v1/models"): _API,
    ("GET", "/v1/models/{model_id:path}"): _API,
    ("POST", "/v1/chat/completions"): _API,
    ("POST", "/v1/responses"): _API,
    ("POST", "/v1/embeddings"): _API,
    # MCP: reaching the tools; each write tool asks for its own scope (mcp_tools)
    ("GET", "/mcp"): _API,
    ("POST", "/mcp"): _API,
    ("DELETE", "/mcp"): _API,
}
UNCLASSIFIED = _ADMIN


def rule_of(method: str, path: str) -> Rule:
    return RULES.get(("GET" if method == "HEAD" else method, path), UNCLASSIFIED)


def static_api_keys(settings: GatewaySettings) -> list[str]:
    """``OPENBOOK_GATEWAY_API_KEYS``: comma-separated (a key has no spaces or commas), spaces
    around a comma are the list's formatting, not part of a key."""
    listed = settings.api_keys.get_secret_value() if settings.api_keys else ""
    return [key.strip() for key in listed.split(",") if key.strip()]


def admin_token(settings: GatewaySettings) -> str:
    return settings.admin_token.get_secret_value() if settings.admin_token else ""


async def identify(
    authorization: str | None, services: Services, last_used: LastUsed | None = None
) -> Principal:
    """Who presents ``authorization`` (module docstring); ``RedisError`` / ``OSError`` when it
    is a managed key and Redis cannot be asked."""
    token = bearer_token(authorization)
    if token is None:
        return ANONYMOUS
    settings = services.settings
    owner = hashlib.sha256(token.encode("utf-8", "surrogateescape")).hexdigest()
    admin = admin_token(settings)
    if admin and token_matches(token, [admin]):
        return Principal(ADMIN_TOKEN_NAME, frozenset({ADMIN}), owner=owner)
    static = static_api_keys(settings)
    if static and token_matches(token, static):
        return Principal(API_KEY_NAME, frozenset({ASK}), owner=owner)
    presented = api_keys.parse(token)
    if presented is None:
        return ANONYMOUS
    cache = services.cache
    record = await read_api_key(cache.client, cache.sealer, presented.name)
    # hashed whether or not the name has a record (a dummy salt then): a timing probe cannot
    # tell a name that exists from one that does not
    valid = api_keys.matches(record, presented)
    if record is None or not valid:
        return ANONYMOUS
    if last_used is not None and last_used.due(record["name"]):
        # only a listing's "last used": the key itself was checked
        with contextlib.suppress(RedisError, OSError):
            await touch_api_key(cache.client, record["name"], time.time())
    indexes = tuple(record["indexes"]) if record["indexes"] is not None else None
    try:
        tenant = parse_filter(record["filter"], "filter")
    except InvalidArgument as exc:  # sealed by us, so never; a key held to what it cannot say
        log.warning("key %s: its filter does not parse, refused: %s", record["name"], exc)
        return ANONYMOUS
    return Principal(
        record["name"], frozenset(record["scopes"]), indexes, owner, tenant, record["rate"]
    )


class Refused(Exception):
    """The door's refusal: a status, what to tell the client, and OpenAI's error code."""

    def __init__(
        self, status: int, message: str, code: str | None = None, retry_after: int = 1
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        if self.status == 401:
            return {"WWW-Authenticate": "Bearer"}
        return {"Retry-After": str(self.retry_after)} if self.status in (429, 503) else {}

    def response(self, path: str) -> JSONResponse:
        """As a response of its own (an ASGI route's: ``/mcp``)."""
        if openai_format.is_openai_path(path):
            body = openai_format.error_body(self.status, self.message, code=self.code)
        else:
            body = {"detail": self.message}
        return JSONResponse(body, self.status, headers=self.headers())

    def exception(self, path: str) -> Exception:
        """As what a FastAPI dependency raises (OpenAI's error object under ``/v1``)."""
        if openai_format.is_openai_path(path):
            return OpenAIRequestError(
                self.message, None, self.code, status=self.status, headers=self.headers() or None
            )
        return HTTPException(self.status, self.message, headers=self.headers() or None)


# When each key was last used is written at most once a minute per key by this process.
_LAST_USED = LastUsed()


async def admit(
    rule: Rule,
    authorization: str | None,
    services: Services,
    path_params: Mapping[str, Any],
) -> Principal:
    """Who a request to a route with ``rule`` is, if the route lets it in; else
    :class:`Refused`. The one decision every route's request goes through."""
    if rule.scope is None:
        return ANONYMOUS
    settings = services.settings
    shut = (
        rule.door is Door.CLOSED
        or settings.require_keys
        or (rule.door is Door.API and bool(static_api_keys(settings)))
    )
    try:
        principal = await identify(authorization, services, _LAST_USED)
    except (RedisError, OSError) as exc:
        log.warning("cannot check a key: redis unavailable: %s", exc)
        raise Refused(503, "keys cannot be checked now: Redis is unreachable") from None
    if shut and not principal.known:
        if rule.scope != ASK and not admin_token(settings):
            raise Refused(401, "admin API disabled: set OPENBOOK_ADMIN_TOKEN")
        raise Refused(
            401,
            "missing or wrong key: send 'Authorization: Bearer <key>' with a key of this "
            "gateway (openbook keys create, OPENBOOK_GATEWAY_API_KEYS) or the admin token",
            "invalid_api_key",
        )
    if shut and not principal.can(rule.scope):
        raise Refused(
            403,
            f"key {principal.name!r} lacks the {rule.scope!r} scope this needs",
            "insufficient_scope",
        )
    index = path_params.get("index")
    if isinstance(index, str) and not principal.sees(index):
        raise Refused(404, principal.unknown_index(index))
    try:
        await key_limits.count_request(principal, services)
    except key_limits.Limited as limited:
        code = "rate_limit_exceeded" if limited.status == 429 else None
        raise Refused(limited.status, limited.message, code, limited.retry_after) from None
    return principal


async def check_access(request: Request) -> None:
    """The app's dependency (every FastAPI route's): :func:`admit`, the principal then in
    ``request.state``. A route open to all (the page, its static files, health) is let in
    before the services are looked up: serving a file needs no Redis or gRPC client."""
    route = request.scope.get("route")
    rule = rule_of(request.method, getattr(route, "path", ""))
    if rule.scope is None:
        request.state.principal = ANONYMOUS
        return
    services = await get_services(request)
    try:
        principal = await admit(
            rule, request.headers.get("authorization"), services, request.path_params
        )
    except Refused as refused:
        raise refused.exception(request.url.path) from None
    request.state.principal = principal


def require_scope(request: Request, scope: str, services: Services) -> Principal:
    """What an MCP tool that needs more than reaching ``/mcp`` asks: the request's principal
    if it has ``scope``, else :class:`Refused` (403; 401 with the admin API off)."""
    if not admin_token(services.settings):
        raise Refused(401, "write tools are disabled: the gateway has no OPENBOOK_ADMIN_TOKEN")
    principal = principal_of(request)
    if not principal.can(scope):
        who = f"key {principal.name!r}" if principal.known else "no key"
        raise Refused(
            403,
            f"this tool needs the {scope!r} scope ({who} presented): connect to /mcp with "
            "'Authorization: Bearer <key>' of a key with it, or the admin token",
        )
    return principal
