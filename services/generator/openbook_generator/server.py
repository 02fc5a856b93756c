"""Start the generator: bind the gRPC port, load the model, then serve it.

The port is bound (health: NOT_SERVING, RPCs: UNAVAILABLE) before the model loads, so a
restarting generator holds its port from the first second and probes see it starting.
"""

from __future__ import annotations

import logging
import threading

from openbook.rag import RagGenerator
from openbook.rag.adapters import AdapterMismatch
from openbook.rag.checkpoint import load_generator
from openbook.rag.packed_weights import Packing
from openbook.runtime.compute_threads import ComputeThreadsOptions
from openbook.security.sealing import load_sealer
from openbook.serving import allocator
from openbook.serving.grpc_server import (
    GENERATOR_SERVICE,
    DeferredServicer,
    GrpcService,
    bind_deferred,
)
from openbook.serving.metrics import ServiceMetrics
from openbook.state.shared_state import (
    ModelFollower,
    publish_model_version,
    redis_client,
    replica_metrics,
)
from openbook.storage.checkpoint import latest_checkpoint, locate_in_root
from openbook.v1 import generator_pb2_grpc
from openbook_generator.model_setup import ModelSetup
from openbook_generator.scheduler import SchedulingOptions
from openbook_generator.servicer import GeneratorServicer
from openbook_generator.settings import GeneratorSettings

log = logging.getLogger(__name__)


def load_initial_generator(settings: GeneratorSettings) -> RagGenerator:
    """The latest trained checkpoint if there is a good one, else the configured model (with
    its adapter merged in, when one is configured)."""
    device, dtype = settings.device or None, settings.dtype or None
    if settings.load_latest_checkpoint:
        try:
            if latest_checkpoint(settings.checkpoint_dir) is not None:
                return load_generator(
                    settings.checkpoint_dir, device=device, dtype=dtype, base=settings.model
                )
        except ValueError as exc:
            log.error("latest checkpoint refused, serving the base model instead: %s", exc)
    generator = RagGenerator.load(settings.model, device=device, dtype=dtype)
    adapter = settings.adapter
    if adapter is not None and not adapter.is_dir():
        log.warning(
            "adapter %s not found (run `openbook demo prepare`): serving %s alone",
            adapter,
            settings.model,
        )
    elif adapter is not None:
        try:
            generator.apply_adapter(adapter, settings.model)
        except AdapterMismatch as exc:
            # compose's default adapter is the default model's: another model serves alone
            log.warning("%s; serving %s alone", exc, settings.model)
            return generator
        generator.model_version = f"{generator.model_version}+{adapter.name}"
        log.info("adapter %s merged into %s", adapter, settings.model)
    return generator


def bind(settings: GeneratorSettings) -> tuple[GrpcService, DeferredServicer]:
    """The gRPC server on its port, answering UNAVAILABLE until a servicer is attached."""
    return bind_deferred(
        GENERATOR_SERVICE,
        "generator",
        settings,
        generator_pb2_grpc.add_GeneratorServicer_to_server,
    )


def load(settings: GeneratorSettings, metrics: ServiceMetrics | None) -> GeneratorServicer:
    """Load the model (the slow part) and the servicer around it."""
    generator = load_initial_generator(settings)
    allocator.release()  # what loading freed (float32 copies, file buffers) leaves with it
    redis = redis_client(settings.redis_options())
    log.info(
        "generator %s (%s) on %s/%s",
        generator.model_version,
        generator.model_type,
        generator.device,
        generator.dtype,
    )
    servicer = GeneratorServicer(
        generator,
        metrics=metrics,
        checkpoint_root=settings.checkpoint_dir,
        base_model=settings.model,
        on_model=lambda version: publish_model_version(
            redis, "generator", version, load_sealer(settings.server_key_file)
        ),
        scheduling=SchedulingOptions(
            max_batch_size=settings.max_batch_size,
            max_wait_ms=settings.max_batch_wait_ms,
            max_queue=settings.max_queue,
            solo_rows=settings.solo_rows,
            chunk_tokens=settings.prefill_chunk_tokens,
        ),
        memory_budget_bytes=settings.memory_mb * 2**20,
        model_setup=ModelSetup(
            passage_cache_bytes=settings.passage_cache_mb * 2**20,
            draft_tokens=settings.draft_tokens,
            int8_head=settings.lm_head == "int8",
            packed_weights=Packing(settings.packed_weights),
        ),
        max_request_s=settings.max_request_s,
        compute_threads=ComputeThreadsOptions(setting=settings.compute_threads),
    )
    # the speed admission plans with, measured before the first request (and warm kernels)
    servicer.scheduler.calibrate(servicer.generator)
    follow_reloads(settings, servicer, redis, metrics)
    return servicer


def follow_reloads(
    settings: GeneratorSettings, servicer: GeneratorServicer, redis, metrics: ServiceMetrics | None
) -> ModelFollower:
    """Converge to the desired model in Redis now (a replica started after a reload), then
    follow later reloads until the servicer is closed."""
    follower = ModelFollower(
        redis,
        "generator",
        load=servicer.load_checkpoint,
        resolve=lambda requested: locate_in_root(settings.checkpoint_dir, requested),
        version=lambda: servicer.generator.model_version,
        on_state=replica_metrics(metrics),
        sealer=load_sealer(settings.server_key_file),
    )
    follower.sync()
    follower.start(servicer.stop_following)
    servicer.follower = follower
    return follower


def build(settings: GeneratorSettings) -> tuple[GrpcService, GeneratorServicer]:
    """Bound and loaded, not started: for running in-process (tests, benchmarks)."""
    service, pending = bind(settings)
    servicer = load(settings, service.metrics)
    pending.attach(servicer)
    return service, servicer


def serve(settings: GeneratorSettings, stop: threading.Event | None = None) -> None:
    """Bind, answer health (NOT_SERVING) at once, load, then serve until a signal or ``stop``."""
    allocator.configure()  # before the model loads (openbook/serving/allocator.py)
    service, pending = bind(settings)
    assert service.metrics is not None  # bind() gives every service its metrics
    service.metrics.serve_http(settings.metrics_port, settings.host)
    loaded: list[GeneratorServicer] = []

    def load_and_attach() -> None:
        loaded.append(load(settings, service.metrics))
        pending.attach(loaded[0])

    try:
        service.run_until_signal(load_and_attach, stop)
    finally:
        for servicer in loaded:
            servicer.close()
