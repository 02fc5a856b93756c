"""One way to run a gRPC service: health, error mapping, request ids, admin auth, graceful
stop, and a port that is bound before the (slow) model or index is loaded."""

from __future__ import annotations

import logging
import math
import signal
import threading
import time
from collections.abc import Callable, Collection, Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pydantic import SecretStr

from openbook.config.settings import GrpcServiceSettings
from openbook.errors import Unauthenticated, Unavailable, status_for
from openbook.observability.logs import request_id_var
from openbook.runtime.heap import freeze_loaded_heap
from openbook.security.auth import bearer_token, token_matches
from openbook.serving.batcher import NO_DEADLINE_S
from openbook.serving.handlers import wrap_handler
from openbook.serving.metrics import ServiceMetrics
from openbook.serving.reflection import enable_server_reflection
from openbook.serving.threads import in_passing_thread
from openbook.serving.tracing import server_interceptors, span_interceptors

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
AUTHORIZATION_HEADER = "authorization"
# The caller's deadline as wall-clock seconds since the epoch. gRPC carries a deadline as a
# duration that the server starts counting when it reads the call: a process starved of CPU (a
# quota, a busy node) reads calls late and would plan with time its caller no longer has.
DEADLINE_HEADER = "x-openbook-deadline"
# The whole time the caller gave the call, in seconds: what a request may take from its start.
# A service that reads the call late (the time went on the way: a starved process, a queue
# before it) tells "too large for its time" from "too late now" by it.
BUDGET_HEADER = "x-openbook-budget-s"

# Trailing metadata of a RESOURCE_EXHAUSTED answer: whole seconds until the request could be
# taken (openbook.errors.Overloaded.retry_after_s), which the gateway sends as Retry-After.
RETRY_AFTER_TRAILER = "retry-after"

RETRIEVER_SERVICE = "openbook.v1.Retriever"
GENERATOR_SERVICE = "openbook.v1.Generator"
# Every RPC that changes what a service serves or holds (proto/openbook/v1): only callers with
# OPENBOOK_ADMIN_TOKEN (the gateway's admin API, operators) may make them.
# tests/services/test_admin_auth.py fails when an RPC is added to the protos without being put
# here or declared read-only there.
ADMIN_RPCS: dict[str, frozenset[str]] = {
    RETRIEVER_SERVICE: frozenset(
        {
            "SwapIndex",
            "ReloadModel",
            "CreateIndex",
            "DeleteIndex",
            "PutDocuments",
            "DeleteDocument",
        }
    ),
    GENERATOR_SERVICE: frozenset({"ReloadModel"}),
}


def bind_deferred(
    service: str,
    name: str,
    settings: GrpcServiceSettings,
    add_servicer: Callable[[object, grpc.Server], None],
) -> tuple[GrpcService, DeferredServicer]:
    """``service``'s gRPC server bound on the settings' port, answering UNAVAILABLE until a
    servicer is attached to the returned :class:`DeferredServicer` (``add_servicer``: the
    generated ``add_*Servicer_to_server``)."""
    pending = DeferredServicer(name)
    bound = GrpcService(
        service,
        settings.host,
        settings.port,
        lambda server: add_servicer(pending, server),
        # A thread for every request waiting or running in a batch, so the queue can fill (and
        # answer RESOURCE_EXHAUSTED), plus grpc_workers for everything else.
        workers=settings.grpc_workers + settings.max_queue + settings.max_batch_size,
        metrics=ServiceMetrics(name),
        admin_methods=admin_methods(service),
        admin_token=settings.admin_token,
        max_concurrent_rpcs=settings.grpc_max_concurrent_rpcs,
        access_log=settings.access_log,
    )
    return bound, pending


def admin_methods(service: str) -> frozenset[str]:
    """Full gRPC method paths (``/openbook.v1.Retriever/SwapIndex``) of ``service``'s admin
    RPCs, as a server interceptor sees them."""
    return frozenset(f"/{service}/{rpc}" for rpc in ADMIN_RPCS[service])


def bearer_metadata(token: SecretStr | str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that authorizes an admin RPC (empty without a token)."""
    secret = _secret(token)
    return ((AUTHORIZATION_HEADER, f"Bearer {secret}"),) if secret else ()


def _secret(token: SecretStr | str | None) -> str:
    if isinstance(token, SecretStr):
        return token.get_secret_value()
    return token or ""


class AdminAuthInterceptor(grpc.ServerInterceptor):
    """Admin RPCs need ``authorization: Bearer <OPENBOOK_ADMIN_TOKEN>``; others pass untouched.

    Without a configured token admin RPCs are off, as the gateway's admin API is: an open
    SwapIndex on the network would let anyone change what the gateway serves. Refusals are
    UNAUTHENTICATED (raised as ``Unauthenticated`` so that ``ErrorInterceptor``, outside this
    one, counts and logs them like any other status). The token is checked as the gateway
    checks it (``openbook.security.auth``: exact, in constant time) and never logged.
    """

    def __init__(self, methods: Collection[str], token: SecretStr | str | None) -> None:
        self.methods = frozenset(methods)
        self._expected = _secret(token)

    def _refusal(self, handler_call_details) -> str | None:
        if not self._expected:
            return "admin RPCs are disabled: OPENBOOK_ADMIN_TOKEN is not set on this service"
        presented = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == AUTHORIZATION_HEADER:
                presented = value if isinstance(value, str) else value.decode("latin-1")
        token = bearer_token(presented)
        if token is None:
            return "admin RPC: missing 'authorization: Bearer <OPENBOOK_ADMIN_TOKEN>' metadata"
        if not token_matches(token, [self._expected]):
            return "admin RPC: wrong admin token"
        return None

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self.methods:
            return handler
        refusal = self._refusal(handler_call_details)
        if refusal is None:
            return handler

        def refuse(request, context):
            raise Unauthenticated(refusal)

        return grpc.unary_unary_rpc_method_handler(
            refuse,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class DeferredServicer:
    """Stands in for a servicer that is still loading, so the port can be bound first.

    Generated ``add_*Servicer_to_server`` functions read each RPC method once, at
    registration; every method read here dispatches at call time instead: to the real
    servicer once ``attach`` has given it, else UNAVAILABLE (the gateway's 503 with
    Retry-After), which tells a caller to come back rather than that the call was wrong.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._target: object | None = None

    def attach(self, servicer: object) -> None:
        self._target = servicer

    def __getattr__(self, rpc: str):
        if rpc.startswith("_"):
            raise AttributeError(rpc)

        def dispatch(request, context):
            target = self._target
            if target is None:
                raise Unavailable(f"{self._name} is starting: not serving yet")
            return getattr(target, rpc)(request, context)

        dispatch.__name__ = rpc
        return dispatch


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions into gRPC statuses with a readable message, never a stack trace.

    An error raised for a client's mistake (``openbook.errors``: each RPC validates its request
    at the top) answers its own status with its message; anything else, a ``ValueError`` from
    a library included, is a bug: INTERNAL, logged with its traceback on the server side only.
    Every call's status and latency go to ``metrics``; the request id from the caller's
    metadata is put in the log context, and with ``access_log`` every call but health checks
    is logged once (method, status, milliseconds) under that request id.
    """

    def __init__(self, metrics: ServiceMetrics | None = None, access_log: bool = False) -> None:
        self.metrics = metrics
        self.access_log = access_log

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        call = _ObservedCall(
            method, self.metrics, self.access_log and not method.startswith("/grpc.health.")
        )
        return wrap_handler(handler, call.observed)


class _ObservedCall:
    """Status mapping, metrics and the access log of one RPC method (``ErrorInterceptor``)."""

    def __init__(self, method: str, metrics: ServiceMetrics | None, access_log: bool) -> None:
        self.method = method
        self.short_method = method.rsplit("/", 1)[-1]
        self.metrics = metrics
        self.access_log = access_log

    @contextmanager
    def observed(self, context: grpc.ServicerContext) -> Iterator[None]:
        method, short_method = self.method, self.short_method
        metadata = dict(context.invocation_metadata() or ())
        token = request_id_var.set(metadata.get(REQUEST_ID_HEADER, ""))
        started = time.perf_counter()
        code = grpc.StatusCode.OK
        try:
            yield
        except grpc.RpcError:
            code = context.code() or grpc.StatusCode.UNKNOWN
            raise  # already aborted with a status by the servicer
        except GeneratorExit:
            code = grpc.StatusCode.CANCELLED  # a stream whose client went away
            raise
        except Exception as exc:  # noqa: BLE001 - the boundary: map every error to a status
            code = status_for(exc)
            if code == grpc.StatusCode.INTERNAL:
                log.exception("unhandled error in %s", method)
                message = f"internal error in {method}: {type(exc).__name__}: {exc}"
            else:
                log.info("%s: %s: %s", short_method, code.name, exc)
                message = str(exc)
            retry_after = getattr(exc, "retry_after_s", None)
            if retry_after is not None:
                wait_s = str(max(1, math.ceil(retry_after)))
                context.set_trailing_metadata(((RETRY_AFTER_TRAILER, wait_s),))
            context.abort(code, message)
        finally:
            seconds = time.perf_counter() - started
            if self.metrics is not None:
                self.metrics.observe_rpc(short_method, code.name, seconds)
            if self.access_log:
                log.info(
                    "rpc %s %s",
                    short_method,
                    code.name,
                    extra={
                        "fields": {
                            "rpc": short_method,
                            "code": code.name,
                            "ms": round(seconds * 1000, 2),
                        }
                    },
                )
            request_id_var.reset(token)


class GrpcService:
    """A gRPC server with the standard health service, built by ``add_servicers``.

    The port is bound here, and health answers NOT_SERVING until ``set_serving(True)``: a
    service binds first, then loads, so a restart never loses its port to a client socket
    while a model loads, and probes can tell "starting" from "gone".
    """

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        add_servicers: Callable[[grpc.Server], None],
        workers: int = 16,
        metrics: ServiceMetrics | None = None,
        max_concurrent_rpcs: int = 256,
        access_log: bool = True,
        admin_methods: Collection[str] = (),
        admin_token: SecretStr | str | None = None,
    ) -> None:
        """Services pass ``max_concurrent_rpcs`` (0: no limit) and ``access_log`` from their
        settings (:class:`openbook.config.settings.GrpcServiceSettings`). ``admin_methods`` (full
        method paths, see ``admin_methods()``) need ``admin_token``; without one they are
        refused."""
        self.name = name
        self.host = host
        self.metrics = metrics
        self.health = health.HealthServicer()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name),
            # Outermost first: the trace span (only with tracing on) holds the whole call and
            # records the status an error becomes, and inside ErrorInterceptor the exception
            # itself; auth refusals are counted and logged like every other status.
            interceptors=[
                *server_interceptors(),
                ErrorInterceptor(metrics, access_log),
                *span_interceptors(),
                AdminAuthInterceptor(admin_methods, admin_token),
            ],
            # Calls beyond this many (running + waiting for a worker) are refused at once with
            # RESOURCE_EXHAUSTED rather than queued without bound.
            maximum_concurrent_rpcs=max_concurrent_rpcs or None,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                # grpc shares a port between processes by default (SO_REUSEPORT): a second
                # service started on a taken port would silently get half the connections.
                # Fail to bind instead (and let the launcher retry with backoff).
                ("grpc.so_reuseport", 0),
            ],
        )
        add_servicers(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        # Server reflection (grpcurl, gRPC UIs), v1 and v1alpha: the service, health and
        # reflection itself, described from the generated stubs' descriptors, which
        # add_servicers imported.
        enable_server_reflection((name, health.SERVICE_NAME), self.server)
        # grpc's health servicer starts out SERVING for the server as a whole.
        self.set_serving(False)
        try:
            self.port = self.server.add_insecure_port(f"{host}:{port}")
        except RuntimeError:  # grpc >= 1.60 raises where older versions returned 0
            self.port = 0
        if self.port == 0:
            raise OSError(f"{name}: cannot bind {host}:{port} (in use, or not an address here)")

    def set_serving(self, serving: bool = True) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.health.set("", status)
        self.health.set(self.name, status)

    def start(self) -> None:
        self.server.start()
        log.info("%s listening on %s:%d", self.name, self.host, self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()

    def run_until_signal(
        self, load: Callable[[], None] | None = None, stop: threading.Event | None = None
    ) -> None:
        """Start (health: NOT_SERVING), run ``load`` (in a thread of its own) and freeze what it
        loaded (:mod:`openbook.runtime.heap`), then serve until SIGTERM/SIGINT (or ``stop`` is
        set), then drain in-flight requests.

        A signal while ``load`` runs ends the process at once: there is nothing to drain,
        and a large index can take minutes to load. Off the main thread (tests) no signal
        handlers are installed; ``stop`` ends the service.
        """
        stop = stop if stop is not None else threading.Event()
        loaded = threading.Event()
        if threading.current_thread() is threading.main_thread():

            def on_signal(signum, _frame) -> None:
                stop.set()
                if not loaded.is_set():
                    raise SystemExit(0)

            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, on_signal)
        self.start()
        try:
            if load is not None:
                # never torch work on the main thread (openbook/serving/threads.py)
                in_passing_thread(load)
                if threading.current_thread() is threading.main_thread():
                    # a service's own process (not a test's): no request pays for walking
                    # what loading made
                    freeze_loaded_heap()
            loaded.set()
            if not stop.is_set():
                self.set_serving(True)
                log.info("%s serving", self.name)
            stop.wait()
            log.info("%s stopping", self.name)
        finally:
            self.stop()


def check_health(addr: str, timeout_s: float = 2.0, service: str = "") -> bool:
    """True when the server at ``addr`` answers SERVING."""
    with grpc.insecure_channel(addr) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def deadline_metadata(timeout_s: float) -> tuple[tuple[str, str], ...]:
    """The metadata entries that tell a service when its caller stops waiting, and how long it
    gave the call in all."""
    return (
        (DEADLINE_HEADER, f"{time.time() + timeout_s:.3f}"),
        (BUDGET_HEADER, f"{timeout_s:.3f}"),
    )


def time_budget(context: grpc.ServicerContext) -> float | None:
    """The whole time the caller gave this call (:data:`BUDGET_HEADER`); None where it did not
    say (a client of our own gRPC API without it) or said something that is not a positive
    number."""
    for key, value in context.invocation_metadata() or ():
        if key != BUDGET_HEADER:
            continue
        try:
            budget = float(value)
        except ValueError:
            return None
        return budget if math.isfinite(budget) and budget > 0 else None
    return None


def time_remaining(context: grpc.ServicerContext) -> float | None:
    """Seconds the caller still waits: gRPC's deadline, or less when the caller's own
    wall-clock deadline (:data:`DEADLINE_HEADER`) says so. None: no deadline."""
    left = context.time_remaining()
    if left is not None and left > NO_DEADLINE_S:
        left = None
    for key, value in context.invocation_metadata() or ():
        if key != DEADLINE_HEADER:
            continue
        try:
            theirs = float(value) - time.time()
        except ValueError:
            return left  # not a number: gRPC's deadline alone
        if math.isfinite(theirs):
            left = max(0.0, theirs) if left is None else max(0.0, min(left, theirs))
    return left
