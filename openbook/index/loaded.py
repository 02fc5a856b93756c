"""open_index / LoadedIndex: a verified, read-only index ready to search.

Read side.
"""

from __future__ import annotations

import mmap
import threading
from collections.abc import Sequence
from pathlib import Path

import faiss
import numpy as np

from openbook.errors import InvalidArgument
from openbook.index import faiss_index
from openbook.index.arrays import open_array
from openbook.index.bm25 import BM25_DIR, BM25Searcher
from openbook.index.documents import built_document_id
from openbook.index.encoders import Encoder, load_encoder
from openbook.index.engine import RetrievalMode, check_retrieval
from openbook.index.filtering import (
    MetadataColumns,
    search_dense_masked,
)
from openbook.index.fusion import Candidates, Fusion, top_k, union_rows
from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
from openbook.index.manifest import MANIFEST, IndexLoadError, Manifest, combined_checksum
from openbook.index.request import SearchRequest
from openbook.index.spec import INDEX_TYPES
from openbook.index.store import PassageStore
from openbook.storage.artifacts import verify_files
from openbook.types import Passage
from openbook.validation.metadata_filter import MetadataFilter


def advise_random_reads(array: np.ndarray) -> None:
    """Tell the kernel that ``array`` (a memory map) is read at scattered rows.

    Re-ranking and ``return_vectors`` read k x rerank rows of ``vectors.npy`` at random; by
    default every page fault on a file map reads the device's whole read-ahead window around
    it (8 MB on this machine's disk), so once the vectors outgrow the page cache (21M x 768
    float32 is 64 GB) each row costs megabytes of reads: measured 0.5 GB/s of disk per shard
    process with no result in sight (docs/benchmarks.md, "The paper's scale"). With
    ``MADV_RANDOM`` a row costs its own pages. A no-op for an array that is not a map."""
    mapped = getattr(array, "_mmap", None)
    if isinstance(mapped, mmap.mmap) and hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)


def open_index(path: Path, verify: bool = True, *, name: str | None = None) -> LoadedIndex:
    """Open an index directory written by ``build_index``.

    Always checks what :func:`check_index` checks, and that dim/count agree across the
    manifest, faiss index, vectors and passage store. ``verify=True`` additionally re-hashes
    every file (minutes for a Wikipedia-sized index; a serving process that trusts its disk
    may pass ``verify=False``).

    ``name`` is the index's identity in messages and as ``.name``; a server passes the name
    clients use (the retriever: the directory name under its index root), because a copied
    or renamed directory keeps the manifest's ``name`` of the index it was built as.
    Default: the manifest's ``name``.
    """
    path = Path(path)
    manifest = check_index(path, name=name)
    if verify and (problem := verify_files(path, sha256=manifest.files)):
        raise IndexLoadError(f"index {name or manifest.name!r}: {problem}")
    return LoadedIndex(path, manifest, name=name)


def check_index(path: Path, *, name: str | None = None) -> Manifest:
    """The manifest of the index directory ``path``, checked without reading any data
    (:func:`read_index_manifest`, then :func:`check_index_files`). Raises
    :class:`IndexLoadError` naming the first problem (``name`` as in :func:`open_index`).

    Cheap (stat calls, no hashing): what the retriever checks to list an index as loadable.
    A file corrupted at its recorded size passes; :func:`open_index` with ``verify`` finds it.
    """
    manifest = read_index_manifest(path, name=name)
    check_index_files(path, manifest, name=name)
    return manifest


def read_index_manifest(path: Path, *, name: str | None = None) -> Manifest:
    """The manifest of the index directory ``path``: readable, with the fields read before
    any data (counts, encoders, file tables) of the types they claim."""
    path = Path(path)
    if not path.is_dir():
        raise IndexLoadError(f"{path}: index directory not found")
    manifest = Manifest.from_file(path / MANIFEST)
    if problem := _field_types_problem(manifest):
        raise IndexLoadError(f"index {name or manifest.name!r}: {MANIFEST}: {problem}")
    return manifest


def check_index_files(path: Path, manifest: Manifest, *, name: str | None = None) -> None:
    """``manifest`` is of a known index type and lists the files its type needs, and each
    listed file is under ``path`` at its recorded size, its checksum agreeing with its list."""
    path = Path(path)
    label = f"index {name or manifest.name!r}"
    if manifest.index_type not in INDEX_TYPES:
        raise IndexLoadError(f"{label}: unknown index_type {manifest.index_type!r}")
    needed = [PASSAGES_FILE, *((faiss_index.INDEX_FILE, VECTORS_FILE) if manifest.dense else ())]
    for rel in needed:
        if rel not in manifest.files:
            raise IndexLoadError(f"{label}: {rel} missing from the manifest's files")
    if "bm25" in manifest.views and not any(r.startswith(f"{BM25_DIR}/") for r in manifest.files):
        raise IndexLoadError(f"{label}: its bm25 view has no {BM25_DIR}/ files in the manifest")
    if problem := verify_files(path, sizes=manifest.sizes):
        raise IndexLoadError(f"{label}: {problem}")
    for rel in manifest.files:  # older manifests record no sizes
        if rel not in manifest.sizes and not (path / rel).is_file():
            raise IndexLoadError(f"{label}: {rel} missing")
    if combined_checksum(manifest.files) != manifest.checksum:
        raise IndexLoadError(f"{label}: manifest checksum does not match its file list")


def _field_types_problem(m: Manifest) -> str | None:
    """Why the fields read before any data cannot be what they claim, or None."""
    for field, value in (("count", m.count), ("dim", m.dim)):
        if type(value) is not int or value < 0:
            return f"{field} must be a whole number >= 0, got {value!r}"
    for field, name in (("encoder", m.encoder), ("query_encoder", m.query_encoder)):
        if name is not None and not isinstance(name, str):
            return f"{field} must be a string, got {name!r}"
    if not isinstance(m.checksum, str):
        return f"checksum must be a string, got {m.checksum!r}"
    for field, table, kind in (("files", m.files, str), ("sizes", m.sizes, int)):
        if not isinstance(table, dict) or not all(
            isinstance(rel, str) and type(value) is kind for rel, value in table.items()
        ):
            return f"{field} must map file paths to {kind.__name__} values"
    return None


def index_query_encoder(name: str, manifest: Manifest) -> Encoder:
    """The query encoder of the dense index ``name`` that ``manifest`` describes, loaded and
    checked against the index's dimension (:class:`IndexLoadError` naming the index if not)."""
    encoder_name = manifest.query_encoder or manifest.encoder
    assert encoder_name is not None
    try:
        encoder = load_encoder(encoder_name, role="query")
    except ValueError as e:
        raise IndexLoadError(f"index {name!r}: {e}") from None
    check_query_encoder(name, manifest, encoder)
    return encoder


def check_query_encoder(name: str, manifest: Manifest, encoder: Encoder) -> None:
    """Refuse a query encoder whose vectors the index ``name`` cannot search."""
    if encoder.dim != manifest.dim:
        raise IndexLoadError(
            f"index {name!r}: query encoder {encoder.name!r} dim {encoder.dim} "
            f"!= index dim {manifest.dim}"
        )


def document_encoder(name: str, manifest: Manifest) -> Encoder:
    """The document encoder that new passages of the dense index ``name`` are encoded with,
    loaded as ``build_index`` loads it (the manifest's ``encoder``, role ``document``), and
    checked against the index's dimension (InvalidArgument naming the index if not): what
    every engine that takes documents encodes them with."""
    assert manifest.encoder is not None
    encoder = load_encoder(manifest.encoder, role="document")
    if encoder.dim != manifest.dim:
        raise InvalidArgument(
            f"index {name!r}: document encoder {encoder.name!r} dim {encoder.dim} "
            f"!= index dim {manifest.dim}"
        )
    return encoder


class ManifestFacts:
    """What an index answers from its manifest alone, and its query encoder, loaded once:
    shared by :class:`LoadedIndex`, the empty base of a live index
    (``empty_base.EmptyBase``) and a Milvus index (``milvus_engine.MilvusIndex``), which set
    ``name``, ``manifest``, ``_encoder`` (None) and ``_encoder_lock``."""

    name: str
    manifest: Manifest
    _encoder: Encoder | None
    _encoder_lock: threading.Lock

    @property
    def dense(self) -> bool:
        return self.manifest.dense

    @property
    def views(self) -> tuple[str, ...]:
        """The retrieval views held: ("dense",), ("bm25",) or ("dense", "bm25")."""
        return tuple(self.manifest.views)

    @property
    def default_retrieval(self) -> str:
        """What ``search`` does without ``retrieval``: ``Manifest.default_retrieval`` (hybrid
        with the fitted fusion, else ``Fusion.default``, where both views exist)."""
        return self.manifest.default_retrieval

    @property
    def query_encoder(self) -> Encoder:
        """The manifest's query encoder, loaded once (and shared via the encoder cache)."""
        if not self.dense:
            raise InvalidArgument(f"index {self.name!r} is bm25 and has no query encoder")
        with self._encoder_lock:
            if self._encoder is None:
                self._encoder = index_query_encoder(self.name, self.manifest)
            return self._encoder

    def check_encoder(self, encoder: Encoder) -> None:
        check_query_encoder(self.name, self.manifest, encoder)

    @property
    def fusion(self) -> Fusion:
        """The fusion hybrid search uses: the manifest's fitted one (a Milvus index keeps the
        one fitted on the files engine, whose scores its are), else the default."""
        if "dense" not in self.views or "bm25" not in self.views:
            raise InvalidArgument(f"index {self.name!r} has views {self.views}: no hybrid fusion")
        if self.manifest.fusion is not None:
            return Fusion.from_dict(self.manifest.fusion)
        return Fusion.default(self.manifest.score_scale)

    def retrieval_mode(self, retrieval: str | None) -> RetrievalMode:
        """``retrieval`` checked against this index (None: ``default_retrieval``), as
        :func:`~openbook.index.engine.check_retrieval` checks it."""
        return check_retrieval(self.name, self.views, self.default_retrieval, retrieval)


class LoadedIndex(ManifestFacts):
    """Search and vector access over one index; thread-safe for concurrent searches."""

    def __init__(self, path: Path, manifest: Manifest, *, name: str | None = None) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.name = name or manifest.name  # see open_index: the name clients use, if given
        label = f"index {self.name!r}"
        if PASSAGES_FILE not in manifest.files:
            raise IndexLoadError(f"{label}: {PASSAGES_FILE} missing")
        self._store = PassageStore(self.path / PASSAGES_FILE)
        self._encoder: Encoder | None = None
        self._encoder_lock = threading.Lock()
        self._faiss: faiss.Index | None = None
        self._bm25: BM25Searcher | None = None
        self._vectors: np.ndarray | None = None
        self._columns: MetadataColumns | None = None
        self._columns_lock = threading.Lock()
        try:
            n_store = len(self._store)
            if n_store != manifest.count:
                raise IndexLoadError(f"{label}: count {manifest.count} != {n_store} passages")
            if manifest.dense:
                self._open_dense(label)
            if "bm25" in manifest.views:
                self._bm25 = BM25Searcher(self.path / BM25_DIR)
                if self._bm25.count != manifest.count:
                    raise IndexLoadError(
                        f"{label}: count {manifest.count} != bm25 index count {self._bm25.count}"
                    )
        except Exception:
            self.close()
            raise

    def _open_dense(self, label: str) -> None:
        m = self.manifest
        for rel in (faiss_index.INDEX_FILE, VECTORS_FILE):
            if rel not in m.files:
                raise IndexLoadError(f"{label}: {rel} missing")
        try:
            index = self._faiss = faiss_index.read(self.path / faiss_index.INDEX_FILE)
        except RuntimeError as e:
            raise IndexLoadError(f"{label}: cannot read {faiss_index.INDEX_FILE}: {e}") from None
        d = faiss_index.index_dim(index, m.index_type, m.index_params)
        if d != m.dim:
            raise IndexLoadError(f"{label}: dim {m.dim} != index dim {d}")
        if index.ntotal != m.count:
            raise IndexLoadError(f"{label}: count {m.count} != index count {index.ntotal}")
        faiss_index.configure(index, m.index_type, m.index_params)
        self._vectors = open_array(self.path / VECTORS_FILE)
        advise_random_reads(self._vectors)
        if self._vectors.shape != (m.count, m.dim):
            raise IndexLoadError(
                f"{label}: {VECTORS_FILE} shape {self._vectors.shape} != ({m.count}, {m.dim})"
            )

    def __repr__(self) -> str:
        m = self.manifest
        part = f", shard={m.shard['index']}/{m.shard['count']}" if m.shard else ""
        return f"LoadedIndex({self.name!r}, {m.index_type}, count={m.count}, dim={m.dim}{part})"

    def __len__(self) -> int:
        return self.manifest.count

    def __enter__(self) -> LoadedIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set_search_params(
        self,
        *,
        ef_search: int | None = None,
        nprobe: int | None = None,
        rerank: int | None = None,
    ) -> None:
        """Trade recall for latency at run time (HNSW efSearch, IVF nprobe, exact re-ranking
        of ``k * rerank`` candidates; 0 or 1 disables it). Not written back to disk."""
        params = self.manifest.index_params
        if ef_search is not None:
            params["ef_search"] = ef_search
        if nprobe is not None:
            params["nprobe"] = nprobe
        if rerank is not None:
            if rerank < 0:
                raise InvalidArgument(f"rerank must be >= 0, got {rerank}")
            params["rerank"] = rerank
        if self._faiss is not None:
            faiss_index.configure(self._faiss, self.manifest.index_type, params)

    def search(
        self,
        request: SearchRequest,
        encoder: Encoder | None = None,
        *,
        allowed: np.ndarray | None = None,
    ) -> list[list[Passage]]:
        """Top-k passages per query, best first.

        The mode (``request.mode_on``; none asked: :attr:`default_retrieval`) sets ``.score``:
        ``dense``: the manifest's ``score_scale`` x the inner product, ``bm25``: the BM25
        score, ``hybrid``: the fused score (:mod:`openbook.index.fusion`). ``encoder``
        (default: the manifest's query encoder) encodes the queries for the dense view, unless
        the request holds ``query_vectors`` (a server batching the encoder across requests);
        both are ignored by ``bm25`` retrieval on an index that also has a dense view.

        ``request.where`` (a metadata filter: a built index matches its built-in ``_id`` /
        ``_title`` only) and ``allowed`` (a boolean mask over rows, what a live index passes
        for its base) restrict the search to the rows they keep, inside retrieval
        (``filtering.py``): the k best kept passages come back whenever k are kept.
        """
        mode = request.mode_on(self, encoder)
        if request.n == 0:
            return []
        k, return_vectors = request.k, request.return_vectors
        mask = self.row_mask(request.where, allowed)
        if mode is RetrievalMode.BM25:
            assert self._bm25 is not None
            queries = list(request.queries)
            if mask is None:
                scores, rows = self._bm25.search(queries, k)
            else:
                scores, rows = self._bm25.search_masked(queries, k, mask)
            # A bm25 index's scores as they always were (its score_scale, 1 unless set); the
            # bm25 view of a dense index serves raw BM25 scores (score_scale is the dense one).
            scale = 1.0 if self.dense else self.manifest.score_scale
            return self._results(scores, rows, return_vectors=return_vectors, scale=scale)
        q = request.dense_queries(self, encoder)
        if mode is RetrievalMode.DENSE:
            return self._search_dense(q, k, return_vectors, mask)
        fusion = self.fusion
        cands = self._candidates(list(request.queries), q, max(k, fusion.candidates), mask)
        scores, rows = top_k(fusion, cands, k)
        return self._results(scores, rows, return_vectors, scale=1.0)

    def hybrid_candidates(
        self,
        queries: Sequence[str],
        n: int,
        encoder: Encoder | None = None,
        *,
        query_vectors: np.ndarray | None = None,
        allowed: np.ndarray | None = None,
    ) -> Candidates:
        """The union of the dense and the BM25 top ``n`` per query, with both exact features
        (:class:`openbook.index.fusion.Candidates`): what hybrid search and the fusion fit
        score. ``allowed``: among those rows only (a boolean mask)."""
        request = SearchRequest(
            queries, k=n, query_vectors=query_vectors, retrieval=RetrievalMode.HYBRID
        )
        request.mode_on(self, encoder)
        q = request.dense_queries(self, encoder)
        return self._candidates(list(request.queries), q, n, self.row_mask(None, allowed))

    def _dense(self) -> faiss.Index:
        """The faiss index; only called for an index with a dense view, which opened it."""
        assert self._faiss is not None
        return self._faiss

    def _candidates(
        self, queries: list[str], q: np.ndarray, n: int, mask: np.ndarray | None = None
    ) -> Candidates:
        assert self._bm25 is not None and self._vectors is not None
        m = self.manifest
        n = min(n, m.count)
        if mask is None:
            _, dense_rows = faiss_index.search(self._dense(), m.index_type, m.index_params, q, n)
            _, bm25_rows = self._bm25.search(queries, n)
        else:
            # Both views pre-filtered: the candidates are the filtered dense and BM25 top n.
            _, dense_rows = search_dense_masked(
                self._dense(), m.index_type, m.index_params, self._vectors, q, n, mask
            )
            _, bm25_rows = self._bm25.search_masked(queries, n, mask)
        rows = union_rows(dense_rows, bm25_rows)
        valid = rows >= 0
        # Exact features for every candidate, whichever view found it (the faiss score of an
        # approximate type, and no score at all from the view that missed it, would not do).
        vecs = faiss_index.gather_rows(self._vectors, np.where(valid, rows, 0).ravel())
        # In float64, rounded once to float32: a float32 dot product's last bit depends on
        # the SIMD path numpy takes (array alignment), and the same query must score the same
        # on every call (a gateway compares and caches them).
        vecs64 = vecs.reshape(*rows.shape, m.dim).astype(np.float64)
        dense = np.einsum("qmd,qd->qm", vecs64, q.astype(np.float64))
        dense = np.where(valid, dense, 0.0).astype(np.float32)
        bm25 = self._bm25.score_rows(queries, rows)
        return Candidates(rows, dense, bm25)

    def _search_dense(
        self, q: np.ndarray, k: int, return_vectors: bool, mask: np.ndarray | None
    ) -> list[list[Passage]]:
        """Dense top-k per query vector of ``q`` ``(n, dim)``, among the rows of ``mask``."""
        m = self.manifest
        factor = int(m.index_params.get("rerank", 0) or 0)
        assert self._vectors is not None  # opened with the faiss index
        if mask is not None:
            n = k * factor if factor > 1 and m.index_type != "flat" else k
            scores, rows = search_dense_masked(
                self._dense(), m.index_type, m.index_params, self._vectors, q, n, mask
            )
            if n > k:
                scores, rows = faiss_index.rerank_exact(q, rows, self._vectors, k)
        elif factor > 1 and m.index_type != "flat":
            _, cand = faiss_index.search(self._dense(), m.index_type, m.index_params, q, k * factor)
            scores, rows = faiss_index.rerank_exact(q, cand, self._vectors, k)
        else:
            scores, rows = faiss_index.search(self._dense(), m.index_type, m.index_params, q, k)
        return self._results(scores, rows, return_vectors)

    def metadata_columns(self) -> MetadataColumns:
        """What a filter sees of this index's rows, built on first use from the passage store
        (one pass over ids and titles): a built index stores no metadata, so each passage has
        the built-in ``_id`` (its document: ``<doc>`` of ``<doc>#<n>``, of ``<doc>#<n>#<m>``:
        ``built_document_id``, as GetDocument and an adoption group it) and ``_title`` only."""
        with self._columns_lock:
            if self._columns is None:
                # Plain lists and dicts in the loop (~1 us per row): numpy per row is slower.
                ordinal: dict[str, int] = {}
                titles: list[str] = []
                rows: list[int] = []
                for chunk in self._store.iter_ids_titles():
                    for _, pid, title in chunk:  # every row, in row order
                        doc = built_document_id(pid)
                        at = ordinal.setdefault(doc, len(ordinal))
                        if at == len(titles):
                            titles.append(title)
                        rows.append(at)
                doc_of_row = np.array(rows, dtype=np.int64)
                self._columns = MetadataColumns(doc_of_row, list(ordinal), titles)
            return self._columns

    def row_mask(
        self, where: MetadataFilter | None, allowed: np.ndarray | None = None
    ) -> np.ndarray | None:
        """The rows a search may return: those ``where`` keeps and ``allowed`` (a boolean mask
        of ``len(self)``) keeps; None when neither restricts."""
        if allowed is not None:
            allowed = np.asarray(allowed, dtype=bool)
            if allowed.shape != (self.manifest.count,):
                raise InvalidArgument(
                    f"allowed: a mask of {self.manifest.count} rows, got shape {allowed.shape}"
                )
        if where is None:
            return allowed
        mask = self.metadata_columns().mask(where)
        return mask if allowed is None else mask & allowed

    def _results(
        self,
        scores: np.ndarray,
        rows: np.ndarray,
        return_vectors: bool,
        scale: float | None = None,
    ) -> list[list[Passage]]:
        # ``scale`` (default: score_scale, for dense scores) is applied to real hits only:
        # padding is -FLT_MAX.
        scale = self.manifest.score_scale if scale is None else scale
        flat = sorted({int(r) for r in rows.ravel() if r >= 0})
        by_row = dict(zip(flat, self._store.get(flat), strict=True))
        vecs = dict(zip(flat, self.get_vectors(flat), strict=True)) if return_vectors else {}
        out = []
        for srow, rrow in zip(scores, rows, strict=True):
            hits = []
            for s, r in zip(srow, rrow, strict=True):
                if r < 0:
                    continue
                p = by_row[int(r)]
                score = float(s) * scale
                hits.append(Passage(p.id, p.title, p.text, score=score, vector=vecs.get(int(r))))
            out.append(hits)
        return out

    def get_vectors(self, row_ids: Sequence[int] | Sequence[str] | np.ndarray) -> np.ndarray:
        """Stored document vectors, float32 ``(len(row_ids), dim)``; rows or passage ids."""
        if self._vectors is None:
            raise InvalidArgument(f"index {self.name!r} is bm25 and stores no vectors")
        ids = list(row_ids)
        if ids and isinstance(ids[0], str):
            ids = self._store.rows_for_ids([str(i) for i in ids])
        rows = np.asarray(ids, dtype=np.int64)
        if rows.size and (rows.min() < 0 or rows.max() >= self.manifest.count):
            raise IndexError(f"row ids out of range [0, {self.manifest.count})")
        return faiss_index.gather_rows(self._vectors, rows)

    def get_passages(self, row_ids: Sequence[int]) -> list[Passage]:
        return self._store.get(row_ids)

    @property
    def passage_store(self) -> PassageStore:
        """The passages by row and id (``openbook.index.built_documents`` reads documents
        from it)."""
        return self._store

    def close(self) -> None:
        self._store.close()
        self._faiss = None
        self._bm25 = None
        self._vectors = None
