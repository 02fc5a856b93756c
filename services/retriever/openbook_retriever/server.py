"""Start the retriever: index registry, shared active-index state, gRPC server."""

from __future__ import annotations

import logging
import threading

from openbook.checkpoint import latest_checkpoint
from openbook.config import Settings
from openbook.index import load_encoder
from openbook.serving.grpc_server import GrpcService
from openbook.serving.metrics import ServiceMetrics
from openbook.shared_state import ActiveIndexStore, redis_client
from openbook.v1 import retriever_pb2_grpc
from openbook_retriever.registry import IndexRegistry
from openbook_retriever.servicer import RetrieverServicer

log = logging.getLogger(__name__)


def warm_up(servicer: RetrieverServicer) -> None:
    """Load the query encoder and run one search before reporting healthy, so the first
    real request does not pay for loading models."""
    with servicer.registry.lease() as index:
        servicer._search(index, ["warm-up"], 1, False)


def build(settings: Settings) -> tuple[GrpcService, RetrieverServicer, threading.Event]:
    registry = IndexRegistry(settings.index_root, max_loaded=settings.max_loaded_indexes)
    shared = ActiveIndexStore(redis_client(settings.redis_url, settings.redis_timeout_s))
    encoder = load_encoder(settings.query_encoder) if settings.query_encoder else None
    metrics = ServiceMetrics("retriever")
    servicer = RetrieverServicer(
        registry,
        shared,
        encoder,
        metrics,
        checkpoint_root=settings.checkpoint_dir,
        max_batch_size=settings.retriever_max_batch_size,
        max_batch_wait_ms=settings.retriever_max_batch_wait_ms,
        max_queue=settings.retriever_max_queue,
    )

    # The active index survives restarts and is agreed between replicas through Redis;
    # the configured default applies only when Redis knows none (or one that is gone).
    initial = shared.get()
    if not initial or initial not in registry.available():
        initial = settings.default_index or next(iter(registry.available()), None)
    if initial:
        try:
            registry.swap(initial)
            shared.set(initial)
        except Exception as exc:  # noqa: BLE001 - serve admin calls so a good index can be swapped in
            log.error("cannot load initial index %r: %s", initial, exc)
    else:
        log.warning("no index under %s yet: build one, then swap to it", settings.index_root)

    if settings.load_latest_checkpoint:
        try:
            if latest_checkpoint(settings.checkpoint_dir) is not None:
                servicer.use_checkpoint(settings.checkpoint_dir)
        except ValueError as exc:
            log.error("latest checkpoint refused, keeping the configured encoder: %s", exc)
    servicer.announce_model()
    if registry.active:
        warm_up(servicer)

    service = GrpcService(
        "openbook.v1.Retriever",
        settings.retriever_host,
        settings.retriever_port,
        lambda server: retriever_pb2_grpc.add_RetrieverServicer_to_server(servicer, server),
        workers=settings.grpc_workers,
        metrics=metrics,
    )
    servicer._record_active()
    stop = threading.Event()
    shared.watch(servicer.follow_shared_active, stop)
    return service, servicer, stop


def serve(settings: Settings) -> None:
    service, _, stop = build(settings)
    service.metrics.serve_http(settings.retriever_metrics_port)
    service.set_serving(True)
    try:
        service.run_until_signal()
    finally:
        stop.set()
