"""Start the generator: load the model, then serve it over gRPC."""

from __future__ import annotations

import logging

from openbook.checkpoint import latest_checkpoint
from openbook.config import Settings
from openbook.rag import RagGenerator
from openbook.serving.grpc_server import GrpcService
from openbook.serving.metrics import ServiceMetrics
from openbook.shared_state import publish_model_version, redis_client
from openbook.v1 import generator_pb2_grpc
from openbook_generator.servicer import GeneratorServicer, load_generator_checkpoint

log = logging.getLogger(__name__)


def load_initial_generator(settings: Settings) -> RagGenerator:
    """The latest trained checkpoint if there is a good one, else the configured base model."""
    device, dtype = settings.device or None, settings.dtype or None
    if settings.load_latest_checkpoint:
        try:
            if latest_checkpoint(settings.checkpoint_dir) is not None:
                return load_generator_checkpoint(settings.checkpoint_dir, device, dtype)
        except ValueError as exc:
            log.error("latest checkpoint refused, serving the base model instead: %s", exc)
    return RagGenerator.load(settings.generator_model, device=device, dtype=dtype)


def build(settings: Settings) -> tuple[GrpcService, GeneratorServicer]:
    generator = load_initial_generator(settings)
    redis = redis_client(settings.redis_url, settings.redis_timeout_s)
    log.info(
        "generator %s (%s) on %s/%s",
        generator.model_version,
        generator.model_type,
        generator.device,
        generator.dtype,
    )
    metrics = ServiceMetrics("generator")
    servicer = GeneratorServicer(
        generator,
        metrics=metrics,
        checkpoint_root=settings.checkpoint_dir,
        on_model=lambda version: publish_model_version(redis, "generator", version),
        max_batch_size=settings.max_batch_size,
        max_batch_wait_ms=settings.max_batch_wait_ms,
        max_queue=settings.max_queue,
    )
    service = GrpcService(
        "openbook.v1.Generator",
        settings.generator_host,
        settings.generator_port,
        lambda server: generator_pb2_grpc.add_GeneratorServicer_to_server(servicer, server),
        workers=settings.grpc_workers,
        metrics=metrics,
    )
    return service, servicer


def serve(settings: Settings) -> None:
    service, servicer = build(settings)
    service.metrics.serve_http(settings.generator_metrics_port)
    service.set_serving(True)
    try:
        service.run_until_signal()
    finally:
        servicer.close()
