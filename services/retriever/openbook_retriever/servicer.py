"""gRPC handlers of the retriever: validation, batching, translation to and from protobuf.

Concurrent ``Retrieve`` calls are batched (``openbook.serving.batcher``): each call leases its
index, then queues its queries; the batch worker serves the calls on the same index, encoder and
retrieval mode together (dense and hybrid: one query-encoder forward pass) with one search per
distinct ``(k, return_vectors)``. Each call still gets its own result or its own error, and
holds its lease until its result is back, so a swap never closes an index under a queued call.

Each RPC checks its proto request once, at the top, against ``openbook.validation.limits`` (the
limits the gateway enforces too): ``Retrieve`` turns it into a :class:`ValidRetrieveRequest`
(the index it names, and the :class:`~openbook.index.request.SearchRequest` it asks for, built
here once) that everything behind it trusts, the documents RPCs into the typed requests of
:mod:`openbook_retriever.documents`. Anything else that fails is a bug here, and answers
INTERNAL.

GetDocument and ListDocuments answer on a built index too, from its passages grouped as its
adoption would group them (``openbook.index.built_documents``): a read adopts nothing.

Document writes run on the gRPC worker thread that took the call (never the batch thread, so
searches go on), and return once their log record is fsynced: the reply's ``version`` and
every later ``Retrieve`` include the write. ``RetrieveResponse.index_version`` is the version
of the live index when the search started: the passages reflect at least that version (0 for
a built index, which takes no writes until adopted).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openbook.errors import (
    FailedPrecondition,
    InternalError,
    InvalidArgument,
    NotFound,
    client_errors,
)
from openbook.index import Encoder, IndexLoadError
from openbook.index.built_documents import built_document, built_document_page
from openbook.index.checkpoint import load_query_encoder
from openbook.index.empty_base import template_for, template_of
from openbook.index.encoders import DEFAULT_ENCODER, load_encoder
from openbook.index.engine import (
    DocumentIndex,
    RetrievalMode,
    SearchableIndex,
    as_document_index,
)
from openbook.index.live import WriteResult
from openbook.index.loaded import LoadedIndex
from openbook.index.pairing import (
    QueryEncoderOverride,
    checkpoint_override,
    configured_override,
)
from openbook.index.request import SearchRequest
from openbook.index.spec import IndexSpec
from openbook.observability import telemetry
from openbook.runtime.compute_threads import ComputeThreads, ComputeThreadsOptions
from openbook.serving.batcher import Batcher
from openbook.serving.grpc_server import time_remaining
from openbook.serving.metrics import ServiceMetrics
from openbook.state.shared_state import (
    ActiveIndexStore,
    index_renewed,
    index_vanished,
    publish_index_version,
    publish_model_version,
)
from openbook.storage.artifacts import public_name
from openbook.storage.checkpoint import CheckpointError, checkpoint_in_root, open_checkpoint
from openbook.types import Passage
from openbook.v1 import common_pb2, retriever_pb2, retriever_pb2_grpc
from openbook.validation.limits import (
    MAX_K,
    MAX_QUERIES,
    check_index_name,
    check_question,
    check_range,
    check_retrieval,
    check_retrieval_views,
)
from openbook.validation.metadata_filter import parse_filter_json
from openbook_retriever.compactor import BackgroundCompactor
from openbook_retriever.documents import (
    NewIndexDefaults,
    document_to_proto,
    validate_create_index,
    validate_document_ref,
    validate_list_documents,
    validate_put_documents,
)
from openbook_retriever.registry import Registry

log = logging.getLogger(__name__)

# An index or a checkpoint that a request named and that cannot be loaded (corrupt, missing
# files, mismatched): refused, and the current one keeps serving.
client_errors(CheckpointError, IndexLoadError)


def passage_to_proto(p: Passage, with_vector: bool, page: int = 0) -> common_pb2.Passage:
    msg = common_pb2.Passage(id=p.id, title=p.title, text=p.text, score=float(p.score), page=page)
    if with_vector and p.vector is not None:
        msg.vector.extend(p.vector.tolist())
    return msg


@dataclass(frozen=True)
class ValidRetrieveRequest:
    """A ``RetrieveRequest`` checked against ``openbook.validation.limits``: what the servicer
    works on."""

    search: SearchRequest  # the search it asks for (retrieval None: the index's default)
    index: str | None  # None: the active index


def _checked_queries(given: Sequence[str]) -> tuple[str, ...]:
    """A request's ``queries``: one to :data:`MAX_QUERIES`, each a question by
    ``openbook.validation.limits``' rule; :class:`InvalidArgument` naming the first bad one."""
    if not given:
        raise InvalidArgument("queries: at least one query is required")
    if len(given) > MAX_QUERIES:
        raise InvalidArgument(f"queries: at most {MAX_QUERIES} per request, got {len(given)}")
    return tuple(check_question(f"queries[{i}]", q) for i, q in enumerate(given))


def validate_retrieve(request: retriever_pb2.RetrieveRequest) -> ValidRetrieveRequest:
    """The request, checked once; raises :class:`InvalidArgument` naming the first bad field."""
    queries = _checked_queries(request.queries)
    k = check_range("k", request.k, 1, MAX_K)
    index = check_index_name("index", request.index) if request.index else None
    retrieval = request.retrieval
    search = SearchRequest(
        queries,
        k=k,
        retrieval=RetrievalMode(check_retrieval("retrieval", retrieval)) if retrieval else None,
        where=parse_filter_json(request.filter_json, "filter"),
        return_vectors=request.return_vectors,
    )
    return ValidRetrieveRequest(search, index)


def validate_embed(
    request: retriever_pb2.EmbedQueriesRequest,
) -> tuple[tuple[str, ...], str | None]:
    """An ``EmbedQueriesRequest`` checked as ``Retrieve`` checks its queries: the queries and
    the index (None: the active one); :class:`InvalidArgument` naming the first bad field."""
    queries = _checked_queries(request.queries)
    index = check_index_name("index", request.index) if request.index else None
    return queries, index


def resolved_on(search: SearchRequest, index: SearchableIndex) -> SearchRequest:
    """``search`` with the retrieval mode that serves it on ``index``: the request's, else the
    index's default; :class:`InvalidArgument` naming ``retrieval`` (or ``return_vectors``) when
    the index cannot serve it as asked. Checked here, before the batch: the index's own
    ValueError for a missing view would otherwise come back as INTERNAL."""
    mode = check_retrieval_views(
        "retrieval", search.retrieval or index.default_retrieval, index.name, index.views
    )
    if search.return_vectors and mode == "bm25":
        why = (
            f"index {index.name!r} is bm25 and stores no vectors"
            if "dense" not in index.views
            else "retrieval 'bm25' returns no vectors (ask for 'dense' or 'hybrid')"
        )
        raise InvalidArgument(f"return_vectors: {why}")
    return dataclasses.replace(search, retrieval=RetrievalMode(mode))


class PairingError(FailedPrecondition, ValueError):
    """No query encoder of the right lineage and dimension for an index (FAILED_PRECONDITION;
    a ValueError, so callers that refuse bad checkpoints refuse these too)."""


@dataclass
class _Search:
    """One Retrieve call waiting to be batched: ``request`` in the mode :func:`resolved_on`
    gave it on ``index`` (calls are batched per mode only)."""

    index: SearchableIndex
    encoder: Encoder | None  # None: the index's own query encoder (or none: bm25)
    request: SearchRequest

    @property
    def mode(self) -> RetrievalMode:
        mode = self.request.retrieval
        if mode is None:
            raise InternalError("a batched search without its resolved retrieval mode")
        return mode


def search_batch(items: list[_Search]) -> list[list[list[Passage]] | Exception]:
    """Results (or an error) per item. Queries on one index, encoder and retrieval mode are
    searched together: dense and hybrid share one forward pass of the query encoder (the
    item's: the override where it pairs with the index, else the index's own), then each
    distinct ``(k, return_vectors, filter)`` is one search (one :class:`SearchRequest` of the
    texts and, dense and hybrid, their query vectors); bm25 reads the texts only."""
    results: list[list[list[Passage]] | Exception | None] = [None] * len(items)
    groups: dict[tuple[int, int, RetrievalMode], list[int]] = {}
    for i, item in enumerate(items):
        groups.setdefault((id(item.index), id(item.encoder), item.mode), []).append(i)
    for members in groups.values():
        first = items[members[0]]
        index, encoder, mode = first.index, first.encoder, first.mode
        try:
            vectors = None
            if mode is not RetrievalMode.BM25:
                encoder = encoder if encoder is not None else index.query_encoder
                index.check_encoder(encoder)
                vectors = encoder.encode([q for i in members for q in items[i].request.queries])
        except Exception as exc:  # noqa: BLE001 - fails this group only
            for i in members:
                results[i] = exc
            continue
        offsets, at = {}, 0
        for i in members:
            offsets[i] = at
            at += items[i].request.n
        searches: dict[tuple[int, bool, str], list[int]] = {}
        for i in members:
            r = items[i].request
            key = (r.k, r.return_vectors, r.where.canonical() if r.where else "")
            searches.setdefault(key, []).append(i)
        for (k, with_vectors, _), same in searches.items():
            try:
                rows = None
                if vectors is not None:
                    rows = np.concatenate(
                        [vectors[offsets[i] : offsets[i] + items[i].request.n] for i in same]
                    )
                request = SearchRequest(
                    [q for i in same for q in items[i].request.queries],
                    k=k,
                    query_vectors=rows,
                    retrieval=mode,
                    where=items[same[0]].request.where,
                    return_vectors=with_vectors,
                )
                hits = index.search(request)
            except Exception as exc:  # noqa: BLE001 - fails these calls only
                for i in same:
                    results[i] = exc
                continue
            at = 0
            for i in same:
                n = items[i].request.n
                results[i] = hits[at : at + n]
                at += n
    return [r if r is not None else RuntimeError("not searched") for r in results]


def retrieval_span_attributes(k: int, index: str, retrieval: str) -> dict[str, str | int]:
    """A retrieval span's attributes (the OpenTelemetry GenAI conventions, ``gen_ai.*``)."""
    return {
        "gen_ai.operation.name": "retrieval",
        "gen_ai.provider.name": telemetry.PROVIDER,
        "gen_ai.data_source.id": index,
        "gen_ai.retrieval.top_k": k,
        "openbook.retrieval.mode": retrieval,
    }


class RetrieverServicer(retriever_pb2_grpc.RetrieverServicer):
    def __init__(
        self,
        registry: Registry,
        shared: ActiveIndexStore | None = None,
        query_encoder: Encoder | None = None,
        metrics: ServiceMetrics | None = None,
        checkpoint_root: Path | None = None,
        *,
        max_batch_size: int = 32,
        max_batch_wait_ms: float = 2.0,
        max_queue: int = 256,
        compute_threads: ComputeThreadsOptions | None = None,
        compact_passages: int = 10_000,
        new_index: NewIndexDefaults | None = None,
    ) -> None:
        """``compute_threads``: how the batch thread sizes its torch (and faiss) threads
        (:mod:`openbook.runtime.compute_threads`); None: torch's default, untouched.
        ``compact_passages``: the write segment (or hidden rows) that starts a compaction;
        ``new_index``: what CreateIndex makes without ``like`` (default: the default encoder,
        flat)."""
        self.checkpoint_root = checkpoint_root
        self.registry = registry
        self.compactor = BackgroundCompactor(registry, compact_passages)
        self.new_index = new_index or NewIndexDefaults(DEFAULT_ENCODER, "flat")
        self.metrics = metrics
        self.encoder_version = ""  # a checkpoint's version once one is loaded
        self.shared = shared
        # An override of the indexes' own query encoders (OPENBOOK_RETRIEVER_QUERY_ENCODER, then a
        # checkpoint's): it searches only the indexes it pairs with (openbook.index.pairing).
        self.override: QueryEncoderOverride | None = (
            configured_override(query_encoder) if query_encoder is not None else None
        )
        # A swap to an index no query encoder can search is refused before it becomes active.
        registry.before_activate = self._check_pairing
        # Local swaps and following the shared key are serialised, so a stale read of the
        # key can never undo a swap that has just been made here.
        self._swap_lock = threading.Lock()
        # The last shared active index this replica refused: logged once, then left alone.
        self._refused_shared: str | None = None
        # Creating or deleting an index (and renewing its state in Redis) is serialised with
        # the watch's sharing of versions and noticing of indexes gone: a version read of an
        # index just deleted is never published into its successor's new epoch, and an index
        # made here is never taken for one replaced out of band.
        self._index_lives = threading.Lock()
        # The indexes whose version this replica shared since it started (Retrieve).
        self._versions_shared: set[str] = set()
        self.compute: ComputeThreads | None = None
        if compute_threads is not None:
            self.compute = ComputeThreads(
                compute_threads,
                on_change=None if metrics is None else metrics.set_compute_threads,
            )
        self.batcher: Batcher[_Search, list[list[Passage]]] = Batcher(
            self._search_batch,
            max_batch_size=max_batch_size,
            max_wait_ms=max_batch_wait_ms,
            max_queue=max_queue,
            name="retrieve-batcher",
            on_batch=self._on_batch,
        )
        if metrics is not None:
            metrics.track_queue(self.batcher.depth)

    def _search_batch(self, items: list[_Search]) -> list[list[list[Passage]] | Exception]:
        """:func:`search_batch` on the batch thread, its compute threads sized first: torch's
        OpenMP size is per thread, so it is set on the thread that encodes (and searches)."""
        if self.compute is not None:
            self.compute.maybe_resize()
        return search_batch(items)

    def _on_batch(self, size: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_batch(size, self.batcher.depth())

    def close(self) -> None:
        self.batcher.close()
        self.compactor.wait()

    @property
    def query_encoder(self) -> Encoder | None:
        """The override (None: every index searches with its own query encoder)."""
        return self.override.encoder if self.override is not None else None

    @property
    def model_version(self) -> str:
        if self.encoder_version:
            return self.encoder_version
        # An encoder loaded from a directory is named by its path: replies name it by
        # public_name (its directory's name and a digest), never the path (issue 42).
        encoder = self.query_encoder
        return public_name(encoder.name) if encoder is not None else "index-default"

    def _pairing(self, index: SearchableIndex) -> tuple[Encoder | None, str]:
        """The encoder to search ``index`` with (None: its own, or bm25) and the model
        version that names it: the override only where it pairs with the index."""
        override = self.override
        if override is None:
            return None, self.model_version  # a checkpoint without a query encoder: its version
        if override.fits(index.manifest, index.name):
            return override.encoder, override.version
        return None, "index-default"

    def _check_pairing(self, index: SearchableIndex) -> None:
        """Refuse to activate a dense index that neither the override pairs with nor its own
        query encoder can search (the registry's ``before_activate``)."""
        if not index.dense:
            return
        override = self.override
        problem = override.problem(index.manifest, index.name) if override is not None else None
        if override is not None and problem is None:
            return
        try:
            index.query_encoder  # noqa: B018 - loads (and dim-checks) the manifest's encoder
        except Exception as exc:  # noqa: BLE001 - any failure means nothing can search it
            m = index.manifest
            why = f"{problem}; and" if problem else "no query encoder override;"
            raise PairingError(
                f"index {index.name!r} refused: {why} its own query encoder "
                f"{m.query_encoder or m.encoder!r} (dim {m.dim}) cannot be used: {exc}. "
                f"The current index keeps serving"
            ) from None

    def Retrieve(self, request, context):
        valid = validate_retrieve(request)
        with self.registry.lease(valid.index) as index:
            resolved = resolved_on(valid.search, index)
            encoder, model_version = self._pairing(index)
            search = _Search(index, encoder, resolved)
            retrieval, k = str(search.mode), resolved.k
            # Read before the search: every write acknowledged by then is in its results.
            documents = as_document_index(index)
            version = documents.version if documents is not None else 0
            # the GenAI retrieval span (a child of the RPC's server span, with tracing on)
            with telemetry.span(
                f"retrieval {index.name}", retrieval_span_attributes(k, index.name, retrieval)
            ) as span:
                results = self.batcher.submit(search, timeout_s=time_remaining(context))
                span.set_attribute("openbook.retrieval.passages", sum(map(len, results)))
            name = index.name
            # A passage of an uploaded PDF names its page (the citation's), from its
            # document's metadata: one metadata read for the request's passages.
            pages: dict[str, int] = {}
            if documents is not None:
                pages = documents.passage_pages(p.id for passages in results for p in passages)
        self._record_version(name, version)
        if name not in self._versions_shared:
            # The first search of an index here: gateways cache its answers from now, not
            # from the next tick of the shared state's watch (share_index_versions).
            self._versions_shared.add(name)
            self.share_index_versions(only=name)
        return retriever_pb2.RetrieveResponse(
            results=[
                retriever_pb2.QueryResult(
                    passages=[
                        passage_to_proto(p, resolved.return_vectors, pages.get(p.id, 0))
                        for p in passages
                    ]
                )
                for passages in results
            ],
            index=name,
            model_version=model_version,
            retrieval=retrieval,
            index_version=version,
        )

    def EmbedQueries(self, request, context):
        """The query vectors Retrieve would search ``request.index`` with: the same pairing
        (the override where it fits the index, else the index's own query encoder, adapters
        included) and the same check of the encoder against the index.

        Encoded on the gRPC worker thread, not the batch thread: an embedding is not a search,
        and the encoder serialises its own forward passes (``Encoder._lock``)."""
        queries, index_name = validate_embed(request)
        with self.registry.lease(index_name) as index:
            if not index.dense:
                raise FailedPrecondition(
                    f"index: {index.name!r} is bm25 and has no query encoder to embed with"
                )
            encoder, model_version = self._pairing(index)
            encoder = encoder if encoder is not None else index.query_encoder
            index.check_encoder(encoder)
            vectors = encoder.encode(list(queries))
            counts = encoder.count_tokens(list(queries))
            name = index.name
        return retriever_pb2.EmbedQueriesResponse(
            embeddings=[
                retriever_pb2.Embedding(vector=row.tolist(), num_tokens=count)
                for row, count in zip(vectors, counts, strict=True)
            ],
            index=name,
            model_version=model_version,
        )

    def _search(self, index: SearchableIndex, queries: list[str], k: int, vectors: bool):
        """Search ``index`` through the batch thread, as a request would (the warm-up: so that
        the thread that will encode has its kernels warm and its compute threads sized)."""
        encoder, _ = self._pairing(index)
        request = SearchRequest(queries, k=k, return_vectors=vectors)
        search = _Search(index, encoder, resolved_on(request, index))
        return self.batcher.submit(search)

    def use_checkpoint(self, path: Path) -> None:
        """Serve the query encoder of a trainer checkpoint (or the latest under a root).

        The encoder is loaded and checked before the switch, so a missing or corrupt
        checkpoint raises and the current encoder keeps serving. It then searches only the
        indexes it pairs with (the index it was trained against and those of the same lineage
        and dimension, ``openbook.index.pairing``); the others keep their own query encoders.
        A checkpoint that does not pair with the *active* (dense) index is refused
        (FAILED_PRECONDITION): loading it would change nothing that is served.
        """
        ckpt, manifest = open_checkpoint(path)
        encoder = load_query_encoder(ckpt, verify=False)
        override = None
        if encoder is not None:
            trained = str(manifest.index.get("name") or "")
            override = checkpoint_override(
                encoder,
                manifest.version,
                manifest.base_query_encoder,
                self._trained_on(trained, manifest.index.get("checksum")),
            )
            if self.registry.active:
                with self.registry.lease() as index:
                    problem = override.problem(index.manifest, index.name)
                    if index.dense and problem is not None:
                        raise PairingError(
                            f"checkpoint {manifest.version} (trained against index "
                            f"{trained or '?'!r}, base query encoder "
                            f"{manifest.base_query_encoder!r}) refused while index "
                            f"{index.name!r} is active: {problem}. Swap to an index it pairs "
                            f"with first; the current query encoder keeps serving"
                        )
        self.override, self.encoder_version = override, manifest.version
        self.announce_model()
        log.info("query encoder from checkpoint %s", manifest.version)

    def _trained_on(self, name: str, checksum: str | None):
        """The manifest of the index a checkpoint was trained against, when it is here."""
        if not name or name not in self.registry.available():
            return None
        try:
            m = self.registry.manifest(name)
        except Exception as exc:  # noqa: BLE001 - lineage then comes from the base encoder only
            log.warning("training index %s: unreadable manifest: %s", name, exc)
            return None
        if checksum and m.checksum != checksum:
            log.warning(
                "index %s changed since the checkpoint was trained on it (checksum %s != %s)",
                name,
                m.checksum[:12],
                checksum[:12],
            )
        return m

    def announce_model(self) -> None:
        if self.metrics is not None:
            self.metrics.set_serving("model", self.model_version)
        if self.shared is not None:
            publish_model_version(
                self.shared.client, "retriever", self.model_version, self.shared.sealer
            )

    def ReloadModel(self, request, context):
        # Only checkpoints inside the checkpoint root: the path comes from an HTTP client.
        try:
            self.use_checkpoint(checkpoint_in_root(self.checkpoint_root, request.path))
        except OSError as exc:  # inside the root, but unreadable (permissions, ...)
            raise InvalidArgument(f"checkpoint {request.path!r}: {exc.strerror or exc}") from None
        return common_pb2.ModelInfo(
            model_version=self.model_version,
            model_type="query-encoder" if self.query_encoder is not None else "index-default",
            device="cpu",
            dtype="float32",
        )

    def _info(self, name: str) -> retriever_pb2.IndexInfo:
        status = self.registry.status(name)
        info = retriever_pb2.IndexInfo(
            name=name,
            loaded=self.registry.is_loaded(name),
            active=name == self.registry.active,
            problem=status.problem,
            verified=status.verified,
            engine=str(self.registry.engine_kind),
        )
        m = status.manifest
        if m is not None:
            info.encoder = m.encoder or ""
            info.dim = int(m.dim or 0)
            info.count = int(m.count)
            info.index_type = m.index_type
            info.checksum = m.checksum or ""
            info.score_scale = float(m.score_scale)
            info.views.extend(m.views)
            info.default_retrieval = m.default_retrieval
        self._live_info(name, info)
        return info

    def _live_info(self, name: str, info: retriever_pb2.IndexInfo) -> None:
        """A loaded live index's version and passage count (else: the base's count and
        version 0; listing never loads an index to read its log)."""
        state = self.registry.live_state(name)
        if state is not None:
            info.version, info.count = state

    def ListIndexes(self, request, context):
        # Every index directory, an unloadable one too, saying why (registry.status).
        infos = [self._info(name) for name in self.registry.available()]
        return retriever_pb2.ListIndexesResponse(
            indexes=infos, active=self.registry.active or "", model_version=self.model_version
        )

    def SwapIndex(self, request, context):
        name = check_index_name("name", request.name)
        with self._swap_lock:
            previous, _ = self.registry.swap(name)  # a bad index raises: nothing shared
            if self.shared is not None:
                self.shared.set(name)
            self._record_active()
        return retriever_pb2.SwapIndexResponse(
            previous=previous or "", active=name, info=self._info(name)
        )

    # ---- documents (issue 32)
    def CreateIndex(self, request, context):
        valid = validate_create_index(request)
        if valid.like is None:
            spec = IndexSpec(
                name=valid.name,
                index_type=valid.index_type or self.new_index.index_type,
                encoder=self.new_index.encoder,
            )
            encoder = load_encoder(spec.encoder, role="document") if spec.dense else None
            template = template_for(spec, encoder)
        else:
            try:
                manifest = self.registry.manifest(valid.like)
            except NotFound:
                raise NotFound(f"like: unknown index {valid.like!r}") from None
            try:
                template = template_of(manifest, name=valid.name, index_type=valid.index_type)
            except ValueError as exc:
                raise InvalidArgument(f"type: {exc}") from None
        with self._index_lives:
            self.registry.create(valid.name, template)
            self._renew_state(valid.name)
        return self._info(valid.name)

    def DeleteIndex(self, request, context):
        name = check_index_name("name", request.name)
        with self._index_lives:
            self.registry.delete(name)
            self._renew_state(name)
            self._versions_shared.discard(name)  # a new index of its name: shared afresh
        if self.metrics is not None:
            self.metrics.forget_index(name)
        return retriever_pb2.DeleteIndexResponse(name=name)

    def _renew_state(self, index: str) -> None:
        """``index`` created or deleted here: its state in Redis made afresh, a new epoch
        (:func:`openbook.state.shared_state.index_renewed`), whether or not a gateway shares it."""
        if self.shared is not None:
            index_renewed(self.shared.client, index, self.shared.sealer)

    def _record_version(self, index: str, version: int) -> None:
        if self.metrics is not None:
            self.metrics.set_index_version(index, version)

    def _acknowledge(self, index: str, live: DocumentIndex, version: int) -> None:
        """After a write is durable: the metric, and the version in Redis, where every gateway
        keys its cached answers by it (so none outlives this write). A shard publishes under
        its own label; the gateway sums an index's shards."""
        self._record_version(index, version)
        if self.shared is not None:
            shard = live.manifest.shard
            label = f"{shard['index']}-of-{shard['count']}" if shard else ""
            publish_index_version(
                self.shared.client, index, version, shard=label, sealer=self.shared.sealer
            )

    def _write(self, index: str, change: Callable[[DocumentIndex], WriteResult]) -> WriteResult:
        """Make ``change`` to ``index`` under the registry's writer, then what follows every
        write: the compactor's look at the index, and the acknowledgement."""
        with self.registry.writer(index) as live:
            result = change(live)
            self.compactor.after_write(index, live)
            self._acknowledge(index, live, result.version)
        return result

    def PutDocuments(self, request, context):
        valid = validate_put_documents(request)
        result = self._write(valid.index, lambda live: live.put_many(valid.documents))
        return retriever_pb2.WriteResponse(
            index=valid.index,
            version=result.version,
            passages=[len(result.passages[doc.id]) for doc in valid.documents],
        )

    def DeleteDocument(self, request, context):
        ref = validate_document_ref(request)
        result = self._write(ref.index, lambda live: live.delete(ref.id))
        return retriever_pb2.WriteResponse(index=ref.index, version=result.version)

    def GetDocument(self, request, context):
        ref = validate_document_ref(request)
        with self.registry.lease(ref.index) as index:
            documents = as_document_index(index)
            if documents is not None:
                stored = documents.get(ref.id)
            else:  # a built index: its passages grouped as its adoption would group them
                assert isinstance(index, LoadedIndex)
                stored = built_document(index, ref.id)
        return document_to_proto(stored)

    def ListDocuments(self, request, context):
        valid = validate_list_documents(request)
        with self.registry.lease(valid.index) as index:
            documents = as_document_index(index)
            if documents is not None:
                version = documents.version  # before the page: it holds at least this version
                page = documents.list(valid.cursor, valid.limit)
            else:  # a built index
                assert isinstance(index, LoadedIndex)
                version, page = 0, built_document_page(index, valid.cursor, valid.limit)
        return retriever_pb2.ListDocumentsResponse(
            ids=list(page.ids), next_cursor=page.next_cursor or "", version=version
        )

    def follow_shared_state(self) -> None:
        """What the retriever does on every tick of the shared state's watch (every 2 s, and
        on each swap announcement): follow the active index, notice indexes gone, and share
        the versions of the indexes it serves."""
        self.follow_shared_active()
        self.notice_vanished_indexes()
        self.share_index_versions()

    def share_index_versions(self, only: str | None = None) -> None:
        """Each loaded index's version on this shard, in Redis (raised only): a state gone
        (Redis restarted) or not genuine (forged) is made afresh, under a new epoch, and
        gateways cache its answers again. Until then they neither look up nor store them."""
        if self.shared is None:
            return
        for name in [only] if only is not None else self.registry.available():
            with self._index_lives:
                if not self.registry.is_loaded(name):
                    continue
                try:
                    shard = self.registry.manifest(name).shard
                    state = self.registry.live_state(name)
                except Exception as exc:  # noqa: BLE001 - one unreadable index must not stop the rest
                    log.warning("index %s: version not shared: %s", name, exc)
                    continue
                label = f"{shard['index']}-of-{shard['count']}" if shard else ""
                version = state[0] if state is not None else 0
                publish_index_version(
                    self.shared.client, name, version, shard=label, sealer=self.shared.sealer
                )

    def notice_vanished_indexes(self) -> None:
        """An index directory removed (or replaced) out of band: stop serving it from memory
        and raise its cache epoch in Redis, so no gateway serves a cached answer from it."""
        with self._index_lives:
            gone = self.registry.vanished()
            for name in gone:
                log.warning("index %s: its directory was removed or replaced out of band", name)
                if self.shared is not None:
                    index_vanished(self.shared.client, name, self.shared.sealer)
        for name in gone:
            if self.metrics is not None:
                self.metrics.forget_index(name)

    def follow_shared_active(self) -> None:
        """Adopt the active index recorded in Redis (a swap made by another replica)."""
        if self.shared is None:
            return
        with self._swap_lock:
            shared = self.shared.get()
            mine = self.registry.active
            if not shared:
                if mine:
                    self.shared.restore(mine)
                return
            if shared == mine:
                self._refused_shared = None
                return
            if shared == self._refused_shared:
                return  # refused already and said so: once per distinct value, not every 2 s
            try:
                # The registry validates the name (a loadable index under its root) and loads
                # it; a name it refuses is never served, whatever Redis says.
                self.registry.swap(shared)
                self._refused_shared = None
            except Exception as exc:  # noqa: BLE001 - keep serving the current index
                self._refused_shared = shared
                log.error(
                    "not following the shared active index %r, serving %r: %s "
                    "(said once per value)",
                    shared,
                    mine,
                    exc,
                )
            self._record_active()

    def _record_active(self) -> None:
        if self.metrics is not None and self.registry.active:
            self.metrics.set_serving("index", self.registry.active)
