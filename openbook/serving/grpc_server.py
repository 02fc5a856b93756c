"""One way to run a gRPC service: health, error mapping, request ids, graceful stop."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from openbook.errors import status_for
from openbook.logs import request_id_var
from openbook.serving.metrics import ServiceMetrics

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"


class ErrorInterceptor(grpc.ServerInterceptor):
    """Turns exceptions into gRPC statuses with a readable message, never a stack trace.

    Bad input (``ValueError``) becomes INVALID_ARGUMENT with the library's message; anything
    unexpected becomes INTERNAL and is logged with its traceback on the server side only.
    Every call's status and latency go to ``metrics``; the request id from the caller's
    metadata is put in the log context, and with ``access_log`` every call but health checks
    is logged once (method, status, milliseconds) under that request id.
    """

    def __init__(self, metrics: ServiceMetrics | None = None, access_log: bool = False) -> None:
        self.metrics = metrics
        self.access_log = access_log

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method
        short_method = method.rsplit("/", 1)[-1]
        metrics = self.metrics
        access_log = self.access_log and not method.startswith("/grpc.health.")

        def wrapped(request, context: grpc.ServicerContext):
            metadata = dict(context.invocation_metadata() or ())
            token = request_id_var.set(metadata.get(REQUEST_ID_HEADER, ""))
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            try:
                return inner(request, context)
            except grpc.RpcError:
                code = context.code() or grpc.StatusCode.UNKNOWN
                raise  # already aborted with a status by the servicer
            except Exception as exc:  # noqa: BLE001 - the boundary: map every error to a status
                code = status_for(exc)
                if code == grpc.StatusCode.INTERNAL:
                    log.exception("unhandled error in %s", method)
                    message = f"internal error in {method}: {type(exc).__name__}: {exc}"
                else:
                    log.info("%s: %s: %s", short_method, code.name, exc)
                    message = str(exc)
                context.abort(code, message)
            finally:
                seconds = time.perf_counter() - started
                if metrics is not None:
                    metrics.observe_rpc(short_method, code.name, seconds)
                if access_log:
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

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


class GrpcService:
    """A gRPC server with the standard health service, built by ``add_servicers``."""

    def __init__(
        self,
        name: str,
        host: str,
        port: int,
        add_servicers: Callable[[grpc.Server], None],
        workers: int = 16,
        metrics: ServiceMetrics | None = None,
        max_concurrent_rpcs: int | None = None,
        access_log: bool | None = None,
    ) -> None:
        """``max_concurrent_rpcs`` and ``access_log`` default to the settings
        OPENBOOK_GRPC_MAX_CONCURRENT_RPCS and OPENBOOK_ACCESS_LOG."""
        if max_concurrent_rpcs is None or access_log is None:
            from openbook.config import get_settings

            settings = get_settings()
            if max_concurrent_rpcs is None:
                max_concurrent_rpcs = settings.grpc_max_concurrent_rpcs
            if access_log is None:
                access_log = settings.access_log
        self.name = name
        self.metrics = metrics
        self.health = health.HealthServicer()
        self.server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name),
            interceptors=[ErrorInterceptor(metrics, access_log)],
            # Calls beyond this many (running + waiting for a worker) are refused at once with
            # RESOURCE_EXHAUSTED rather than queued without bound.
            maximum_concurrent_rpcs=max_concurrent_rpcs or None,
            options=[
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
            ],
        )
        add_servicers(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"{name}: cannot bind {host}:{port}")

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
        log.info("%s listening on port %d", self.name, self.port)

    def stop(self, grace_s: float = 5.0) -> None:
        self.set_serving(False)
        self.server.stop(grace_s).wait()

    def run_until_signal(self) -> None:
        """Serve until SIGTERM/SIGINT, then drain in-flight requests."""
        stopped = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stopped.set())
        self.start()
        stopped.wait()
        log.info("%s stopping", self.name)
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
