"""Start the retriever: bind the gRPC port, then load the index registry, the shared
active-index state and the query encoder, then serve.

The port is bound (health: NOT_SERVING, RPCs: UNAVAILABLE) before the index loads, which can
take minutes for a large one, so a restarting retriever holds its port from the first second.
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING

from openbook.errors import OpenbookError
from openbook.index import Encoder, load_encoder
from openbook.index.encoders import load_adapted_encoder
from openbook.index.engine import EngineKind
from openbook.index.loaded import open_index
from openbook.index.manifest import MANIFEST, IndexLoadError
from openbook.rag.adapters import AdapterMismatch
from openbook.runtime.compute_threads import ComputeThreadsOptions
from openbook.security.sealing import load_sealer
from openbook.serving.grpc_server import (
    RETRIEVER_SERVICE,
    DeferredServicer,
    GrpcService,
    bind_deferred,
)
from openbook.serving.metrics import ServiceMetrics
from openbook.state.shared_state import (
    ActiveIndexStore,
    ModelFollower,
    redis_client,
    replica_metrics,
)
from openbook.storage.checkpoint import checkpoint_in_root, latest_checkpoint, locate_in_root
from openbook.v1 import retriever_pb2_grpc
from openbook_retriever.documents import NewIndexDefaults
from openbook_retriever.registry import IndexRegistry, Registry
from openbook_retriever.servicer import RetrieverServicer
from openbook_retriever.settings import RetrieverSettings

if TYPE_CHECKING:
    from openbook.index.milvus_engine import MilvusEngine

log = logging.getLogger(__name__)


def warm_up(servicer: RetrieverServicer) -> None:
    """Load the query encoder and run one search before reporting healthy, so the first
    real request does not pay for loading models."""
    with servicer.registry.lease() as index:
        servicer._search(index, ["warm-up"], 1, False)


def configured_query_encoder(settings: RetrieverSettings) -> Encoder | None:
    """OPENBOOK_RETRIEVER_QUERY_ENCODER with OPENBOOK_RETRIEVER_QUERY_ENCODER_ADAPTER merged in
    (None: every index searches with its own). An adapter that is missing or that was trained
    on another encoder is skipped with a warning, as the generator's is: compose's default
    adapter belongs to the default encoder, and another deployment must still start."""
    base = settings.query_encoder or None
    adapter = settings.query_encoder_adapter
    if adapter is not None and not adapter.is_dir():
        log.warning(
            "query encoder adapter %s not found (run `openbook demo prepare`): serving %s",
            adapter,
            base or "the indexes' own query encoders",
        )
    elif adapter is not None:
        try:
            encoder = load_adapted_encoder(adapter, base)
        except AdapterMismatch as exc:
            log.warning("%s; serving %s", exc, base or "the indexes' own query encoders")
        else:
            log.info("query encoder adapter %s merged into %s", adapter, base or "its base")
            return encoder
    return load_encoder(base) if base else None


def bind(settings: RetrieverSettings) -> tuple[GrpcService, DeferredServicer]:
    """The gRPC server on its port, answering UNAVAILABLE until a servicer is attached."""
    return bind_deferred(
        RETRIEVER_SERVICE,
        "retriever",
        settings,
        retriever_pb2_grpc.add_RetrieverServicer_to_server,
    )


def open_registry(settings: RetrieverSettings) -> Registry:
    """The indexes of the configured engine (``OPENBOOK_INDEX_ENGINE``): directories under the
    index root, or the collections of the Milvus at ``OPENBOOK_MILVUS_URI`` (a local ``.db``
    path starts Milvus Lite in this process). A Milvus that cannot be reached at start is
    :class:`~openbook.errors.Unavailable`: the retriever does not start serving without it."""
    if settings.index_engine is EngineKind.FILES:
        return IndexRegistry(settings.index_root, max_loaded=settings.max_loaded_indexes)
    # why: pymilvus (and Milvus Lite) stay out of a retriever serving the files engine
    from openbook.index.milvus_engine import MilvusEngine
    from openbook_retriever.milvus_registry import MilvusRegistry

    engine = MilvusEngine(settings.milvus_uri, token=settings.milvus_token())
    log.info("serving the indexes of Milvus at %s", settings.milvus_uri)
    seed_default_index(engine, settings)
    return MilvusRegistry(engine, max_loaded=settings.max_loaded_indexes)


def seed_default_index(engine: MilvusEngine, settings: RetrieverSettings) -> None:
    """Copy the default index into Milvus from the index root where Milvus does not hold it
    (or holds a copy of it cut short, which is resumed): the demo index compose's ``init``
    builds as files, so a stack started with ``OPENBOOK_INDEX_ENGINE=milvus`` serves it from
    Milvus at once. Replicas starting together copy the same rows (upserts: nothing doubled).
    A copy that fails is logged; the retriever serves without it, as with any missing index."""
    name, source = settings.default_index, settings.index_root / settings.default_index
    if not name or not (source / MANIFEST).is_file():
        return
    try:
        if name in engine.names() and not engine.stats(name).get("copying"):
            return  # held already: Milvus's copy is the one served, never overwritten
        with open_index(source, verify=True, name=name) as index:
            log.info("copying the default index %s from %s into Milvus", name, source)
            copied = engine.copy_index(name, index)
        log.info("default index %s in Milvus: %d passages", name, len(copied.index))
    except (IndexLoadError, OpenbookError, OSError) as exc:
        log.error("default index %s not copied into Milvus: %s", name, exc)


def load(
    settings: RetrieverSettings, metrics: ServiceMetrics | None, stop: threading.Event
) -> RetrieverServicer:
    """Load the initial index, encoder and checkpoint (the slow part); follow the shared
    active index until ``stop`` is set."""
    registry = open_registry(settings)
    shared = ActiveIndexStore(
        redis_client(settings.redis_options()), load_sealer(settings.server_key_file)
    )
    encoder = configured_query_encoder(settings)
    servicer = RetrieverServicer(
        registry,
        shared,
        encoder,
        metrics,
        checkpoint_root=settings.checkpoint_dir,
        max_batch_size=settings.max_batch_size,
        max_batch_wait_ms=settings.max_batch_wait_ms,
        max_queue=settings.max_queue,
        compute_threads=ComputeThreadsOptions(setting=settings.compute_threads),
        compact_passages=settings.compact_passages,
        new_index=NewIndexDefaults(settings.new_index_encoder, settings.new_index_type),
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
        where = (
            settings.index_root
            if settings.index_engine is EngineKind.FILES
            else f"Milvus at {settings.milvus_uri}"
        )
        log.warning("no index in %s yet: build or copy one, then swap to it", where)

    if settings.load_latest_checkpoint:
        try:
            if latest_checkpoint(settings.checkpoint_dir) is not None:
                servicer.use_checkpoint(settings.checkpoint_dir)
        except ValueError as exc:
            log.error("latest checkpoint refused, keeping the configured encoder: %s", exc)
    servicer.announce_model()
    if registry.active:
        warm_up(servicer)

    servicer._record_active()
    servicer.notice_vanished_indexes()  # the first look: what is here now
    shared.watch(servicer.follow_shared_state, stop)
    follow_reloads(settings, servicer, metrics, stop)
    return servicer


def follow_reloads(
    settings: RetrieverSettings,
    servicer: RetrieverServicer,
    metrics: ServiceMetrics | None,
    stop: threading.Event,
) -> ModelFollower:
    """Converge to the desired model in Redis now (a replica started after a reload), then
    follow later reloads until ``stop`` is set: every replica, not only the one a gateway's
    ReloadModel reaches, loads the checkpoint (verified, confined to the checkpoint root)."""
    assert servicer.shared is not None  # load() gives the servicer the shared active index
    follower = ModelFollower(
        servicer.shared.client,
        "retriever",
        load=lambda requested: servicer.use_checkpoint(
            checkpoint_in_root(settings.checkpoint_dir, requested)
        ),
        resolve=lambda requested: locate_in_root(settings.checkpoint_dir, requested),
        version=lambda: servicer.model_version,
        on_state=replica_metrics(metrics),
        sealer=servicer.shared.sealer,
    )
    follower.sync()
    follower.start(stop)
    return follower


def build(settings: RetrieverSettings) -> tuple[GrpcService, RetrieverServicer, threading.Event]:
    """Bound and loaded, not started: for running in-process (tests, benchmarks). Set the
    returned event to stop following the shared active index."""
    service, pending = bind(settings)
    stop = threading.Event()
    servicer = load(settings, service.metrics, stop)
    pending.attach(servicer)
    return service, servicer, stop


def serve(settings: RetrieverSettings, stop: threading.Event | None = None) -> None:
    """Bind, answer health (NOT_SERVING) at once, load, then serve until a signal or ``stop``."""
    service, pending = bind(settings)
    assert service.metrics is not None  # bind() gives every service its metrics
    service.metrics.serve_http(settings.metrics_port, settings.host)
    stop = stop if stop is not None else threading.Event()
    following = threading.Event()

    def load_and_attach() -> None:
        pending.attach(load(settings, service.metrics, following))

    try:
        service.run_until_signal(load_and_attach, stop)
    finally:
        following.set()
