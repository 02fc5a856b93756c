"""The ``milvus`` engine: openbook indexes and their documents held in Milvus (issue 41).

Read side. :class:`MilvusEngine` opens a Milvus through the official ``pymilvus`` client: a
local path ending in ``.db`` is Milvus Lite in this process (the ``milvus-lite`` package: one
process per data directory), an ``http(s)://host:port`` URI a Milvus server (a cluster, or
``milvus-lite server --data-dir D --host 127.0.0.1 --port P``). Each openbook index is three
collections and one row of the ``openbook_indexes`` collection:

* passages (``<slug>_p``): ``pid`` (primary), ``doc_id``, ``seq`` (the passage's place in its
  document), ``title``, ``text``, ``metadata`` (the document's, JSON), ``terms`` (what a filter
  matches, below), ``vector`` (the document encoder's, searched by inner product with the
  Milvus index the manifest's ``index_type`` and ``index_params`` map to, ``flat`` FLAT,
  ``hnsw`` HNSW, ``hnsw-sq8`` HNSW_SQ, ``ivfpq`` IVF_PQ: :func:`milvus_index_of`; the
  collection's ``num_shards`` where one was asked for) and ``sparse``, its BM25 view: the
  passage's bm25s weights as a
  sparse vector (``milvus_bm25.py``), searched by inner product (SPARSE_INVERTED_INDEX), so
  ``bm25`` retrieval scores exactly as the files engine's and ``hybrid`` is openbook's
  calibrated fusion of the two views (``fusion.py``: scores, not Milvus's rank fusion);
* documents (``<slug>_d``): a document's title, metadata, version and text, the text in
  chunks of :data:`TEXT_CHUNK_CHARS` (a VARCHAR holds at most 65,535 bytes), one row per chunk;
* BM25 terms (``<slug>_t``): each term dimension's document frequency and one row of the
  index's BM25 statistics, with the state of a fill under way (``begin_fill``: a copy of a
  built files index, ``copy_index``, or a build straight into Milvus, ``milvus_build.py``;
  resumable, not served until complete);
* ``openbook_indexes``: the index's manifest (encoders, dim, ``score_scale``, views) and its
  ``version``, where every replica reads them.

Every read is at the ``Strong`` consistency level, so a search or read that starts after a
write was acknowledged (by any client of the same Milvus) sees it: read-your-writes.

Filters. A metadata filter (``openbook.validation.metadata_filter``) never puts a user's key or
value into a Milvus expression: each passage carries ``terms``, the sha256 of every (key, typed
value) pair of its filter record (``record_of``: metadata with ``_id`` and ``_title``), and a
condition becomes ``array_contains_any(terms, [<hex digests>])`` joined by ``and`` / ``or``.
So matching is exactly ``MetadataFilter.matches``' (typed: ``true`` is not ``1``, ``2018``
is ``2018.0``; a missing key matches nothing), and the expression holds only hex digits,
brackets and keywords. Document ids, the one user string an expression compares
(``get`` / ``delete`` / ``list``), go through :func:`milvus_string`, which escapes them.

Invariants: ``version`` grows by one per acknowledged write; a search returns passages by
``score_scale`` x inner product, best first, as the files engine's flat index does.

Errors. Every call to Milvus goes through :class:`GuardedClient`: a Milvus that cannot be
reached (down, restarting, refusing connections) raises :class:`~openbook.errors.Unavailable`
and one past its deadline :class:`~openbook.errors.DeadlineExceeded`, each naming the URI, so
a service answers UNAVAILABLE / DEADLINE_EXCEEDED (the gateway's 503 / 504), never INTERNAL;
the client reconnects by itself once Milvus is back.

What it does not do (issue 41): atomic writes across replicas (the version is read and raised
by one writer per process; Milvus has no transactions, so a write that fails half way can
leave some of its passages); BM25 statistics that follow the writes (they are the copied
index's, frozen, as a files live index's are until it compacts: ``milvus_bm25.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from pymilvus import DataType, MilvusClient, MilvusException
from pymilvus.client.types import Status

from openbook.errors import (
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    OpenbookError,
    Unavailable,
)
from openbook.index.bm25 import BM25_DIR, build_bm25
from openbook.index.document_store import StoredDocument
from openbook.index.documents import (
    Document,
    built_document_id,
    check_document_ref,
    validated_batch,
)
from openbook.index.encoders import Encoder
from openbook.index.engine import (
    DocumentIndex,
    EngineKind,
    IndexType,
    RetrievalMode,
    View,
    check_milvus_uri,
    pages_of,
)
from openbook.index.faiss_index import default_params
from openbook.index.live import MAX_LIST_LIMIT, DocumentNotFound, DocumentPage, WriteResult
from openbook.index.loaded import LoadedIndex, ManifestFacts, document_encoder
from openbook.index.manifest import IndexLoadError, Manifest
from openbook.index.milvus_bm25 import (
    BM25Statistics,
    SparseVector,
    StoredBM25,
    df_batches,
    passage_terms,
    query_vectors,
    sparse_score,
    term_dim,
)
from openbook.index.request import SearchRequest
from openbook.types import Passage
from openbook.validation import metadata_filter as mf
from openbook.validation.limits import MAX_METADATA_KEYS, check_range

KIND = EngineKind.MILVUS
META_COLLECTION = "openbook_indexes"
TEXT_CHUNK_CHARS = 16_000  # <= 64,000 UTF-8 bytes: under a VARCHAR's 65,535
_VARCHAR_MAX = 65_535
_JSON_MAX_BYTES = 65_536
_TERMS = MAX_METADATA_KEYS + 2  # the metadata's keys and the built-in _id and _title
_WRITE_BATCH = 1_000  # rows per insert / upsert request
_SCAN_BATCH = 16_384  # rows per query page (Milvus's largest limit)
# The Milvus index each dense type is built as (milvus_index_of), and its search parameter.
_INDEX_TYPES: dict[IndexType, str] = {
    IndexType.FLAT: "FLAT",
    IndexType.HNSW: "HNSW",
    IndexType.HNSW_SQ8: "HNSW_SQ",
    IndexType.IVFPQ: "IVF_PQ",
}
_HNSW_EF_SEARCH = 128
# An empty index's IVF-PQ is planned for this many passages (nlist, nbits: default_params).
_PLANNED_PASSAGES = 1_000_000
_SUFFIXES = ("_p", "_d", "_t")  # an index's collections: passages, documents, BM25 terms
_STATS_KEY = -1  # the terms collection's row of the BM25 statistics (term dimensions are > 0)
SPARSE_FIELD = "sparse"
_PASSAGE_FIELDS = ["pid", "title", "text"]
# Aliases: inside MilvusIndex, ``list`` is its method (the documents API's name).
Fields = list[str]
Rows = list[dict[str, Any]]
Hits = list[list[dict[str, Any]]]  # per query, Milvus's hits
SparseVectors = list[SparseVector]


def milvus_string(value: str) -> str:
    """``value`` as a Milvus expression's double-quoted string literal that means exactly
    ``value``: backslash, quote, newline, carriage return and tab escaped (the escapes both
    Milvus's grammar and Milvus Lite's accept). Other control characters are refused (no id
    openbook accepts holds one)."""
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            # a caller's value (an id, a filter's string) that openbook's limits let through
            raise InvalidArgument(f"a control character (U+{ord(ch):04X}) in an expression string")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(milvus_string(v) for v in values) + "]"


def filter_term(key: str, value: mf.ValueKey) -> str:
    """The term a passage whose record holds ``key`` = ``value`` (typed: ``value_key``)
    carries, and a condition on it looks for: a hex digest, so no user text reaches an
    expression."""
    kind, scalar = value
    text = json.dumps([key, kind, scalar], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def record_terms(record: Mapping[str, Any]) -> list[str]:
    """The terms of a filter record (``record_of``): one per key, of its typed value."""
    return sorted(
        filter_term(key, mf.value_key(value))
        for key, value in record.items()
        if not isinstance(value, list | dict)  # metadata is flat: nothing matches these
    )


def filter_expression(where: mf.MetadataFilter | None) -> str:
    """``where`` as a Milvus boolean expression over ``terms`` ("" for no filter)."""
    return "" if where is None else _node_expression(where.root)


def _node_expression(node: mf.Node) -> str:
    if isinstance(node, mf.Condition):
        terms = sorted(filter_term(node.key, v) for v in node.values)
        return f"array_contains_any(terms, {_string_list(terms)})"
    joiner = " and " if isinstance(node, mf.AllOf) else " or "
    assert isinstance(node, mf.AllOf | mf.AnyOf)
    return "(" + joiner.join(_node_expression(p) for p in node.parts) + ")"


def collection_slug(name: str) -> str:
    """The collections' prefix of index ``name``: Milvus names allow letters, digits and
    ``_`` only, so the name is folded to those and made unique by its digest."""
    folded = re.sub(r"[^A-Za-z0-9_]", "_", name)[:100]
    return f"ob_{folded}_{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def milvus_manifest(manifest: Manifest) -> Manifest:
    """``manifest`` as a Milvus index holds it: both views (every passage has its BM25
    weights, milvus_bm25.py), its fusion kept (the scores are the files engine's, so a fusion
    fitted there holds here), its ``index_params`` complete for its type
    (:func:`milvus_index_params`), no files; refused (InvalidArgument) for a type the engine
    does not offer (``bm25``: every index here is dense, its BM25 view beside)."""
    if manifest.index_type not in _INDEX_TYPES:
        offered = ", ".join(_INDEX_TYPES)
        raise InvalidArgument(
            f"index_type: {manifest.index_type!r} is not offered by the milvus engine "
            f"(offered: {offered})"
        )
    return dataclasses.replace(
        manifest,
        index_params=milvus_index_params(manifest),
        views=[View.DENSE.value, View.BM25.value],
        files={},
        sizes={},
        checksum="",
        count=0,
        shard=None,
    )


# The parameter whose absence says a manifest's index_params are another type's (a flat
# index copied as hnsw or ivfpq), so they are made afresh for its type.
_TYPE_PARAM = {IndexType.HNSW: "hnsw_m", IndexType.HNSW_SQ8: "hnsw_m", IndexType.IVFPQ: "nlist"}


def milvus_index_params(manifest: Manifest) -> dict[str, Any]:
    """``manifest``'s ``index_params`` as faiss_index names them, complete for its type: a
    manifest holding another type's (a flat index copied as ``ivfpq``) gets
    ``default_params`` of its type for its passage count (an empty index's IVF-PQ is
    planned for :data:`_PLANNED_PASSAGES`), so Milvus builds what a files build of the same
    spec would (nlist, pq_m, nbits; HNSW's M and efConstruction)."""
    needed = _TYPE_PARAM.get(IndexType(manifest.index_type))
    if needed is None or needed in manifest.index_params:
        return dict(manifest.index_params)
    count = manifest.count or _PLANNED_PASSAGES
    return default_params(manifest.index_type, count, manifest.dim)


def milvus_index_of(manifest: Manifest) -> tuple[str, dict[str, Any]]:
    """The Milvus index type and build parameters of a held manifest's dense view: ``flat``
    FLAT, ``hnsw`` HNSW and ``hnsw-sq8`` HNSW_SQ (M, efConstruction), ``ivfpq`` IVF_PQ
    (nlist, m = pq_m, nbits). Milvus Lite 3.2 builds every one of them but IVF_PQ, which it
    keeps declared and searches exactly (docs/deploy.md)."""
    kind = IndexType(manifest.index_type)
    params = milvus_index_params(manifest)
    if kind is IndexType.IVFPQ:
        built = {"nlist": params["nlist"], "m": params["pq_m"], "nbits": params["nbits"]}
        return _INDEX_TYPES[kind], {k: int(v) for k, v in built.items()}
    if kind in (IndexType.HNSW, IndexType.HNSW_SQ8):
        hnsw: dict[str, Any] = {
            "M": int(params.get("hnsw_m", 32)),
            "efConstruction": int(params.get("ef_construction", 128)),
        }
        if kind is IndexType.HNSW_SQ8:
            hnsw["sq_type"] = "SQ8"
        return _INDEX_TYPES[kind], hnsw
    return _INDEX_TYPES[kind], {}


def milvus_search_params(manifest: Manifest, k: int) -> dict[str, Any]:
    """The dense search's parameters: HNSW's ``ef`` (the manifest's ``ef_search``, at least
    k), IVF's ``nprobe`` (the manifest's), none for FLAT."""
    kind = IndexType(manifest.index_type)
    params = manifest.index_params
    if kind in (IndexType.HNSW, IndexType.HNSW_SQ8):
        return {"ef": max(k, int(params.get("ef_search", _HNSW_EF_SEARCH)))}
    if kind is IndexType.IVFPQ:
        return {"nprobe": int(params.get("nprobe", 16))}
    return {}


def unreachable(exc: BaseException, uri: str) -> OpenbookError | None:
    """What ``exc``, raised by a Milvus call, is to a caller when it says Milvus could not be
    reached (:class:`Unavailable`) or did not answer in time (:class:`DeadlineExceeded`);
    None for any other error (a bug, or a schema problem: it stays what it is)."""
    if isinstance(exc, grpc.RpcError):
        code: Any = exc.code()
    elif isinstance(exc, MilvusException):
        code = exc.code
    else:
        return None
    if code == Status.CONNECT_FAILED or code == grpc.StatusCode.UNAVAILABLE:
        return Unavailable(f"the index engine (Milvus at {uri}) is unavailable: retry later")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceeded(f"the index engine (Milvus at {uri}) did not answer in time")
    return None


# No keepalive pings on an idle connection (pymilvus sends them every 10 s by default): a
# gRPC server of default settings, as Milvus Lite's is, answers a client that pings more
# than every 5 minutes without calls with GOAWAY (too_many_pings), and the next call of every
# client of that URI in the process fails UNAVAILABLE. Pings during a call stay on.
_GRPC_OPTIONS = {"grpc.keepalive_permit_without_calls": False}

# Milvus's CollectionNotLoaded: a Milvus (Lite) started afresh holds its collections released.
_COLLECTION_NOT_LOADED = 101


class GuardedClient:
    """A ``MilvusClient`` whose calls raise openbook's errors where Milvus is down or slow
    (:func:`unreachable`, module docstring); anything else passes through unchanged. A call
    on a collection Milvus holds released (a Milvus Lite restarted, or opened afresh by
    another process) loads it and is made again, once."""

    def __init__(self, client: MilvusClient, uri: str) -> None:
        self._client = client
        self._uri = uri

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._client, name)
        if not callable(attribute):
            return attribute

        @functools.wraps(attribute)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return self._translated(attribute, *args, **kwargs)
            except MilvusException as exc:
                collection = args[0] if args else kwargs.get("collection_name")
                if exc.code != _COLLECTION_NOT_LOADED or not isinstance(collection, str):
                    raise
            self._translated(self._client.load_collection, collection)
            return self._translated(attribute, *args, **kwargs)

        return call

    def _translated(self, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(*args, **kwargs)
        except (MilvusException, grpc.RpcError) as exc:
            mapped = unreachable(exc, self._uri)
            if mapped is None:
                raise
            raise mapped from exc


class MilvusEngine:
    """A connection to one Milvus (module docstring); thread-safe. Opening it reaches Milvus
    (:class:`Unavailable` when it cannot)."""

    def __init__(self, uri: str, *, token: str = "", timeout_s: float | None = 30.0) -> None:
        check_milvus_uri(uri)
        self.uri = uri
        try:
            client = MilvusClient(
                uri=uri, token=token, timeout=timeout_s, grpc_options=_GRPC_OPTIONS
            )
        except (MilvusException, grpc.RpcError) as exc:
            mapped = unreachable(exc, uri)
            if mapped is None:
                raise
            raise mapped from exc
        self.client: Any = GuardedClient(client, uri)
        self._lock = threading.Lock()
        if not self.client.has_collection(META_COLLECTION):
            schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
            schema.add_field("name", DataType.VARCHAR, is_primary=True, max_length=512)
            schema.add_field("manifest", DataType.VARCHAR, max_length=_VARCHAR_MAX)
            schema.add_field("version", DataType.INT64)
            schema.add_field("_v", DataType.FLOAT_VECTOR, dim=2)  # Milvus wants one vector
            self._create(META_COLLECTION, schema, "_v", "FLAT", {})

    def _create(
        self,
        name: str,
        schema: Any,
        vector: str,
        index_type: str,
        params: dict[str, Any],
        *,
        sparse: str | None = None,
        shards: int | None = None,
    ) -> None:
        """Create collection ``name`` (``shards``: its ``num_shards``, None: Milvus's
        default; Milvus Lite keeps one whatever is asked)."""
        index = self.client.prepare_index_params()
        index.add_index(field_name=vector, index_type=index_type, metric_type="IP", params=params)
        if sparse is not None:  # the BM25 view (milvus_bm25.py): ranked by inner product
            index.add_index(field_name=sparse, index_type="SPARSE_INVERTED_INDEX", metric_type="IP")
        sharding = {} if shards is None else {"num_shards": shards}
        self.client.create_collection(
            name, schema=schema, index_params=index, consistency_level="Strong", **sharding
        )

    def names(self) -> list[str]:
        """The openbook indexes this Milvus holds, sorted."""
        rows = self.client.query(
            META_COLLECTION, filter='name != ""', output_fields=["name"], limit=_SCAN_BATCH
        )
        return sorted(r["name"] for r in rows)

    def create(
        self,
        name: str,
        manifest: Manifest,
        *,
        statistics: BM25Statistics | None = None,
        copying: dict[str, Any] | None = None,
        shards: int | None = None,
    ) -> MilvusIndex:
        """A new, empty index ``name`` of ``manifest``'s encoders, dim, type and score scale
        (``empty_base.template_for`` / ``template_of`` make one); AlreadyExists if it is.
        ``statistics``: its BM25 statistics (default: of no passage); ``copying``: the fill
        under way (:meth:`begin_fill`: not served until it is complete); ``shards``: the
        passages collection's ``num_shards`` (None: Milvus's default)."""
        held = milvus_manifest(dataclasses.replace(manifest, name=name))
        with self._lock:
            if self._meta(name) is not None:
                raise AlreadyExists(f"index {name!r} already exists")
            slug = collection_slug(name)
            self._create_passages(slug + "_p", held, shards)
            self._create_documents(slug + "_d")
            self._create_terms(slug + "_t")
            stats = (statistics or BM25Statistics.empty()).to_dict()
            self._set_stats(slug + "_t", {**stats, "copying": copying})
            self.client.insert(
                META_COLLECTION,
                [{"name": name, "manifest": held.to_json(), "version": 0, "_v": [0.0, 0.0]}],
            )
        if copying is not None:  # not served until the copy completes
            return MilvusIndex(self, name, held, 0)
        return self.open(name)

    @staticmethod
    def _pieces_schema(key: str, position: str) -> Any:
        """The schema of a collection of pieces of documents (the passages', the documents'
        chunks): the piece's primary ``key``, its document, its ``position`` in it, its
        title, text and metadata; one size for each in both, so what fits one fits the
        other. The caller adds its own fields after these."""
        s = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        s.add_field(key, DataType.VARCHAR, is_primary=True, max_length=2048)
        s.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        s.add_field(position, DataType.INT64)
        s.add_field("title", DataType.VARCHAR, max_length=4096)
        s.add_field("text", DataType.VARCHAR, max_length=_VARCHAR_MAX)
        s.add_field("metadata", DataType.JSON)
        return s

    def _create_passages(self, collection: str, manifest: Manifest, shards: int | None) -> None:
        s = self._pieces_schema("pid", "seq")
        s.add_field(
            "terms", DataType.ARRAY, element_type=DataType.VARCHAR, max_capacity=_TERMS,
            max_length=64,
        )  # fmt: skip
        s.add_field("vector", DataType.FLOAT_VECTOR, dim=manifest.dim)
        s.add_field(SPARSE_FIELD, DataType.SPARSE_FLOAT_VECTOR)
        index_type, params = milvus_index_of(manifest)
        self._create(
            collection, s, "vector", index_type, params, sparse=SPARSE_FIELD, shards=shards
        )

    def _create_terms(self, collection: str) -> None:
        """The BM25 statistics (milvus_bm25.BM25Statistics): a row per term dimension with
        its document frequency, and the row :data:`_STATS_KEY` with the rest (and the state
        of a copy still under way)."""
        s = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        s.add_field("h", DataType.INT64, is_primary=True)
        s.add_field("df", DataType.INT64)
        s.add_field("stats", DataType.JSON)
        s.add_field("_v", DataType.FLOAT_VECTOR, dim=2)
        self._create(collection, s, "_v", "FLAT", {})

    def _create_documents(self, collection: str) -> None:
        s = self._pieces_schema("key", "chunk")
        s.add_field("version", DataType.INT64)
        s.add_field("_v", DataType.FLOAT_VECTOR, dim=2)
        self._create(collection, s, "_v", "FLAT", {})

    def _set_stats(self, terms: str, stats: dict[str, Any]) -> None:
        self.client.upsert(terms, [{"h": _STATS_KEY, "df": 0, "stats": stats, "_v": [0.0, 0.0]}])

    def stats(self, name: str) -> dict[str, Any]:
        """Index ``name``'s BM25 statistics row (and ``copying``: a fill under way, or None)."""
        rows = self.client.query(
            collection_slug(name) + "_t", filter=f"h == {_STATS_KEY}", output_fields=["stats"]
        )
        if not rows:
            raise IndexLoadError(f"index {name!r}: its BM25 statistics are missing")
        return dict(rows[0]["stats"])

    def _meta(self, name: str) -> dict[str, Any] | None:
        rows = self.client.query(
            META_COLLECTION,
            filter=f"name == {milvus_string(name)}",
            output_fields=["manifest", "version"],
        )
        return dict(rows[0]) if rows else None

    def describe(self, name: str) -> tuple[Manifest, int] | None:
        """Index ``name``'s manifest and version as every replica reads them; None if this
        Milvus holds no such index. Opens nothing (a listing reads it)."""
        meta = self._meta(name)
        if meta is None:
            return None
        return Manifest(**json.loads(meta["manifest"])), int(meta["version"])

    def open(self, name: str) -> MilvusIndex:
        """The index ``name``; NotFound if this Milvus holds none, IndexLoadError if its
        collections do not match its manifest (as a corrupt files index is refused)."""
        meta = self._meta(name)
        if meta is None:
            raise NotFound(f"index {name!r} not found in Milvus at {self.uri}")
        manifest = Manifest(**json.loads(meta["manifest"]))
        slug = collection_slug(name)
        for suffix in _SUFFIXES:
            if not self.client.has_collection(slug + suffix):
                raise IndexLoadError(f"index {name!r}: collection {slug + suffix} missing")
        fields = {f["name"]: f for f in self.client.describe_collection(slug + "_p")["fields"]}
        dim = fields.get("vector", {}).get("params", {}).get("dim")
        if dim is None or int(dim) != manifest.dim:
            raise IndexLoadError(
                f"index {name!r}: collection {slug}_p vector dim {dim} != manifest dim "
                f"{manifest.dim}"
            )
        if SPARSE_FIELD not in fields:
            raise IndexLoadError(f"index {name!r}: collection {slug}_p has no BM25 view")
        copying = self.stats(name).get("copying")
        if copying:
            how = copying.get("resume_with", "run the copy again")
            raise IndexLoadError(
                f"index {name!r}: its copy from {copying.get('source')} is under way or was "
                f"cut short ({copying.get('done', 0)} of {copying.get('passages')} passages): "
                f"{how} to finish it"
            )
        return MilvusIndex(self, name, manifest, int(meta["version"]))

    def drop(self, name: str) -> None:
        """Remove index ``name`` (its collections and its row); NotFound if absent."""
        with self._lock:
            if self._meta(name) is None:
                raise NotFound(f"index {name!r} not found in Milvus at {self.uri}")
            slug = collection_slug(name)
            for suffix in _SUFFIXES:
                if self.client.has_collection(slug + suffix):
                    self.client.drop_collection(slug + suffix)
            self.client.delete(META_COLLECTION, filter=f"name == {milvus_string(name)}")

    def copy_index(
        self,
        name: str,
        source: LoadedIndex,
        *,
        batch: int = _WRITE_BATCH,
        index_type: str | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> CopyResult:
        """Index ``name`` holding the built files index ``source``'s passages with their
        stored vectors (nothing re-encoded) and BM25 weights (milvus_bm25.py), each a passage
        of the document its id names (``built_document_id``, as the files engine adopts a
        built index), version 0. ``index_type``: the Milvus index of the vectors (``flat``,
        ``hnsw``, ``hnsw-sq8``, ``ivfpq``; None: the source's type). ``progress(done,
        total)``: after each batch of passages.

        Resumable (:meth:`begin_fill`, keyed by the source's checksum): a copy cut short
        (killed, Milvus gone) is finished by calling this again with the same source, from
        its last recorded batch. AlreadyExists for a complete index of that name, or one
        being filled from another source."""
        if not source.dense:
            raise InvalidArgument(f"index {source.name!r} is bm25: the milvus engine is dense")
        manifest = source.manifest
        if index_type is not None and index_type != manifest.index_type:
            # another type's parameters: milvus_index_params makes this type's for its count
            manifest = dataclasses.replace(manifest, index_type=index_type, index_params={})
        milvus_manifest(manifest)  # a type Milvus does not offer: refused before any work
        total = len(source)
        fill = self.begin_fill(
            name,
            manifest,
            _stored_bm25(source),
            FillSource(str(source.path), source.manifest.checksum, total),
        )
        for first in range(fill.resumed_at - fill.resumed_at % batch, total, batch):
            rows = range(first, min(first + batch, total))
            fill.write(first, source.get_passages(rows), source.get_vectors(list(rows)))
            if progress is not None:
                progress(rows.stop, total)
        passages = (
            source.get_passages(range(first, min(first + batch, total)))
            for first in range(0, total, batch)
        )
        return CopyResult(fill.finish(passages), resumed_at=fill.resumed_at)

    def begin_fill(
        self,
        name: str,
        manifest: Manifest,
        bm25: StoredBM25,
        source: FillSource,
        *,
        shards: int | None = None,
    ) -> IndexFill:
        """Start, or resume, filling index ``name`` (of ``manifest``'s encoders, type and
        scale) with ``source.passages`` passages whose BM25 weights ``bm25`` holds: a copy
        (:meth:`copy_index`) or a build (``milvus_build.py``).

        The index records the fill under way in its BM25 terms row (``copying``: the source,
        its key, the passages written after each batch) and is not served until
        :meth:`IndexFill.finish`. An index of that name under way from the same source (the
        same ``key``) is resumed: :attr:`IndexFill.resumed_at` is the passage its last
        recorded batch ended at. AlreadyExists for a complete index of that name, or one
        under way from another source."""
        copying = {
            "source": source.source,
            "checksum": source.key,
            "passages": source.passages,
            "done": 0,
            "resume_with": source.resume_with,
        }
        if self._meta(name) is None:
            self.create(name, manifest, statistics=bm25.statistics, copying=copying, shards=shards)
            done = 0
        else:
            under_way = self.stats(name).get("copying")
            if not under_way or under_way.get("checksum") != copying["checksum"]:
                raise AlreadyExists(f"index {name!r} already exists")
            done = int(under_way.get("done", 0))
        described = self.describe(name)
        assert described is not None
        terms = collection_slug(name) + "_t"
        # The BM25 statistics first (upserts: a resumed fill writes them again).
        for pairs in df_batches(bm25.df, _WRITE_BATCH):
            rows = [{"h": h, "df": n, "stats": {}, "_v": [0.0, 0.0]} for h, n in pairs]
            self.client.upsert(terms, rows)
        index = MilvusIndex(self, name, described[0], 0)
        return IndexFill(self, index, bm25, copying, done)

    def close(self) -> None:
        self.client.close()


@dataclasses.dataclass(frozen=True)
class FillSource:
    """What fills an index (:meth:`MilvusEngine.begin_fill`): ``source`` names it to people,
    ``key`` identifies it (a fill is resumed only from the same key: a source index's
    checksum, a build's fingerprint), ``passages`` is how many it holds, ``resume_with`` what
    finishes it when it was cut short (said when the index is refused meanwhile)."""

    source: str
    key: str
    passages: int
    resume_with: str = "run the copy again"


class IndexFill:
    """An index being filled in batches of consecutive passages (:meth:`MilvusEngine.
    begin_fill`). Invariant: ``copying.done`` in Milvus is only raised after every passage
    below it was written, so a resumed fill that starts at or below it doubles nothing
    (rows are upserted by passage id) and misses nothing."""

    def __init__(
        self,
        engine: MilvusEngine,
        index: MilvusIndex,
        bm25: StoredBM25,
        copying: dict[str, Any],
        resumed_at: int,
    ) -> None:
        self.engine, self.index, self.bm25 = engine, index, bm25
        self._copying = copying
        self.resumed_at = resumed_at

    def write(self, first: int, passages: Sequence[Passage], vectors: np.ndarray) -> None:
        """Passages ``first ..`` with their document vectors (float32 ``(n, dim)``) and
        their stored BM25 weights, then record them done."""
        rows = range(first, first + len(passages))
        sparse = self.bm25.vectors(rows.start, rows.stop)
        out = [
            self.index.passage_row(p, built_document_id(p.id), row, {}, v, sp)
            for row, p, v, sp in zip(rows, passages, vectors, sparse, strict=True)
        ]
        for start in range(0, len(out), _WRITE_BATCH):
            self.engine.client.upsert(self.index.passages, out[start : start + _WRITE_BATCH])
        self._copying["done"] = rows.stop
        self._record(self._copying)

    def finish(self, passages: Iterable[Sequence[Passage]]) -> MilvusIndex:
        """Write the documents of every passage (``passages``: all of them again, in row
        order, in batches; upserts), mark the fill complete and return the index, now served.

        Streamed: a document is a run of consecutive passages of the id it names (a build
        writes the pieces of a row one after the other), written a batch of documents at a
        time; one whose passages come in several runs gets the text of all of them, in row
        order (its text so far read back). Memory: one batch and the ids written."""
        written: set[str] = set()
        pending: list[Document] = []
        run: list[Passage] = []
        for chunk in passages:
            for p in chunk:
                if run and built_document_id(p.id) != built_document_id(run[0].id):
                    pending.append(_built_document(run))
                    run = []
                    if len(pending) >= _WRITE_BATCH:
                        self._write_documents(pending, written)
                        pending = []
                run.append(p)
        if run:
            pending.append(_built_document(run))
        self._write_documents(pending, written)
        self._record(None)
        return self.engine.open(self.index.name)

    def _write_documents(self, documents: Sequence[Document], written: set[str]) -> None:
        """Upsert ``documents``, each joined to the text written before under its id
        (``written``: the ids this fill has written; raised by these)."""
        merged: dict[str, Document] = {}
        for doc in documents:
            earlier = merged.get(doc.id)
            if earlier is None and doc.id in written:
                earlier = self.index.get(doc.id).document
            merged[doc.id] = doc if earlier is None else _joined(earlier, doc)
        rows = [r for d in merged.values() for r in _document_rows(d, 0)]
        for start in range(0, len(rows), _WRITE_BATCH):
            self.engine.client.upsert(self.index.documents, rows[start : start + _WRITE_BATCH])
        written.update(merged)

    def _record(self, copying: dict[str, Any] | None) -> None:
        stats = {**self.bm25.statistics.to_dict(), "copying": copying}
        self.engine._set_stats(self.index.terms, stats)


@dataclasses.dataclass(frozen=True)
class CopyResult:
    """A copied index, and the passage its copy resumed at (0: copied from the start)."""

    index: MilvusIndex
    resumed_at: int


# The files engine's live layer solves avgdl from an index's first 16 passages (live.py).
AVGDL_SAMPLE = 16


def stored_bm25(bm25_dir: Path, first: Sequence[Passage]) -> StoredBM25:
    """The BM25 view written at ``bm25_dir`` (``bm25.build_bm25``) read for a fill;
    ``first``: the index's first :data:`AVGDL_SAMPLE` passages (fewer in a smaller index)."""
    sample = [(i, p.title, p.text) for i, p in enumerate(first[:AVGDL_SAMPLE])]
    return StoredBM25(bm25_dir, sample)


def _stored_bm25(source: LoadedIndex) -> StoredBM25:
    """The BM25 weights and statistics of ``source``: its own BM25 view's, or, for an index
    built without one, those bm25s gives its passages (indexed here, as a build would)."""
    first = source.get_passages(range(min(len(source), AVGDL_SAMPLE)))
    if View.BM25 in source.views:
        return stored_bm25(source.path / BM25_DIR, first)
    with tempfile.TemporaryDirectory(prefix="openbook-bm25-") as tmp:
        texts = [
            f"{p.title} {p.text}"
            for start in range(0, len(source), _WRITE_BATCH)
            for p in source.get_passages(range(start, min(start + _WRITE_BATCH, len(source))))
        ]
        build_bm25(texts, Path(tmp))
        return stored_bm25(Path(tmp), first)


def _built_document(passages: Sequence[Passage]) -> Document:
    """The document a built index's consecutive passages of one document id make."""
    first = passages[0]
    text = " ".join(p.text for p in passages)
    return Document(built_document_id(first.id), first.title, text, {})


def _joined(earlier: Document, later: Document) -> Document:
    """A built document whose passages came in two runs: the text of both, in row order."""
    return Document(earlier.id, earlier.title, f"{earlier.text} {later.text}", {})


def _document_rows(doc: Document, version: int) -> list[dict[str, Any]]:
    text = doc.text
    chunks = [text[i : i + TEXT_CHUNK_CHARS] for i in range(0, len(text), TEXT_CHUNK_CHARS)]
    return [
        {
            "key": json.dumps([doc.id, n]),
            "doc_id": doc.id,
            "chunk": n,
            "title": doc.title,
            "text": chunk,
            "metadata": dict(doc.metadata) if n == 0 else {},
            "version": version,
            "_v": [0.0, 0.0],
        }
        for n, chunk in enumerate(chunks or [""])
    ]


class MilvusIndex(ManifestFacts):
    """One openbook index held in Milvus: a :class:`~openbook.index.engine.DocumentIndex`.
    Thread-safe; writes through one object are serialised. Its manifest facts (views, query
    encoder, fusion) are answered as a files index answers them (``loaded.ManifestFacts``)."""

    def __init__(self, engine: MilvusEngine, name: str, manifest: Manifest, version: int) -> None:
        self.engine = engine
        self.client = engine.client
        self.name = name
        self.manifest = manifest
        self._version = version
        slug = collection_slug(name)
        self.passages = slug + "_p"
        self.documents = slug + "_d"
        self.terms = slug + "_t"
        self._write_lock = threading.Lock()
        self._encoder_lock = threading.Lock()
        self._encoder: Encoder | None = None  # the query encoder (ManifestFacts)
        self._doc_encoder: Encoder | None = None

    @property
    def version(self) -> int:
        return self._version

    def __len__(self) -> int:
        rows = self.client.query(self.passages, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def __repr__(self) -> str:
        m = self.manifest
        return f"MilvusIndex({self.name!r}, {m.index_type}, dim={m.dim}, version={self.version})"

    def catch_up(self) -> bool:
        meta = self.engine._meta(self.name)
        if meta is None:
            raise NotFound(f"index {self.name!r} is no longer in Milvus")
        version = int(meta["version"])
        changed, self._version = version != self._version, version
        return changed

    def close(self) -> None:
        """Nothing to release: the engine's client is shared."""

    # ------------------------------------------------------------------ search

    def search(self, request: SearchRequest, encoder: Encoder | None = None) -> list[list[Passage]]:
        """Top-k passages per query, best first, as ``LoadedIndex.search``: ``dense`` by
        ``score_scale`` x inner product, ``bm25`` by the raw BM25 score (the sparse view,
        milvus_bm25.py), ``hybrid`` by the fused score of both (``fusion.py``: the union of
        each view's top N, both features exact for every candidate)."""
        mode = request.mode_on(self, encoder)
        if request.n == 0:
            return []
        k, return_vectors, where = request.k, request.return_vectors, request.where
        if mode is RetrievalMode.BM25:
            return self._bm25_search(list(request.queries), k, return_vectors, where)
        q = request.dense_queries(self, encoder)
        if mode is RetrievalMode.DENSE:
            return self._dense_search(q, k, return_vectors, where)
        return self._hybrid_search(list(request.queries), q, k, return_vectors, where)

    def _bm25_search(
        self, queries: list[str], k: int, return_vectors: bool, where: mf.MetadataFilter | None
    ) -> list[list[Passage]]:
        """BM25 top-k: raw BM25 scores (the bm25 view of a dense index, as the files
        engine serves it); a passage sharing no term with the query is no hit."""
        hits = self._sparse_hits(queries, k, return_vectors, where)
        return [
            [self._passage(h["entity"], float(h["distance"]), return_vectors) for h in row]
            for row in hits
        ]

    def _sparse_hits(
        self, queries: list[str], n: int, with_fields: bool, where: mf.MetadataFilter | None
    ) -> Hits:
        """Each query's top ``n`` hits of the sparse view (score > 0)."""
        vectors = query_vectors(queries)
        asked = [i for i, v in enumerate(vectors) if v]  # stop words only: nothing to match
        out: Hits = [[] for _ in queries]
        if not asked:
            return out
        fields = _PASSAGE_FIELDS + (["vector", SPARSE_FIELD] if with_fields else [])
        found = self.client.search(
            self.passages,
            data=[vectors[i] for i in asked],
            limit=n,
            filter=filter_expression(where),
            output_fields=fields,
            search_params={"metric_type": "IP"},
            anns_field=SPARSE_FIELD,
        )
        for i, hits in zip(asked, found, strict=True):
            out[i] = [h for h in hits if float(h["distance"]) > 0]
        return out

    def _hybrid_search(
        self,
        queries: list[str],
        q: np.ndarray,
        k: int,
        return_vectors: bool,
        where: mf.MetadataFilter | None,
    ) -> list[list[Passage]]:
        """The files engine's hybrid search (``LoadedIndex._candidates`` and
        ``fusion.top_k``): the union of the dense and the BM25 top N (dense's first), each
        candidate's exact inner product with its stored vector (float64, rounded once to
        float32) and exact BM25 score, fused, the top k by the fused score."""
        fusion = self.fusion
        n = max(k, fusion.candidates)
        dense_hits = self._dense_hits(q, n, True, where)
        sparse_hits = self._sparse_hits(queries, n, True, where)
        sparse_queries = query_vectors(queries)
        out: list[list[Passage]] = []
        for i in range(len(queries)):
            candidates: dict[str, dict[str, Any]] = {}
            for hit in (*dense_hits[i], *sparse_hits[i]):
                candidates.setdefault(hit["entity"]["pid"], hit["entity"])
            entities = list(candidates.values())
            if not entities:
                out.append([])
                continue
            vectors = np.asarray([e["vector"] for e in entities], dtype=np.float64)
            dense = (vectors @ q[i].astype(np.float64)).astype(np.float32)
            bm25 = np.asarray(
                [sparse_score(sparse_queries[i], e[SPARSE_FIELD]) for e in entities],
                dtype=np.float32,
            )
            fused = fusion.score(dense, bm25)
            order = np.argsort(-fused, kind="stable")[:k]
            out.append([self._passage(entities[j], float(fused[j]), return_vectors) for j in order])
        return out

    @staticmethod
    def _passage(entity: dict[str, Any], score: float, return_vectors: bool) -> Passage:
        vector = np.asarray(entity["vector"], np.float32) if return_vectors else None
        return Passage(entity["pid"], entity["title"], entity["text"], score=score, vector=vector)

    def _dense_search(
        self, q: np.ndarray, k: int, return_vectors: bool, where: mf.MetadataFilter | None
    ) -> list[list[Passage]]:
        """Dense top-k per query vector of ``q`` ``(n, dim)``, re-ranked as the manifest says."""
        scale = self.manifest.score_scale
        factor = int(self.manifest.index_params.get("rerank", 0) or 0)
        if factor > 1 and self.manifest.index_type != IndexType.FLAT:
            return self._reranked(q, k, k * factor, return_vectors, where)
        return [
            [self._passage(h["entity"], float(h["distance"]) * scale, return_vectors) for h in row]
            for row in self._dense_hits(q, k, return_vectors, where)
        ]

    def _reranked(
        self,
        q: np.ndarray,
        k: int,
        n: int,
        return_vectors: bool,
        where: mf.MetadataFilter | None,
    ) -> list[list[Passage]]:
        """The manifest's ``rerank``, as the files engine applies it to an approximate type:
        the approximate top ``n`` (an IVF-PQ's distances are its codes', not the vectors')
        re-scored exactly with their stored vectors, the top k of those."""
        scale = self.manifest.score_scale
        out: list[list[Passage]] = []
        for i, hits in enumerate(self._dense_hits(q, n, True, where)):
            if not hits:
                out.append([])
                continue
            vectors = np.asarray([h["entity"]["vector"] for h in hits], dtype=np.float64)
            exact = (vectors @ q[i].astype(np.float64)).astype(np.float32)
            order = np.argsort(-exact, kind="stable")[:k]
            out.append(
                [
                    self._passage(hits[j]["entity"], float(exact[j]) * scale, return_vectors)
                    for j in order
                ]
            )
        return out

    def _dense_hits(
        self, q: np.ndarray, k: int, with_fields: bool, where: mf.MetadataFilter | None
    ) -> Hits:
        """Each query vector's top ``k`` hits of the dense view (inner products)."""
        params: dict[str, Any] = {"metric_type": "IP"}
        if tuned := milvus_search_params(self.manifest, k):
            params["params"] = tuned
        fields = _PASSAGE_FIELDS + (["vector", SPARSE_FIELD] if with_fields else [])
        found = self.client.search(
            self.passages,
            data=q.tolist(),
            limit=k,
            filter=filter_expression(where),
            output_fields=fields,
            search_params=params,
            anns_field="vector",
        )
        return [list(hits) for hits in found]

    # ------------------------------------------------------------------ documents

    def get(self, doc_id: str) -> StoredDocument:
        check_document_ref("id", doc_id)
        key = milvus_string(doc_id)
        chunks = self.client.query(
            self.documents,
            filter=f"doc_id == {key}",
            output_fields=["chunk", "title", "text", "metadata", "version"],
        )
        if not chunks:
            raise DocumentNotFound(f"document {doc_id!r} not found in index {self.name!r}")
        chunks.sort(key=lambda r: int(r["chunk"]))
        first = chunks[0]
        text = "".join(r["text"] for r in chunks)
        passages = self.client.query(
            self.passages, filter=f"doc_id == {key}", output_fields=["pid", "seq"]
        )
        pids = tuple(r["pid"] for r in sorted(passages, key=lambda r: int(r["seq"])))
        document = Document(doc_id, first["title"], text, dict(first["metadata"] or {}))
        return StoredDocument(document, pids, int(first["version"]))

    def list(self, cursor: str | None = None, limit: int = 100) -> DocumentPage:
        """A page of document ids in id order after ``cursor``. Milvus returns rows in no
        order, so every id above the cursor is read and sorted (a slice: paging by a sorted
        scalar index is left to do)."""
        check_range("limit", limit, 1, MAX_LIST_LIMIT)
        if cursor is not None and not isinstance(cursor, str):
            raise InvalidArgument("cursor must be a string")
        expr = (
            "chunk == 0" if cursor is None else f"chunk == 0 and doc_id > {milvus_string(cursor)}"
        )
        ids = sorted(r["doc_id"] for r in self._scan(self.documents, expr, ["doc_id"]))
        page = ids[:limit]
        return DocumentPage(tuple(page), page[-1] if len(ids) > limit else None)

    def _scan(self, collection: str, expr: str, fields: Fields) -> Iterator[dict[str, Any]]:
        offset = 0
        while True:
            rows = self.client.query(
                collection, filter=expr, output_fields=fields, limit=_SCAN_BATCH, offset=offset
            )
            yield from rows
            if len(rows) < _SCAN_BATCH:
                return
            offset += len(rows)

    def passage_pages(self, passage_ids: Iterable[str]) -> dict[str, int]:
        return pages_of(passage_ids, self.manifest.max_words, self._metadata)

    def _metadata(self, doc_ids: Sequence[str]) -> dict[str, dict[str, Any]]:
        """The metadata of those of ``doc_ids`` that are live (their first chunk's)."""
        rows = self.client.query(
            self.documents,
            filter=f"chunk == 0 and doc_id in {_string_list(doc_ids)}",
            output_fields=["doc_id", "metadata"],
        )
        return {r["doc_id"]: r["metadata"] or {} for r in rows}

    def put(self, document: Document) -> WriteResult:
        return self.put_many([document], field="document")

    def put_many(self, documents: Sequence[Document], *, field: str = "documents") -> WriteResult:
        """Insert or replace ``documents`` as one write (one version). Validated as a live
        index validates them; the passages are encoded before anything is written."""
        docs = validated_batch(documents, field)
        max_words = self.manifest.max_words
        for i, doc in enumerate(docs):
            _check_fits(field if field == "document" else f"{field}[{i}]", doc, max_words)
        written: dict[str, tuple[str, ...]] = {}
        rows: Rows = []
        split = [(doc, doc.passages(max_words)) for doc in docs]
        sparse: Iterator[SparseVector] = iter(
            self._bm25_vectors([p for _, ps in split for p in ps])
        )
        for doc, passages in split:
            vectors = self._document_encoder().encode(
                [p.text for p in passages], titles=[p.title for p in passages]
            )
            written[doc.id] = tuple(p.id for p in passages)
            rows.extend(
                self.passage_row(p, doc.id, n, doc.metadata, v, next(sparse))
                for n, (p, v) in enumerate(zip(passages, vectors, strict=True))
            )
        with self._write_lock:
            version = self._next_version()
            ids = _string_list(written)
            old = self._scan(self.passages, f"doc_id in {ids}", ["pid"])
            stale = {r["pid"] for r in old} - {pid for pids in written.values() for pid in pids}
            for start in range(0, len(rows), _WRITE_BATCH):
                self.client.upsert(self.passages, rows[start : start + _WRITE_BATCH])
            if stale:
                self.client.delete(self.passages, filter=f"pid in {_string_list(sorted(stale))}")
            for doc in docs:
                chunks = _document_rows(doc, version)
                self.client.upsert(self.documents, chunks)
                self.client.delete(
                    self.documents,
                    filter=f"doc_id == {milvus_string(doc.id)} and chunk >= {len(chunks)}",
                )
            self._set_version(version)
        return WriteResult(version, written)

    def delete(self, doc_id: str) -> WriteResult:
        check_document_ref("id", doc_id)
        key = milvus_string(doc_id)
        with self._write_lock:
            found = self.client.query(
                self.documents, filter=f"doc_id == {key} and chunk == 0", output_fields=["key"]
            )
            if not found:
                raise DocumentNotFound(f"document {doc_id!r} not found in index {self.name!r}")
            version = self._next_version()
            self.client.delete(self.passages, filter=f"doc_id == {key}")
            self.client.delete(self.documents, filter=f"doc_id == {key}")
            self._set_version(version)
        return WriteResult(version)

    def passage_row(
        self,
        passage: Passage,
        doc_id: str,
        seq: int,
        metadata: Mapping[str, Any],
        vector: np.ndarray,
        sparse: SparseVector,
    ) -> dict[str, Any]:
        """A row of the passages collection (``sparse``: its BM25 weights)."""
        return {
            "pid": passage.id,
            "doc_id": doc_id,
            "seq": seq,
            "title": passage.title,
            "text": passage.text,
            "metadata": dict(metadata),
            "terms": record_terms(mf.record_of(doc_id, passage.title, metadata)),
            "vector": np.asarray(vector, np.float32).tolist(),
            SPARSE_FIELD: sparse,
        }

    def _bm25_vectors(self, passages: Sequence[Passage]) -> SparseVectors:
        """New passages' BM25 weights, with the index's statistics (milvus_bm25.py): their
        terms' document frequencies read from Milvus; an index of no passage yet takes this
        write's mean passage length for avgdl, kept for later writes."""
        terms = [passage_terms(p.title, p.text) for p in passages]
        if not terms:
            return []
        raw = self.engine.stats(self.name)
        statistics = BM25Statistics.from_dict(raw)
        avgdl = statistics.avgdl
        if avgdl is None:
            avgdl = float(np.mean([t.length for t in terms])) or 1.0
            self.engine._set_stats(self.terms, {**raw, "avgdl": avgdl})
        dims = sorted({term_dim(t) for p in terms for t in p.counts})
        df: dict[int, int] = {}
        for first in range(0, len(dims), _SCAN_BATCH):
            chunk = dims[first : first + _SCAN_BATCH]
            found = self.client.query(
                self.terms, filter=f"h in {chunk}", output_fields=["h", "df"], limit=len(chunk)
            )
            df.update({int(r["h"]): int(r["df"]) for r in found})
        return statistics.vectors(terms, df, avgdl)

    def _next_version(self) -> int:
        self.catch_up()
        return self._version + 1

    def _set_version(self, version: int) -> None:
        self.client.upsert(
            META_COLLECTION,
            [
                {
                    "name": self.name,
                    "manifest": self.manifest.to_json(),
                    "version": version,
                    "_v": [0.0, 0.0],
                }
            ],
        )
        self._version = version

    def _document_encoder(self) -> Encoder:
        with self._encoder_lock:
            if self._doc_encoder is None:
                self._doc_encoder = document_encoder(self.name, self.manifest)
            return self._doc_encoder


def _check_fits(at: str, doc: Document, max_words: int) -> None:
    """What Milvus's field sizes refuse that openbook's limits let through."""
    if len(json.dumps(dict(doc.metadata), ensure_ascii=False).encode()) > _JSON_MAX_BYTES:
        raise InvalidArgument(f"{at}.metadata: at most {_JSON_MAX_BYTES} bytes as JSON here")
    for p in doc.passages(max_words):
        if len(p.text.encode()) > _VARCHAR_MAX:
            raise InvalidArgument(f"{at}.text: a passage of over {_VARCHAR_MAX} bytes")


# Conformance, checked by mypy.
ENGINE_INDEX: type[DocumentIndex] = MilvusIndex

__all__ = [
    "ENGINE_INDEX",
    "KIND",
    "MilvusEngine",
    "MilvusIndex",
    "check_milvus_uri",
    "filter_expression",
    "milvus_string",
]
