"""The HTTP front door: a thin router over the retriever and generator gRPC services.

Handlers orchestrate: request bodies arrive validated (``schemas``), the typed clients build
and send the protos (``clients``, ``retrieval``, ``mapping``), ``cache`` keys and stores
answers, ``metrics`` times and counts, ``replicas`` reloads models. Anything that fails
otherwise is a 500 naming the request id.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from collections.abc import AsyncGenerator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Header, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from openbook.auth import bearer_matches
from openbook.logs import request_id_var
from openbook.sealing import load_sealer
from openbook.v1 import generator_pb2
from openbook_gateway import openai_api
from openbook_gateway.answering import AnswerOut, TokenOut, answer_events, unless_disconnected
from openbook_gateway.bodies import JSONBodyRoute, readable
from openbook_gateway.cache import AnswerCache
from openbook_gateway.clients import GeneratorClient
from openbook_gateway.events import STREAMED, EventStream, sse
from openbook_gateway.mapping import indexes_response
from openbook_gateway.metrics import GatewayMetrics, ms_since
from openbook_gateway.openai_api import is_openai_path
from openbook_gateway.openai_schemas import OpenAIRequestError
from openbook_gateway.replicas import desired_model, list_replicas, outcome, reload_models
from openbook_gateway.retrieval import Retrieval
from openbook_gateway.schemas import (
    DEFAULT_K,
    AnswerRequest,
    AnswerResponse,
    IndexesResponse,
    ReloadModelRequest,
    ReloadModelResponse,
    ReplicasResponse,
    SwapIndexRequest,
    SwapIndexResponse,
)
from openbook_gateway.settings import GatewaySettings
from openbook_gateway.ui import router as ui_router

log = logging.getLogger(__name__)


# Generator model versions whose default k the gateway remembers (a reload adds one).
MAX_REMEMBERED_DEFAULTS = 16


class DefaultK:
    """The number of passages for a request that names none: the served generator's
    ``default_k`` (a RAG checkpoint's n_docs), else :data:`DEFAULT_K`.

    Read from the generator's Info RPC and remembered per generator model version; asked
    again when an answer comes from a version not seen before (a reload).
    """

    def __init__(self, generator: GeneratorClient, timeout_s: float) -> None:
        self.generator = generator
        self.timeout_s = timeout_s
        self.by_version: dict[str, int] = {}
        self.version: str | None = None  # the version the latest Info or answer came from

    async def get(self, request_id: str = "") -> int:
        if self.version is None or self.version not in self.by_version:
            try:
                info = await self.generator.call(
                    self.generator.stub.Info,
                    generator_pb2.InfoRequest(),
                    request_id,
                    timeout_s=self.timeout_s,
                )
            except HTTPException as exc:  # the answer's own call reports the generator's state
                log.warning("generator info unavailable, default k unknown: %s", exc.detail)
                return self.by_version.get(self.version or "", DEFAULT_K)
            self.remember(info.model_version, info.default_k or DEFAULT_K)
        return self.by_version[self.version]

    def remember(self, version: str, k: int) -> None:
        if len(self.by_version) >= MAX_REMEMBERED_DEFAULTS and version not in self.by_version:
            self.by_version.clear()
        self.by_version[version] = k
        self.version = version

    def seen(self, version: str) -> None:
        """An answer came from ``version``: a version not seen before is asked about next time."""
        self.version = version


# How much of a body over the limit the gateway reads and throws away before answering 413.
# Closing a connection with unread bytes in the socket makes the kernel send a TCP reset, and
# a client still writing its body then sees "connection reset" instead of the 413. Past this
# many bytes, resetting is cheaper than reading.
DRAIN_MAX_BYTES = 32 * 1024 * 1024


class BodySizeLimit:
    """Refuse request bodies over ``max_bytes`` with a 413 the client can read.

    A declared ``Content-Length`` over the limit is refused before the body reaches the app; a
    body streamed without one is cut off as soon as it passes the limit. Either way the rest
    of the body (up to ``drain_max_bytes``) is read and discarded first, so the answer is not
    lost to a connection reset; the connection is then closed.
    """

    def __init__(
        self, app: ASGIApp, max_bytes: int, drain_max_bytes: int = DRAIN_MAX_BYTES
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.drain_max_bytes = drain_max_bytes
        self.message = (
            f"request body larger than {max_bytes} bytes (OPENBOOK_GATEWAY_MAX_BODY_BYTES)"
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        declared = headers.get("content-length", "").strip()
        if declared.isdigit() and int(declared) > self.max_bytes:
            # A client that sent "Expect: 100-continue" waits for the go-ahead before sending
            # its body, and the server asks for it on the first receive(): answer without one.
            waiting = headers.get("expect", "").lower() == "100-continue"
            if not waiting and int(declared) <= self.drain_max_bytes:
                await self._drain(receive, 0)
            body = {"detail": self.message}
            if is_openai_path(scope["path"]):
                body = openai_api.error_body(413, self.message, code="request_too_large")
            response = JSONResponse(body, 413, headers={"Connection": "close"})
            await response(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    if message.get("more_body", False):
                        await self._drain(receive, received)
                    raise HTTPException(413, self.message, headers={"Connection": "close"})
            return message

        await self.app(scope, limited_receive, send)

    async def _drain(self, receive: Receive, received: int) -> None:
        """Read and discard the rest of the body, stopping past ``drain_max_bytes``."""
        while received <= self.drain_max_bytes:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            received += len(message.get("body", b""))
            if not message.get("more_body", False):
                return


class RequestContext:
    """Request id (the client's ``x-request-id`` or a new one) in the log context, in
    ``request.state`` and on the response; request count, and one access-log line.

    A plain ASGI middleware: no extra task per request, and the handler runs in this context,
    so everything it logs carries the request id. An unhandled error becomes a JSON 500 that
    names the request id, never a stack trace.
    """

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, access_log: bool) -> None:
        self.app = app
        self.metrics = metrics
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = Headers(scope=scope).get("x-request-id", "")
        if not (0 < len(request_id) <= 128 and request_id.isascii() and request_id.isprintable()):
            request_id = uuid.uuid4().hex  # it goes into logs and gRPC metadata: keep it sane
        scope.setdefault("state", {})["request_id"] = request_id
        token = request_id_var.set(request_id)
        started = time.perf_counter()
        status = 500
        response_started = False

        async def send_with_id(message: Message) -> None:
            nonlocal status, response_started
            if message["type"] == "http.response.start":
                status, response_started = message["status"], True
                headers = [(k, v) for k, v in message.get("headers", []) if k != b"x-request-id"]
                message = {**message, "headers": [*headers, (b"x-request-id", request_id.encode())]}
            await send(message)

        try:
            try:
                await self.app(scope, receive, send_with_id)
            except Exception:  # noqa: BLE001 - never leak a stack trace to the client
                log.exception("unhandled error")
                if response_started:
                    raise
                body = {"detail": "internal error", "request_id": request_id}
                if is_openai_path(scope["path"]):
                    body = openai_api.error_body(500, f"internal error (request {request_id})")
                await JSONResponse(body, 500)(scope, receive, send_with_id)
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, status).inc()
            if self.access_log:
                # Never the headers: the Authorization header carries the admin token.
                method = scope["method"]
                log.info(
                    "http %s %s %d",
                    method,
                    route,
                    status,
                    extra={
                        "fields": {
                            "method": method,
                            "route": route,
                            "status": status,
                            "ms": ms_since(started),
                        }
                    },
                )
        finally:
            request_id_var.reset(token)


class AsciiJSONResponse(JSONResponse):
    """JSON that renders whatever a client sent (echoed back in a 422): non-ASCII is escaped,
    so even lone surrogates, which UTF-8 cannot encode, come out; NaN and ±Infinity (which
    Python's json reads, and 1e400 as inf) come out as the strings "NaN", "Infinity" and
    "-Infinity", since strict JSON has no such numbers."""

    def render(self, content) -> bytes:
        try:
            text = json.dumps(content, allow_nan=False, separators=(",", ":"))
        except ValueError:
            text = json.dumps(_finite(content), allow_nan=False, separators=(",", ":"))
        return text.encode("ascii")


def _finite(value):
    """``value`` with every non-finite float replaced by its JSON-ish name."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def _require_admin(settings: GatewaySettings):
    async def check(authorization: str | None = Header(default=None)) -> None:
        expected = settings.admin_token.get_secret_value() if settings.admin_token else ""
        if not expected:
            raise HTTPException(401, "admin API disabled: set OPENBOOK_ADMIN_TOKEN")
        if not bearer_matches(authorization, [expected]):
            raise HTTPException(
                401, "missing or wrong admin token", headers={"WWW-Authenticate": "Bearer"}
            )

    return check


def create_app(settings: GatewaySettings | None = None) -> FastAPI:
    settings = settings or GatewaySettings()
    metrics = GatewayMetrics()
    # Read before serving: a password or key file that cannot be read stops the start with
    # an error naming it, never a gateway running without them.
    redis_options = settings.redis_options()
    sealer = load_sealer(settings.server_key_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if settings.access_log:
            # RequestContext logs every request (route, status, ms, request id): uvicorn's own
            # access line would only repeat it.
            logging.getLogger("uvicorn.access").setLevel(logging.WARNING)
        # The admin token is forwarded on the admin RPCs, which the services refuse without it.
        app.state.retrieval = Retrieval(
            settings.retriever_addr,
            settings.retrieve_timeout_s,
            settings.health_timeout_s,
            admin_token=settings.admin_token,
        )
        app.state.generator = GeneratorClient(
            settings.generator_addr,
            settings.generate_timeout_s,
            settings.health_timeout_s,
            admin_token=settings.admin_token,
        )
        app.state.cache = AnswerCache(redis_options, settings.cache_ttl_s, sealer)
        app.state.default_k = DefaultK(app.state.generator, settings.health_timeout_s)
        yield
        await app.state.retrieval.close()
        await app.state.generator.close()
        await app.state.cache.close()

    app = FastAPI(
        title="openbook",
        version="0.1.0",
        description="Retrieval-Augmented Generation (Lewis et al., 2020) as a service.",
        lifespan=lifespan,
    )
    app.state.metrics = metrics  # the server counts the refusals of request heads in it
    # the abstention threshold of requests that name none (openbook_gateway.answering)
    app.state.min_confidence = settings.min_confidence
    # Every body is read as JSON, and every way it can fail to be JSON is a 422 (bodies.py).
    app.router.route_class = JSONBodyRoute
    require_admin = _require_admin(settings)
    app.include_router(ui_router)
    app.include_router(openai_api.openai_router(settings, metrics))
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = readable(exc.errors())
        if is_openai_path(request.url.path):
            return openai_api.validation_error_response(errors)
        try:
            return AsciiJSONResponse({"detail": jsonable_encoder(errors)}, 422)
        except RecursionError:
            # JSON nested nearly as deep as the parser allows cannot be echoed back from down
            # here: name the field and the problem, without the input.
            shallow = [
                {key: err[key] for key in ("type", "loc", "msg") if key in err} for err in errors
            ]
            return AsciiJSONResponse({"detail": jsonable_encoder(shallow)}, 422)

    @app.exception_handler(OpenAIRequestError)
    async def openai_request_error(request: Request, exc: OpenAIRequestError) -> JSONResponse:
        return openai_api.error_response(exc.status, exc, exc.param, exc.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if is_openai_path(request.url.path):
            headers = getattr(exc, "headers", None)
            return openai_api.error_response(exc.status_code, exc.detail, headers=headers)
        if exc.status_code < 500:
            return await http_exception_handler(request, exc)
        # A failure (here or in a service): its request id finds it in the logs.
        body = {"detail": exc.detail, "request_id": getattr(request.state, "request_id", "")}
        return JSONResponse(body, exc.status_code, headers=exc.headers)

    # Outermost (added last): every response, a 413 from BodySizeLimit too, gets a request id.
    app.add_middleware(RequestContext, metrics=metrics, access_log=settings.access_log)

    @app.get("/healthz")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request, response: Response) -> dict:
        state = request.app.state
        shards = await state.retrieval.shard_health()
        services = {
            "retriever": all(shards.values()),
            "generator": await state.generator.healthy(),
        }
        redis_ok = await state.cache.ping()
        ready = all(services.values())
        if not ready:
            response.status_code = 503
        # Redis only caches and coordinates: without it the system still answers.
        body = {"ready": ready, "services": services, "redis": redis_ok}
        if len(shards) > 1:  # sharded: which shard is down
            body["retriever_shards"] = shards
        if redis_ok:
            try:
                listed = await list_replicas(state.cache.client)
            except (RedisError, OSError):
                listed = []
            if listed:  # the replicas that follow shared reloads, and the version each serves
                body["replicas"] = [
                    {key: r.get(key, "") for key in ("service", "replica", "version", "state")}
                    for r in listed
                ]
        return body

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/answer", response_model=AnswerResponse, responses=STREAMED)
    async def answer(body: AnswerRequest, request: Request) -> Response:
        """The answer, or with ``"stream": true`` Server-Sent Events: ``token`` events as it is
        written, then an ``answer`` event with the same body (an ``error`` event if it fails
        after the stream began; before that, the usual HTTP error)."""
        events = answer_events(body, request, metrics, stream=body.stream)
        if not body.stream:
            async for event in events:
                if isinstance(event, AnswerOut):
                    return JSONResponse(event.body)
            raise HTTPException(502, "no answer")  # answer_events always ends with one
        # The first event waits for retrieval and the prompt's prefill: errors until then are
        # plain HTTP errors.
        first = await unless_disconnected(request, anext(events))
        stream = _answer_sse(first, events, request.state.request_id)
        return EventStream(stream, on_end=lambda outcome: metrics.stream_ended("answer", outcome))

    @app.get("/indexes", response_model=IndexesResponse)
    async def indexes(request: Request) -> dict:
        listed = await request.app.state.retrieval.list_indexes(request.state.request_id)
        return indexes_response(listed)

    @app.post(
        "/admin/swap-index", response_model=SwapIndexResponse, dependencies=[Depends(require_admin)]
    )
    async def swap_index(body: SwapIndexRequest, request: Request) -> dict:
        state = request.app.state
        # Loading a large index can take a while; it must not be cut by the query deadline.
        previous, active = await state.retrieval.swap(
            body.index, request.state.request_id, timeout_s=max(settings.retrieve_timeout_s, 600.0)
        )
        state.cache.swapped(active)
        log.info("index swapped %s -> %s", previous, active)
        return {"previous": previous or None, "active": active}

    @app.post(
        "/admin/reload-model",
        response_model=ReloadModelResponse,
        dependencies=[Depends(require_admin)],
    )
    async def reload_model(body: ReloadModelRequest, request: Request) -> dict:
        """Load a trained checkpoint into the retriever (query encoder) and the generator.

        Each service verifies the checkpoint before switching and keeps its current model if
        it is refused; if one service refuses it, the other is put back on the model it served
        (``rolled_back``). In-flight requests finish on the model they started with.
        """
        state = request.app.state
        status, result = await reload_models(
            state.retrieval,
            state.generator,
            state.cache.client,
            body.checkpoint or "",
            request.state.request_id,
            timeout_s=max(settings.generate_timeout_s, 600.0),
            wait_s=settings.reload_wait_s,
        )
        return result if status == 200 else JSONResponse(jsonable_encoder(result), status)

    @app.get(
        "/admin/replicas", response_model=ReplicasResponse, dependencies=[Depends(require_admin)]
    )
    async def replicas(request: Request) -> dict:
        """Every live retriever and generator replica: the model version it serves and how the
        latest reload went; and the desired model recorded in Redis."""
        client = request.app.state.cache.client
        try:
            desired = await desired_model(client)
            listed = await list_replicas(client)
        except (RedisError, OSError) as exc:
            raise HTTPException(503, f"redis unavailable: replicas unknown: {exc}") from None
        request_id = desired.get("id", "")
        return {
            "desired": desired,
            "replicas": [outcome(r, request_id) if request_id else r for r in listed],
        }

    return app


async def _answer_sse(
    first: TokenOut | AnswerOut,
    events: AsyncGenerator[TokenOut | AnswerOut, None],
    request_id: str,
) -> AsyncGenerator[bytes, None]:
    """``/answer``'s Server-Sent Events (docs/api.md): ``token``, then ``answer`` or ``error``."""
    try:
        event = first
        while True:
            if isinstance(event, AnswerOut):
                yield sse(event.body, "answer")
                return
            yield sse(event.body(), "token")
            event = await anext(events)
    except HTTPException as exc:
        yield sse(_error(exc.status_code, exc.detail, request_id), "error")
    except StopAsyncIteration:
        yield sse(_error(502, "the answer ended without a final event", request_id), "error")
    except Exception:  # noqa: BLE001 - the stream has begun: end it with an error event
        log.exception("answer stream failed")
        yield sse(_error(500, "internal error", request_id), "error")
    finally:
        await events.aclose()


def _error(status: int, detail: object, request_id: str) -> dict:
    """An error event's body: as an HTTP error's, with the request id of a failure."""
    body = {"status": status, "detail": detail}
    return {**body, "request_id": request_id} if status >= 500 else body
