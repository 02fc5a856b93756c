"""LiveIndex: a published index that takes document writes without a rebuild.

A live index directory holds::

    base-<version>/     the published base (an ordinary index directory, never modified);
                        <version> is the last write it contains (0 for the adopted index)
    wal.log             every acknowledged write above the base's version (wal.py)
    documents.sqlite    the live documents, and the base's rows of each (document_store.py)

What a search sees is one immutable :class:`_View`: the base, a write segment (the passages
and vectors of every document put since the base) and the base rows hidden by deletes and
replacements. A write builds the next view and swaps it in with one assignment, under the
write lock, after its log record is fsynced; so a search sees a write wholly or not at all (a
replaced document is never half old, half new), and every search that starts after a write is
acknowledged sees it.

Invariants:
  * ``version`` grows by one with every acknowledged write (a batch is one write); it is the
    version of the last log record, or the base's when the log is empty.
  * A write is acknowledged only after its log record is fsynced; opening replays every log
    record above the base's version (and above the document store's ``applied_version``).
  * Deleted and replaced documents' base rows are never returned: the base is searched for
    k + (hidden rows) hits, so at least k live ones remain among them.
  * :meth:`compact` builds ``base-<v>`` over the base's live passages and the segment as of
    version v, from the vectors they are searched with (nothing is re-encoded:
    compaction.py), switches to it, then cuts the log through v. Writes arriving meanwhile are
    neither blocked for the build nor lost: they stay in the log and the segment above v.

Several processes (retriever replicas on one volume) open, search and write one live index:
  * One writer at a time: a write batch runs under the index's ``flock``
    (:mod:`openbook.index.writer_lock`), taken by whichever process received it. Under it the
    process first catches up (the log records others appended since its view, a torn tail of
    a writer that died mid-append cut, the document store brought up to the log), then
    appends and fsyncs ``version + 1``, applies it and releases the lock. Encoding the
    document happens before the lock: the lock is held for milliseconds.
  * A process catches up without the lock before every request (:meth:`catch_up`): a
    :func:`disk_stamp` compare (a few ``stat`` calls), and when it changed, the whole records
    appended since its position in the log (an append in progress is a torn tail, read next
    time); a compaction elsewhere (a newer ``base-<v>``) is a reload of the new base and the
    log above it. So a request that starts after any process acknowledged a write sees it.
  * The document store (SQLite, WAL mode) is shared: ``get`` / ``list`` read it directly, and
    it is written only under the writer lock, before the write is acknowledged.
  * A compaction holds ``compaction.lock`` (another process finding it held skips its own),
    builds the base without the writer lock, and takes it for the switch: it catches up,
    cuts the log through v, and only then forgets the old base's rows. A process that sees
    the new base before its rows are recorded reads on over its old base and the log, which
    until the cut still holds every write above the old base.

Scores, by retrieval mode (a compaction makes all three what a fresh build over the same
vectors gives; a shard keeps its BM25 scores, compaction.py says why):
  * ``dense``: exact for the segment (score_scale x inner product, as the base scores);
    the base's as its index type gives them (exact for ``flat``). Merged by score, the top k
    across both are those of a compacted flat index.
  * ``bm25``: the base's scores, and the segment's computed with the base's statistics
    (:mod:`openbook.index.segment_bm25` says what that leaves approximate).
  * ``hybrid``: the base's candidates (its dense and BM25 top N, hidden rows removed) and the
    segment's (its own dense and BM25 top N), each with both features exactly as above, fused
    by the base's :class:`~openbook.index.fusion.Fusion`.
"""

from __future__ import annotations

import logging
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

from openbook.errors import InvalidArgument, NotFound
from openbook.index.bm25 import BM25_DIR
from openbook.index.compaction import BaseInputs, build_base
from openbook.index.document_store import DOCUMENTS_FILE, BaseRow, DocumentStore, StoredDocument
from openbook.index.documents import (
    Document,
    built_document_id,
    check_document_ref,
    document_id_of,
    validated_batch,
)
from openbook.index.empty_base import TEMPLATE_FILE, EmptyBase
from openbook.index.encoders import Encoder
from openbook.index.engine import RetrievalMode, pages_of
from openbook.index.filtering import MetadataColumns, segment_mask
from openbook.index.fusion import Fusion
from openbook.index.loaded import LoadedIndex, document_encoder, open_index
from openbook.index.manifest import MANIFEST, Manifest
from openbook.index.request import SearchRequest
from openbook.index.segment_bm25 import BaseBM25Statistics, PassageTerms, SegmentPostings
from openbook.index.wal import (
    WAL_FILE,
    DeleteOp,
    LogPosition,
    PutOp,
    WalRecord,
    WriteAheadLog,
    open_log,
    read_log_from,
)
from openbook.index.writer_lock import COMPACTION_LOCK_FILE, WriterLock, WriterLockHeld
from openbook.storage.artifacts import publish, staging_dir
from openbook.types import Passage
from openbook.validation.limits import check_range
from openbook.validation.metadata_filter import MetadataFilter, record_of

log = logging.getLogger(__name__)

BASE_PREFIX = "base-"
_BASE_DIR = re.compile(r"base-(\d{12})")
MAX_LIST_LIMIT = 1000

# Aliases: inside LiveIndex, ``list`` is its method (the name for a page of ids).
Hits = list[list[Passage]]
Texts = list[str]
PassageList = list[Passage]
NewRows = list[BaseRow]
# A published base, or the template of an index created empty (empty_base.py).
BaseIndex = LoadedIndex | EmptyBase


class DocumentNotFound(NotFound, KeyError):
    """No live document has this id (a 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class LiveOptions:
    """How a live index is opened and writes are encoded."""

    verify: bool = True  # re-hash the base's files on open (open_index's ``verify``)
    batch_size: int = 64  # documents' passages per encoder batch
    # Opened only to read: it changes nothing on disk (no torn log tail cut, no leftover
    # removed, no document store update), never takes the writer lock, and takes no writes.
    # Otherwise every process may write: each write takes the writer lock (module docstring).
    read_only: bool = False


class StaleOpen(RuntimeError):
    """A read-only open raced a compaction of the writer (its base changed while the log was
    read): open again."""


@dataclass(frozen=True)
class WriteResult:
    """An acknowledged write: its version and the passage ids of each document put."""

    version: int
    passages: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class DocumentPage:
    ids: tuple[str, ...]
    next_cursor: str | None  # None: no more documents


@dataclass(frozen=True)
class CompactionResult:
    version: int  # the writes the new base contains
    passages: int
    seconds: float


@dataclass(frozen=True)
class _SegmentDocument:
    version: int
    passages: tuple[Passage, ...]
    vectors: np.ndarray | None  # float32 (passages, dim); None on a bm25-only index
    terms: tuple[PassageTerms, ...]
    # What a metadata filter sees of the document (metadata with _id and _title).
    record: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class _Masks:
    """What a filtered search may return: base rows (boolean, ``len(base)``; hidden rows
    False) and segment passages (boolean, in ``segment_passages`` order)."""

    base: np.ndarray
    segment: np.ndarray


@dataclass(frozen=True)
class _View:
    """One consistent state of the index; never changed once published to searchers."""

    version: int
    base: BaseIndex
    base_version: int
    bm25: BaseBM25Statistics | None
    documents: Mapping[str, _SegmentDocument]  # the write segment, by document id
    tombstones: Mapping[str, int]  # deleted documents -> the delete's version
    hidden_rows: frozenset[int]  # base rows of deleted or replaced documents
    hidden_ids: frozenset[str]  # their passage ids

    @cached_property
    def segment_passages(self) -> list[Passage]:
        return [p for d in self.documents.values() for p in d.passages]

    @cached_property
    def segment_vectors(self) -> np.ndarray:
        dim = self.base.manifest.dim
        parts = [d.vectors for d in self.documents.values() if d.vectors is not None]
        return np.concatenate(parts) if parts else np.zeros((0, dim), np.float32)

    @cached_property
    def segment_records(self) -> list[Mapping[str, object]]:
        """Per segment passage, its document's filter record."""
        return [d.record for d in self.documents.values() for _ in d.passages]

    @cached_property
    def segment_postings(self) -> SegmentPostings:
        return SegmentPostings([t for d in self.documents.values() for t in d.terms])

    @property
    def count(self) -> int:
        return len(self.base) - len(self.hidden_rows) + len(self.segment_passages)


class LiveIndex:
    """A base index plus a write segment and deletions (module docstring). Thread-safe."""

    def __init__(self, path: Path, options: LiveOptions | None = None) -> None:
        """Open the live index directory ``path`` (see :meth:`create`): the newest base, the
        document store, the log replayed over them. A writer's open finishes what a crashed
        writer left (torn log tail, document store behind the log) under the writer lock."""
        self.path = Path(path)
        self.options = options or LiveOptions()
        self._write_lock = threading.Lock()
        self._compact_lock = threading.Lock()
        self._encoder_lock = threading.Lock()
        self._encoder: Encoder | None = None
        # The base's filter columns (filtering.py), built on the first filtered search of a
        # base; the base object they were built for.
        self._columns: tuple[BaseIndex, MetadataColumns] | None = None
        self._columns_lock = threading.Lock()
        self._wal: WriteAheadLog | None = None
        self._log_at: LogPosition | None = None  # where the view's log read ended
        self._seen: tuple[str, int, int, int] | None = None  # disk_stamp the view is as of
        self._store = DocumentStore(self.path / DOCUMENTS_FILE)
        try:
            if self.options.read_only:
                self._view = self._load(None)
            else:
                for attempt in range(3):
                    base, base_version = self._open_base(None, reader=False)
                    try:
                        with self._locked():
                            self._view = self._load((base, base_version))
                        self._remove_leftovers(base_version)
                        break
                    except StaleOpen:  # compacted by another process while we opened
                        if attempt == 2:
                            raise
        except BaseException:
            if self._wal is not None:
                self._wal.close()
            self._store.close()
            raise

    def _remove_leftovers(self, base_version: int) -> None:
        """Older bases and what an interrupted compaction left, only while no process is
        compacting (its compaction lock is free): a running one's build lives there too."""
        try:
            compacting = WriterLock(self.path, lock_file=COMPACTION_LOCK_FILE)
        except WriterLockHeld:
            return  # the compacting process removes them when it is done
        with compacting:
            if _newest_base(self.path)[1] == base_version:
                _remove_old_bases(self.path, keep=_base_dir(self.path, base_version))

    def _locked(self) -> WriterLock:
        """The index's writer lock across processes (writer_lock.py), waited for."""
        return WriterLock(self.path, wait=True)

    def _open_base(self, current: _View | None, *, reader: bool) -> tuple[BaseIndex, int]:
        """The newest base on disk, opened (``current``'s own when it is that one).
        ``reader``: for a read without the writer lock, which cannot record its rows."""
        base_dir, base_version = _newest_base(self.path)
        if current is not None and current.base_version == base_version:
            return current.base, base_version
        if reader and not self._store.has_base(base_version):
            # Checked before the (costly) open: a compaction publishes its base a moment
            # before it records the base's rows; until then, serve what we have.
            raise StaleOpen(f"{self.path}: base {base_version} not recorded yet")
        try:
            if base_dir is None:
                template = Manifest.from_file(self.path / TEMPLATE_FILE)
                return EmptyBase(self.path, template, name=self.path.name), base_version
            return open_index(
                base_dir, verify=self.options.verify, name=self.path.name
            ), base_version
        except Exception:
            if _newest_base(self.path)[1] != base_version:  # removed by a newer compaction
                raise StaleOpen(f"{self.path}: compacted while opening") from None
            raise

    def _load(self, opened: tuple[BaseIndex, int] | None) -> _View:
        """A view of the newest base and the whole log over it. ``opened``: that base, opened
        already, and the caller holds the writer lock: the log is opened for appending (its
        torn tail cut), the base's rows recorded if no writer did yet, and the document store
        brought up to the log. None: read-only, changing nothing on disk."""
        writer = opened is not None
        if opened is None:
            opened = self._open_base(getattr(self, "_view", None), reader=True)
        base, base_version = opened
        try:
            if _newest_base(self.path)[1] != base_version:
                raise StaleOpen(f"{self.path}: compacted while opening")
            if not self._store.has_base(base_version):
                if not writer:
                    raise StaleOpen(f"{self.path}: base {base_version} not recorded yet")
                adopt = base_version == 0 and self._store.applied_version < 0
                self._record_base(base, base_version, adopt=adopt)
            seen = disk_stamp(self.path)
            if writer:
                wal, records = open_log(self.path / WAL_FILE)
                if self._wal is not None:
                    self._wal.close()
                self._wal = wal
                position = wal.position
            else:
                got = read_log_from(self.path / WAL_FILE, None)
                assert got is not None  # read from the start: never "replaced since"
                records, position = got
                # The writer publishes a new base before it cuts the log: a base unchanged
                # after the read means the log read holds every write above it.
                if _newest_base(self.path)[1] != base_version:
                    raise StaleOpen(f"{self.path}: compacted while opening")
            view = _View(
                version=base_version,
                base=base,
                base_version=base_version,
                bm25=_bm25_statistics(base),
                documents={},
                tombstones={},
                hidden_rows=frozenset(),
                hidden_ids=frozenset(),
            )
            applied = self._store.applied_version
            for record in records:
                if record.version > base_version:
                    view = self._applied(view, record)
                if record.version > applied and writer:
                    self._store_record(record, base.manifest.max_words)
        except BaseException:
            if self._view_base_is_not(base):
                base.close()
            raise
        self._log_at, self._seen = position, seen
        return view

    def _view_base_is_not(self, base: BaseIndex) -> bool:
        view = getattr(self, "_view", None)
        return view is None or view.base is not base

    def catch_up(self) -> bool:
        """See what other processes (replicas) wrote or compacted since this view: the log
        records appended since are applied, a new base is opened. Cheap when nothing changed
        (a few ``stat`` calls: :func:`disk_stamp`). Returns whether the disk was read.

        Needs no lock: a reader reads whole records only (an append in progress is a torn
        tail, read next time). When a compaction has published a base whose rows are not
        recorded yet, the current view keeps serving and the next call tries again."""
        if disk_stamp(self.path) == self._seen:
            return False
        with self._write_lock:
            for attempt in range(3):
                try:
                    self._catch_up_locked(writer=False)
                    break
                except StaleOpen as exc:
                    # Compacted while we read: the new base's rows are recorded by now (a
                    # compaction records them before it cuts the log), so read again at once.
                    if attempt == 2:
                        log.warning("index %s: cannot catch up now: %s", self.name, exc)
        return True

    def _catch_up_locked(self, *, writer: bool) -> None:
        """:meth:`catch_up` under ``_write_lock``; ``writer``: the caller also holds the
        writer lock, so the log is extended for appending (a torn tail cut) and the document
        store brought up to the log too."""
        view = self._view
        if _newest_base(self.path)[1] != view.base_version:
            # Compacted by another process: the new base, and the log above it.
            if writer:
                # Under the writer lock a base cannot be switched to, but a compaction may
                # publish its next one meanwhile: open the newest again.
                for attempt in range(3):
                    try:
                        self._view = self._load(self._open_base(view, reader=False))
                        return
                    except StaleOpen:
                        if attempt == 2:
                            raise
            try:
                self._view = self._load(None)
                return
            except StaleOpen:
                pass  # Its rows are not recorded yet: until the compaction cuts the log, the
                # log still holds every write above our base, so read on over it.
        seen = disk_stamp(self.path)
        records: list[WalRecord] | None
        if writer:
            wal = self._wal
            records = wal.extend() if wal is not None else None
            if wal is None or records is None:  # never opened for appending here, or replaced
                if wal is not None:
                    wal.close()
                wal, records = open_log(self.path / WAL_FILE)
                self._wal = wal
            position = wal.position
            applied = self._store.applied_version
            for record in records:
                if record.version > applied:  # a writer that died before its store commit
                    self._store_record(record, view.base.manifest.max_words)
        else:
            got = read_log_from(self.path / WAL_FILE, self._log_at)
            if got is None:
                # The log was cut by a compaction. Its base may be the one this view holds
                # already (opened between its publish and its cut, over the uncut log): then
                # no newer base will ever send us to ``_load``, and our position is in a file
                # that is gone. Read the base and the whole log again (``_load`` checks that
                # the base is still the newest, so the log read holds every write above it).
                self._view = self._load(None)
                return
            records, position = got
        for record in records:
            if record.version > view.version:
                view = self._applied(view, record)
        if not writer and _log_inode(self.path) != position.inode:
            # The log was cut while we read: a compaction that may have forgotten the base
            # rows just looked up (it forgets them only after cutting the log).
            raise StaleOpen(f"{self.path}: compacted while catching up")
        self._view, self._log_at, self._seen = view, position, seen

    @classmethod
    def create(cls, path: Path, from_index: Path, options: LiveOptions | None = None) -> LiveIndex:
        """Make ``path`` a live index whose first base is a copy of the built index
        ``from_index`` (its documents: its passages grouped by ``<doc>#<n>`` ids), and open
        it. Published atomically: ``path`` is complete or absent."""
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"{path} already exists")
        with staging_dir(path) as staging:
            shutil.copytree(from_index, staging / f"{BASE_PREFIX}{0:012d}")
            publish(staging, path)
        return cls(path, options)

    @classmethod
    def create_empty(
        cls, path: Path, template: Manifest, options: LiveOptions | None = None
    ) -> LiveIndex:
        """Make ``path`` a live index with no documents whose bases will be like
        ``template`` (:func:`openbook.index.empty_base.template_of`), and open it."""
        path = Path(path)
        if path.exists():
            raise FileExistsError(f"{path} already exists")
        if template.count != 0 or template.files:
            raise InvalidArgument("template: a manifest of count 0 and no files (template_of)")
        with staging_dir(path) as staging:
            publish(staging, path, manifests={TEMPLATE_FILE: template.to_json()})
        return cls(path, options)

    # ------------------------------------------------------------------ reading

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def version(self) -> int:
        return self._view.version

    @property
    def base_version(self) -> int:
        return self._view.base_version

    @property
    def manifest(self) -> Manifest:
        """The base's manifest: type, encoders, views, score scale of every passage served."""
        return self._view.base.manifest

    @property
    def views(self) -> tuple[str, ...]:
        return self._view.base.views

    @property
    def default_retrieval(self) -> str:
        return self._view.base.default_retrieval

    @property
    def segment_size(self) -> int:
        """Passages in the write segment (what a compaction folds into the base)."""
        return len(self._view.segment_passages)

    @property
    def hidden_size(self) -> int:
        """Base rows hidden by deletes and replacements (what a compaction drops)."""
        return len(self._view.hidden_rows)

    @property
    def dense(self) -> bool:
        return self._view.base.dense

    def check_encoder(self, encoder: Encoder) -> None:
        """Raise InvalidArgument unless ``encoder`` can search this index (as the base checks)."""
        self._view.base.check_encoder(encoder)

    def __len__(self) -> int:
        return self._view.count

    def __repr__(self) -> str:
        v = self._view
        return (
            f"LiveIndex({self.name!r}, {v.base.manifest.index_type}, version={v.version}, "
            f"base={v.base_version}, segment={len(v.segment_passages)}, "
            f"hidden={len(v.hidden_rows)})"
        )

    @property
    def query_encoder(self) -> Encoder:
        return self._view.base.query_encoder

    def get(self, doc_id: str) -> StoredDocument:
        """The live document ``doc_id``; :class:`DocumentNotFound` if there is none."""
        check_document_ref("id", doc_id)
        found = self._store.get(doc_id)
        if found is None:
            raise DocumentNotFound(f"document {doc_id!r} not found in index {self.name!r}")
        return found

    def passage_pages(self, passage_ids: Iterable[str]) -> dict[str, int]:
        """The page of each of ``passage_ids`` that belongs to a live paged document (an
        uploaded PDF); the others are absent. Reads only the documents' metadata."""
        return pages_of(passage_ids, self._view.base.manifest.max_words, self._store.metadata)

    def list(self, cursor: str | None = None, limit: int = 100) -> DocumentPage:
        """A page of live document ids in id order, after ``cursor`` (a previous page's
        ``next_cursor``)."""
        check_range("limit", limit, 1, MAX_LIST_LIMIT)
        if cursor is not None and not isinstance(cursor, str):
            raise InvalidArgument("cursor must be a string")
        ids = self._store.list_ids(cursor, limit + 1)
        more = len(ids) > limit
        ids = ids[:limit]
        return DocumentPage(tuple(ids), ids[-1] if more else None)

    def search(self, request: SearchRequest, encoder: Encoder | None = None) -> Hits:
        """Top-k live passages per query, best first; as :meth:`LoadedIndex.search`.

        ``request.where``: only passages of documents whose metadata (with ``_id`` and
        ``_title``) passes it, filtered inside retrieval: the base searched with a mask of its
        matching, not hidden rows; the segment's non-matching passages never scored."""
        view = self._view
        mode = request.mode_on(view.base, encoder)
        if request.n == 0:
            return []
        k, return_vectors = request.k, request.return_vectors
        masks = self._masks(view, request.where)
        if mode is RetrievalMode.BM25:
            return self._search_bm25(view, list(request.queries), k, return_vectors, masks)
        q = request.dense_queries(view.base, encoder)
        if mode is RetrievalMode.DENSE:
            return self._search_dense(view, q, k, return_vectors, masks)
        return self._search_hybrid(view, list(request.queries), q, k, return_vectors, masks)

    def _masks(self, view: _View, where: MetadataFilter | None) -> _Masks | None:
        """The base rows and segment passages ``where`` keeps (hidden rows never); None
        without a filter."""
        if where is None:
            return None
        base_rows = self._base_columns(view).mask(where).copy()
        if view.hidden_rows:
            base_rows[np.fromiter(view.hidden_rows, dtype=np.int64)] = False
        return _Masks(base_rows, segment_mask(where, view.segment_records))

    def _base_columns(self, view: _View) -> MetadataColumns:
        """The filter columns of ``view.base``: each base row's document's record, from the
        document store. Built once per base: a live row's document has not changed since the
        base was built (a replace or delete hides its rows), so the store's metadata is the
        base's for every row a search can return. (A search that holds a view from before a
        replace, and happens to build the columns after it, filters that document's still
        visible old rows by its new metadata: only that one search, never a later one.)"""
        with self._columns_lock:
            if self._columns is not None and self._columns[0] is view.base:
                return self._columns[1]
            records = self._store.records()
            ordinal = {doc_id: i for i, (doc_id, _, _) in enumerate(records)}
            doc_of_row = np.full(len(view.base), -1, dtype=np.int64)
            base_rows = self._store.all_base_rows(view.base_version)
            if base_rows:
                rows = np.fromiter(base_rows, dtype=np.int64, count=len(base_rows))
                docs = [ordinal.get(d, -1) for d in base_rows.values()]
                doc_of_row[rows] = np.array(docs, dtype=np.int64)
            columns = MetadataColumns(
                doc_of_row,
                [r[0] for r in records],
                [r[1] for r in records],
                [r[2] for r in records],
            )
            self._columns = (view.base, columns)
            return columns

    def _base_fetch(self, view: _View, k: int, masks: _Masks | None = None) -> int:
        if masks is not None:
            return min(k, len(view.base))  # hidden rows are masked out: no over-fetch
        # Every hidden row could rank above the live ones: fetch that many more.
        return min(k + len(view.hidden_rows), len(view.base))

    def _search_dense(
        self, view: _View, q: np.ndarray, k: int, return_vectors: bool, masks: _Masks | None
    ) -> Hits:
        fetch = self._base_fetch(view, k, masks)
        if fetch == 0:
            base_hits: Hits = [[] for _ in q]
        else:
            request = SearchRequest(query_vectors=q, k=fetch, return_vectors=return_vectors)
            base_hits = view.base.search(request, allowed=None if masks is None else masks.base)
        seg = view.segment_passages
        scores = _inner_products(q, view.segment_vectors) * view.base.manifest.score_scale
        if masks is not None:
            scores = np.where(masks.segment, scores, -np.inf)
        out = []
        for qi, hits in enumerate(base_hits):
            merged = [p for p in hits if p.id not in view.hidden_ids]
            vecs = view.segment_vectors
            merged += [
                _scored(seg[j], float(scores[qi, j]), vecs[j] if return_vectors else None)
                for j in _top(scores[qi], k)
                if masks is None or masks.segment[j]
            ]
            out.append(_best(merged, k))
        return out

    def _search_bm25(
        self, view: _View, queries: Texts, k: int, return_vectors: bool, masks: _Masks | None
    ) -> Hits:
        base = view.base
        fetch = self._base_fetch(view, k, masks)
        if fetch == 0:
            base_hits: Hits = [[] for _ in queries]
        else:
            request = SearchRequest(
                queries, k=fetch, retrieval=RetrievalMode.BM25, return_vectors=return_vectors
            )
            base_hits = base.search(request, allowed=None if masks is None else masks.base)
        assert view.bm25 is not None  # the mode was checked against the base's views
        scores = view.bm25.score(queries, view.segment_postings)
        if masks is not None:
            scores = np.where(masks.segment, scores, 0.0)
        # As the base serves them: a bm25 index scales by its score_scale, a dense index's
        # BM25 view serves raw scores.
        scale = 1.0 if base.dense else base.manifest.score_scale
        seg = view.segment_passages
        out = []
        for qi, hits in enumerate(base_hits):
            merged = [p for p in hits if p.id not in view.hidden_ids]
            merged += [
                _scored(
                    seg[j],
                    float(scores[qi, j]) * scale,
                    view.segment_vectors[j] if return_vectors else None,
                )
                for j in _top(scores[qi], k)
                if scores[qi, j] > 0  # sharing no term with the query is no hit (as the base)
            ]
            out.append(_best(merged, k))
        return out

    def _search_hybrid(
        self,
        view: _View,
        queries: Texts,
        q: np.ndarray,
        k: int,
        return_vectors: bool,
        masks: _Masks | None,
    ) -> Hits:
        base = view.base
        fusion: Fusion = base.fusion
        n = max(k, fusion.candidates)
        fetch = self._base_fetch(view, n, masks)
        if fetch == 0:
            cands = EmptyBase.no_candidates(len(queries))
        else:
            cands = base.hybrid_candidates(
                queries, fetch, query_vectors=q, allowed=None if masks is None else masks.base
            )
        assert view.bm25 is not None
        seg = view.segment_passages
        seg_dense = _inner_products(q, view.segment_vectors)
        seg_bm25 = view.bm25.score(queries, view.segment_postings)
        seg_ok = np.ones(len(seg), dtype=bool) if masks is None else masks.segment
        if masks is not None:
            # Non-matching segment passages are never candidates (the base's are masked too).
            seg_dense = np.where(seg_ok, seg_dense, -np.inf)
            seg_bm25 = np.where(seg_ok, seg_bm25, 0.0)
        out = []
        for qi in range(len(queries)):
            rows = cands.rows[qi]
            keep = [j for j, r in enumerate(rows) if r >= 0 and int(r) not in view.hidden_rows]
            base_scores = fusion.score(cands.dense[qi, keep], cands.bm25[qi, keep])
            base_rows = [int(rows[j]) for j in keep]
            passages = base.get_passages(base_rows)
            vecs = base.get_vectors(base_rows) if return_vectors and base_rows else None
            merged = [
                _scored(p, float(s), vecs[i] if vecs is not None else None)
                for i, (p, s) in enumerate(zip(passages, base_scores, strict=True))
            ]
            # The segment's candidates: its own dense and BM25 top n, as the base's are.
            chosen = {j for j in _top(seg_dense[qi], n) if seg_ok[j]}
            chosen |= {j for j in _top(seg_bm25[qi], n) if seg_bm25[qi, j] > 0}
            fused = fusion.score(seg_dense[qi], seg_bm25[qi])
            merged += [
                _scored(
                    seg[j],
                    float(fused[j]),
                    view.segment_vectors[j] if return_vectors else None,
                )
                for j in sorted(chosen)
            ]
            out.append(_best(merged, k))
        return out

    # ------------------------------------------------------------------ writing

    def put(self, document: Document) -> WriteResult:
        """Insert or replace ``document`` (validated here: InvalidArgument naming the field).
        Returns once the write is durable and visible to every later search."""
        return self.put_many([document], field="document")

    def put_many(self, documents: Sequence[Document], *, field: str = "documents") -> WriteResult:
        """Insert or replace ``documents`` as one write: one version, all or nothing."""
        docs = validated_batch(documents, field)
        max_words = self._view.base.manifest.max_words
        ops = tuple(self._put_op(doc, max_words) for doc in docs)
        record = self._commit(ops)
        return WriteResult(
            record.version, {op.document.id: _passage_ids(op, max_words) for op in ops}
        )

    def delete(self, doc_id: str) -> WriteResult:
        """Delete the document ``doc_id``; :class:`DocumentNotFound` if there is none."""
        check_document_ref("id", doc_id)
        record = self._commit((DeleteOp(doc_id),))
        return WriteResult(record.version)

    def _put_op(self, doc: Document, max_words: int) -> PutOp:
        passages = doc.passages(max_words)
        vectors = None
        if self._view.base.dense:
            vectors = self._document_encoder().encode(
                [p.text for p in passages],
                self.options.batch_size,
                titles=[p.title for p in passages],
            )
        return PutOp(doc, vectors)

    def _document_encoder(self) -> Encoder:
        """The base's document encoder (``loaded.document_encoder``), loaded once."""
        with self._encoder_lock:
            if self._encoder is None:
                self._encoder = document_encoder(self.name, self._view.base.manifest)
            return self._encoder

    def _commit(self, ops: tuple[PutOp | DeleteOp, ...]) -> WalRecord:
        """Log ``ops`` as the next version and apply them, under the writer lock: first caught
        up with what other processes wrote, so the version follows theirs."""
        if self.options.read_only:
            raise RuntimeError(f"index {self.name!r} is open read-only: it takes no writes")
        with self._write_lock, self._locked():
            self._catch_up_locked(writer=True)
            assert self._wal is not None  # opened for appending by the catch-up
            view = self._view
            for op in ops:
                if isinstance(op, DeleteOp) and not self._store.contains(op.doc_id):
                    raise DocumentNotFound(
                        f"document {op.doc_id!r} not found in index {self.name!r}"
                    )
            record = WalRecord(view.version + 1, ops)
            self._wal.append(record)  # durable from here on
            self._view = self._applied(view, record)
            self._store_record(record, view.base.manifest.max_words)
            self._log_at, self._seen = self._wal.position, disk_stamp(self.path)
            return record

    def _applied(self, view: _View, record: WalRecord) -> _View:
        """The view after ``record``: its documents replace, or are deleted from, the
        segment, and their base rows are hidden."""
        documents = dict(view.documents)
        tombstones = dict(view.tombstones)
        for op in record.ops:
            if isinstance(op, PutOp):
                passages = tuple(op.document.passages(view.base.manifest.max_words))
                terms = tuple(PassageTerms.of(p.title, p.text) for p in passages)
                doc = op.document
                documents[doc.id] = _SegmentDocument(
                    record.version,
                    passages,
                    op.vectors,
                    terms,
                    record_of(doc.id, doc.title, doc.metadata),
                )
                tombstones.pop(op.document.id, None)
            else:
                documents.pop(op.doc_id, None)
                tombstones[op.doc_id] = record.version
        touched = [op.document.id if isinstance(op, PutOp) else op.doc_id for op in record.ops]
        rows = self._store.base_rows(view.base_version, touched)
        return _View(
            version=record.version,
            base=view.base,
            base_version=view.base_version,
            bm25=view.bm25,
            documents=documents,
            tombstones=tombstones,
            hidden_rows=view.hidden_rows | {r.row for r in rows},
            hidden_ids=view.hidden_ids | {r.passage_id for r in rows},
        )

    def _store_record(self, record: WalRecord, max_words: int) -> None:
        puts = [
            (op.document, _passage_ids(op, max_words)) for op in record.ops if isinstance(op, PutOp)
        ]
        deletes = [op.doc_id for op in record.ops if isinstance(op, DeleteOp)]
        self._store.apply(record.version, puts, deletes)

    def _record_base(self, base: BaseIndex, base_version: int, *, adopt: bool) -> None:
        """Record which rows of ``base`` belong to which document, from its passage ids:
        base 0, a built index's, as its documents were read before the adoption
        (``built_document_id``: ``<doc>#<n>#<m>`` is ``<doc>``'s), a later one (a compaction's
        whose rows went unrecorded) as live passages are named (``<doc_id>#<n>``);
        ``adopt``: its documents become the index's (a new live index)."""
        document_of = built_document_id if base_version == 0 else document_id_of
        rows: NewRows = []
        by_doc: dict[str, PassageList] = {}
        for start in range(0, len(base), 10_000):
            chunk = base.get_passages(range(start, min(start + 10_000, len(base))))
            for row, p in enumerate(chunk, start):
                doc_id = document_of(p.id)
                rows.append(BaseRow(doc_id, row, p.id))
                if adopt:
                    by_doc.setdefault(doc_id, []).append(p)
        docs = [
            (Document(d, ps[0].title, " ".join(p.text for p in ps), {}), [p.id for p in ps])
            for d, ps in by_doc.items()
        ]
        self._store.set_base(base_version, rows, docs)

    # ------------------------------------------------------------------ compaction

    def compact(self) -> CompactionResult | None:
        """Fold the segment and the deletions into a new base (module docstring). None when
        there is nothing to fold, when no passage would be left (an index is never empty), or
        when another process is compacting this index (its compaction lock is held). Writes go
        on meanwhile, here and in other processes; only the switch to the new base holds the
        writer lock."""
        if self.options.read_only:
            raise RuntimeError(f"index {self.name!r} is open read-only: it takes no writes")
        with self._compact_lock:
            try:
                compacting = WriterLock(self.path, lock_file=COMPACTION_LOCK_FILE)
            except WriterLockHeld:
                return None  # another replica is folding the same writes
            with compacting:
                return self._compact()

    def _compact(self) -> CompactionResult | None:
        t0 = time.monotonic()
        with self._write_lock, self._locked():
            self._catch_up_locked(writer=True)  # every write so far, and the store with them
            view = self._view
        if not view.documents and not view.hidden_rows:
            return None
        if self._store.applied_version < view.version:
            raise RuntimeError(
                f"index {self.name!r}: document store behind the log "
                f"({self._store.applied_version} < {view.version}); reopen to replay"
            )
        target = _base_dir(self.path, view.version)
        rows: NewRows = []
        # Published at once: a process that sees it before the switch below opens it and
        # replays the log above it, which is the same state (its rows recorded by whichever
        # writer gets there first, identically).
        count = build_base(
            self._compaction_inputs(view, rows), target, view.base.manifest, view.version
        )
        if count == 0:
            return None
        self._store.set_base(view.version, rows)
        new_base = open_index(target, verify=self.options.verify, name=self.name)
        new_bm25 = _bm25_statistics(new_base)
        with self._write_lock, self._locked():
            now = self._view  # a write of this process may have reloaded it onto the new base
            documents = {d: s for d, s in now.documents.items() if s.version > view.version}
            tombstones = {d: v for d, v in now.tombstones.items() if v > view.version}
            hidden = self._store.base_rows(view.version, [*documents, *tombstones])
            self._view = _View(
                version=now.version,
                base=new_base,
                base_version=view.version,
                bm25=new_bm25,
                documents=documents,
                tombstones=tombstones,
                hidden_rows=frozenset(r.row for r in hidden),
                hidden_ids=frozenset(r.passage_id for r in hidden),
            )
            # Then what other processes wrote meanwhile (all above the new base's version).
            self._catch_up_locked(writer=True)
            assert self._wal is not None  # opened for appending by the catch-up
            self._wal.drop_through(view.version)
            self._log_at, self._seen = self._wal.position, disk_stamp(self.path)
        self._store.forget_bases_before(view.version)
        # Searches still holding the old view keep its open files (unlinked, not closed).
        _remove_old_bases(self.path, keep=target)
        return CompactionResult(view.version, count, round(time.monotonic() - t0, 3))

    def _compaction_inputs(self, view: _View, rows: NewRows) -> BaseInputs:
        """The next base as of ``view``: the base's live rows in row order, then the
        segment's passages, with the vectors and BM25 scores they are searched with now
        (compaction.py); ``rows`` gets each passage's new row and document as they are
        read."""
        base = view.base
        live = np.ones(len(base), dtype=bool)
        live[list(view.hidden_rows)] = False
        base_rows = np.flatnonzero(live)

        def passages() -> Iterator[Passage]:
            old = self._store.all_base_rows(view.base_version)
            for start in range(0, len(base_rows), 10_000):
                chunk = base_rows[start : start + 10_000].tolist()
                for r, p in zip(chunk, base.get_passages(chunk), strict=True):
                    rows.append(BaseRow(old.get(r, document_id_of(p.id)), len(rows), p.id))
                    yield Passage(p.id, p.title, p.text)
            for doc_id, seg in view.documents.items():
                for p in seg.passages:
                    rows.append(BaseRow(doc_id, len(rows), p.id))
                    yield p

        return BaseInputs(
            base_dir=None if isinstance(base, EmptyBase) else base.path,
            base_rows=base_rows,
            passages=passages,
            segment_vectors=view.segment_vectors if base.dense else None,
            segment_terms=[t for d in view.documents.values() for t in d.terms],
            bm25=view.bm25,
        )

    def close(self) -> None:
        with self._write_lock:
            if self._wal is not None:
                self._wal.close()
            self._store.close()
            self._view.base.close()

    def __enter__(self) -> LiveIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _passage_ids(op: PutOp, max_words: int) -> tuple[str, ...]:
    return tuple(p.id for p in op.document.passages(max_words))


def _inner_products(q: np.ndarray, vectors: np.ndarray) -> np.ndarray:
    # In float64, rounded once (as LoadedIndex's exact features): the same query scores the
    # same on every call whatever SIMD path numpy takes.
    if len(vectors) == 0:
        return np.zeros((len(q), 0), np.float32)
    return (q.astype(np.float64) @ vectors.astype(np.float64).T).astype(np.float32)


def _scored(p: Passage, score: float, vector: np.ndarray | None) -> Passage:
    return Passage(
        p.id, p.title, p.text, score=score, vector=vector if vector is not None else p.vector
    )


def _top(scores: np.ndarray, k: int) -> list[int]:
    """Positions of the ``k`` highest ``scores`` (any order): only they can make a top k."""
    if len(scores) <= k:
        return list(range(len(scores)))
    return np.argpartition(-scores, k - 1)[:k].tolist()


def _best(passages: Iterable[Passage], k: int) -> list[Passage]:
    return sorted(passages, key=lambda p: -p.score)[:k]


def _bm25_statistics(base: BaseIndex) -> BaseBM25Statistics | None:
    if "bm25" not in base.views:
        return None
    if isinstance(base, EmptyBase):
        return BaseBM25Statistics.empty()
    sample = base.get_passages(range(min(len(base), 16)))
    return BaseBM25Statistics.load(
        base.path / BM25_DIR, [(i, p.title, p.text) for i, p in enumerate(sample)]
    )


def is_live_index(path: Path) -> bool:
    """Whether ``path`` has the live layout (a ``base-<v>`` or a template, and no top-level
    ``manifest.json``, which marks a built index); checks names only, opens nothing."""
    path = Path(path)
    if not path.is_dir() or (path / MANIFEST).exists():
        return False
    if (path / TEMPLATE_FILE).is_file():
        return True
    return any(_BASE_DIR.fullmatch(d.name) and d.is_dir() for d in path.iterdir())


def disk_stamp(path: Path) -> tuple[str, int, int, int]:
    """What changes on disk with every write or compaction of the live index at ``path`` (its
    newest base, its log's size, mtime and inode), for a reader to tell it is behind: a few
    stat calls."""
    base, _ = _newest_base(Path(path))
    try:
        st = (Path(path) / WAL_FILE).stat()
    except FileNotFoundError:
        return (base.name if base else "", -1, -1, -1)
    return (base.name if base else "", st.st_size, st.st_mtime_ns, st.st_ino)


def newest_base(path: Path) -> tuple[Path | None, int]:
    """The base a live index at ``path`` opens: its newest ``base-<v>`` directory and v, or
    (None, 0) when its ``template.json`` stands for the base."""
    return _newest_base(Path(path))


def _newest_base(path: Path) -> tuple[Path | None, int]:
    """The newest ``base-<v>`` and v; (None, 0) for an index created empty and never
    compacted (its ``template.json`` stands for the base)."""
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: live index directory not found")
    bases = sorted(
        (int(m.group(1)), d)
        for d in path.iterdir()
        if (m := _BASE_DIR.fullmatch(d.name)) and d.is_dir()
    )
    if not bases:
        if (path / TEMPLATE_FILE).is_file():
            return None, 0
        raise FileNotFoundError(f"{path}: no {BASE_PREFIX}<version> directory")
    version, newest = bases[-1]
    return newest, version


def _log_inode(path: Path) -> int:
    try:
        return (path / WAL_FILE).stat().st_ino
    except FileNotFoundError:
        return -1


def _base_dir(path: Path, version: int) -> Path:
    return path / f"{BASE_PREFIX}{version:012d}"


def _remove_old_bases(path: Path, keep: Path | None) -> None:
    """Older bases, and what an interrupted compaction left (its corpus, build, lock)."""
    for d in path.iterdir():
        old_base = _BASE_DIR.fullmatch(d.name) and d != keep
        # build_index's partial dir and lock of ".base-<v>.building" start with "..".
        leftover = d.name.startswith(".") and d.name.lstrip(".").startswith(BASE_PREFIX)
        if old_base or leftover:
            if d.is_dir():
                shutil.rmtree(d, ignore_errors=True)
            else:
                d.unlink(missing_ok=True)
