"""The ``milvus`` engine: openbook indexes and their documents held in Milvus (issue 41).

Read side. :class:`MilvusEngine` opens a Milvus through the official ``pymilvus`` client: a
local path ending in ``.db`` is Milvus Lite in this process (the ``milvus-lite`` package: one
process per data directory), an ``http(s)://host:port`` URI a Milvus server (a cluster, or
``milvus-lite server --data-dir D --host 127.0.0.1 --port P``). Each openbook index is two
collections and one row of the ``openbook_indexes`` collection:

* passages (``<slug>_p``): ``pid`` (primary), ``doc_id``, ``seq`` (the passage's place in its
  document), ``title``, ``text``, ``metadata`` (the document's, JSON), ``terms`` (what a filter
  matches, below) and ``vector`` (the document encoder's, searched by inner product with the
  Milvus index the manifest's ``index_type`` maps to: ``flat`` FLAT, ``hnsw`` HNSW,
  ``hnsw-sq8`` HNSW_SQ);
* documents (``<slug>_d``): a document's title, metadata, version and text, the text in
  chunks of :data:`TEXT_CHUNK_CHARS` (a VARCHAR holds at most 65,535 bytes), one row per chunk;
* ``openbook_indexes``: the index's manifest (encoders, dim, ``score_scale``, views) and its
  ``version``, where every replica reads them.

Every read is at the ``Strong`` consistency level, so a search or read that starts after a
write was acknowledged (by any client of the same Milvus) sees it: read-your-writes.

Filters. A metadata filter (``openbook.metadata_filter``) never puts a user's key or value
into a Milvus expression: each passage carries ``terms``, the sha256 of every (key, typed
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

What this slice does not do yet (issue 41): a BM25 view and hybrid retrieval on Milvus (the
manifest's views are ``["dense"]``), atomic writes across replicas (the version is read and
raised by one writer per process; Milvus has no transactions, so a write that fails half way
can leave some of its passages).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
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
from openbook.index.document_store import StoredDocument
from openbook.index.documents import (
    Document,
    built_document_id,
    check_document_ref,
    document_id_of,
    passage_number,
    passage_page,
    validated_batch,
)
from openbook.index.encoders import Encoder, load_encoder
from openbook.index.engine import (
    DocumentIndex,
    EngineKind,
    IndexType,
    RetrievalMode,
    View,
    check_milvus_uri,
    check_retrieval,
)
from openbook.index.live import MAX_LIST_LIMIT, DocumentNotFound, DocumentPage, WriteResult
from openbook.index.loaded import (
    LoadedIndex,
    check_query_encoder,
    index_query_encoder,
    query_matrix,
)
from openbook.index.manifest import IndexLoadError, Manifest
from openbook.limits import MAX_METADATA_KEYS, check_range
from openbook.metadata_filter import (
    AllOf,
    AnyOf,
    Condition,
    MetadataFilter,
    Node,
    ValueKey,
    record_of,
    value_key,
)
from openbook.types import Passage

KIND = EngineKind.MILVUS
META_COLLECTION = "openbook_indexes"
TEXT_CHUNK_CHARS = 16_000  # <= 64,000 UTF-8 bytes: under a VARCHAR's 65,535
_VARCHAR_MAX = 65_535
_JSON_MAX_BYTES = 65_536
_TERMS = MAX_METADATA_KEYS + 2  # the metadata's keys and the built-in _id and _title
_WRITE_BATCH = 1_000  # rows per insert / upsert request
_SCAN_BATCH = 16_384  # rows per query page (Milvus's largest limit)
_INDEX_TYPES: dict[IndexType, tuple[str, dict[str, Any]]] = {
    IndexType.FLAT: ("FLAT", {}),
    IndexType.HNSW: ("HNSW", {"M": 32, "efConstruction": 128}),
    IndexType.HNSW_SQ8: ("HNSW_SQ", {"M": 32, "efConstruction": 128, "sq_type": "SQ8"}),
}
_HNSW_EF_SEARCH = 128
_PASSAGE_FIELDS = ["pid", "title", "text"]
# Aliases: inside MilvusIndex, ``list`` is its method (the documents API's name).
Fields = list[str]
Rows = list[dict[str, Any]]


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
            raise ValueError(f"a control character (U+{ord(ch):04X}) in an expression string")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


_ESCAPES = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _string_list(values: Iterable[str]) -> str:
    return "[" + ", ".join(milvus_string(v) for v in values) + "]"


def filter_term(key: str, value: ValueKey) -> str:
    """The term a passage whose record holds ``key`` = ``value`` (typed: ``value_key``)
    carries, and a condition on it looks for: a hex digest, so no user text reaches an
    expression."""
    kind, scalar = value
    text = json.dumps([key, kind, scalar], ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def record_terms(record: Mapping[str, Any]) -> list[str]:
    """The terms of a filter record (``record_of``): one per key, of its typed value."""
    return sorted(
        filter_term(key, value_key(value))
        for key, value in record.items()
        if not isinstance(value, list | dict)  # metadata is flat: nothing matches these
    )


def filter_expression(where: MetadataFilter | None) -> str:
    """``where`` as a Milvus boolean expression over ``terms`` ("" for no filter)."""
    return "" if where is None else _node_expression(where.root)


def _node_expression(node: Node) -> str:
    if isinstance(node, Condition):
        terms = sorted(filter_term(node.key, v) for v in node.values)
        return f"array_contains_any(terms, {_string_list(terms)})"
    joiner = " and " if isinstance(node, AllOf) else " or "
    assert isinstance(node, AllOf | AnyOf)
    return "(" + joiner.join(_node_expression(p) for p in node.parts) + ")"


def collection_slug(name: str) -> str:
    """The collections' prefix of index ``name``: Milvus names allow letters, digits and
    ``_`` only, so the name is folded to those and made unique by its digest."""
    folded = re.sub(r"[^A-Za-z0-9_]", "_", name)[:100]
    return f"ob_{folded}_{hashlib.sha256(name.encode()).hexdigest()[:12]}"


def milvus_manifest(manifest: Manifest) -> Manifest:
    """``manifest`` as a Milvus index holds it: the dense view only (no BM25 on this engine
    yet), no files; refused (InvalidArgument) for a type the engine does not offer."""
    if manifest.index_type not in _INDEX_TYPES:
        offered = ", ".join(_INDEX_TYPES)
        raise InvalidArgument(
            f"index_type: {manifest.index_type!r} is not offered by the milvus engine "
            f"(offered: {offered})"
        )
    return dataclasses.replace(
        manifest,
        views=[View.DENSE.value],
        fusion=None,
        files={},
        sizes={},
        checksum="",
        count=0,
        shard=None,
    )


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
            client = MilvusClient(uri=uri, token=token, timeout=timeout_s)
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
        self, name: str, schema: Any, vector: str, index_type: str, params: dict[str, Any]
    ) -> None:
        index = self.client.prepare_index_params()
        index.add_index(field_name=vector, index_type=index_type, metric_type="IP", params=params)
        self.client.create_collection(
            name, schema=schema, index_params=index, consistency_level="Strong"
        )

    def names(self) -> list[str]:
        """The openbook indexes this Milvus holds, sorted."""
        rows = self.client.query(
            META_COLLECTION, filter='name != ""', output_fields=["name"], limit=_SCAN_BATCH
        )
        return sorted(r["name"] for r in rows)

    def create(self, name: str, manifest: Manifest) -> MilvusIndex:
        """A new, empty index ``name`` of ``manifest``'s encoders, dim, type and score scale
        (``empty_base.template_for`` / ``template_of`` make one); AlreadyExists if it is."""
        held = milvus_manifest(dataclasses.replace(manifest, name=name))
        with self._lock:
            if self._meta(name) is not None:
                raise AlreadyExists(f"index {name!r} already exists")
            slug = collection_slug(name)
            self._create_passages(slug + "_p", held)
            self._create_documents(slug + "_d")
            self.client.insert(
                META_COLLECTION,
                [{"name": name, "manifest": held.to_json(), "version": 0, "_v": [0.0, 0.0]}],
            )
        return self.open(name)

    def _create_passages(self, collection: str, manifest: Manifest) -> None:
        s = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        s.add_field("pid", DataType.VARCHAR, is_primary=True, max_length=2048)
        s.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        s.add_field("seq", DataType.INT64)
        s.add_field("title", DataType.VARCHAR, max_length=4096)
        s.add_field("text", DataType.VARCHAR, max_length=_VARCHAR_MAX)
        s.add_field("metadata", DataType.JSON)
        s.add_field(
            "terms", DataType.ARRAY, element_type=DataType.VARCHAR, max_capacity=_TERMS,
            max_length=64,
        )  # fmt: skip
        s.add_field("vector", DataType.FLOAT_VECTOR, dim=manifest.dim)
        index_type, params = _INDEX_TYPES[IndexType(manifest.index_type)]
        self._create(collection, s, "vector", index_type, params)

    def _create_documents(self, collection: str) -> None:
        s = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
        s.add_field("key", DataType.VARCHAR, is_primary=True, max_length=2048)
        s.add_field("doc_id", DataType.VARCHAR, max_length=1024)
        s.add_field("chunk", DataType.INT64)
        s.add_field("title", DataType.VARCHAR, max_length=4096)
        s.add_field("text", DataType.VARCHAR, max_length=_VARCHAR_MAX)
        s.add_field("metadata", DataType.JSON)
        s.add_field("version", DataType.INT64)
        s.add_field("_v", DataType.FLOAT_VECTOR, dim=2)
        self._create(collection, s, "_v", "FLAT", {})

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
        for suffix in ("_p", "_d"):
            if not self.client.has_collection(slug + suffix):
                raise IndexLoadError(f"index {name!r}: collection {slug + suffix} missing")
        fields = {f["name"]: f for f in self.client.describe_collection(slug + "_p")["fields"]}
        dim = fields.get("vector", {}).get("params", {}).get("dim")
        if dim is None or int(dim) != manifest.dim:
            raise IndexLoadError(
                f"index {name!r}: collection {slug}_p vector dim {dim} != manifest dim "
                f"{manifest.dim}"
            )
        return MilvusIndex(self, name, manifest, int(meta["version"]))

    def drop(self, name: str) -> None:
        """Remove index ``name`` (its collections and its row); NotFound if absent."""
        with self._lock:
            if self._meta(name) is None:
                raise NotFound(f"index {name!r} not found in Milvus at {self.uri}")
            slug = collection_slug(name)
            for suffix in ("_p", "_d"):
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
    ) -> MilvusIndex:
        """A new index ``name`` holding the built files index ``source``'s passages with their
        stored vectors (nothing re-encoded), each a passage of the document its id names
        (``built_document_id``, as the files engine adopts a built index), version 0.
        ``index_type``: the Milvus index of the vectors (``flat``, ``hnsw``, ``hnsw-sq8``;
        None: the source's type, refused if Milvus does not offer it here)."""
        if not source.dense:
            raise InvalidArgument(f"index {source.name!r} is bm25: the milvus engine is dense")
        manifest = source.manifest
        if index_type is not None:
            manifest = dataclasses.replace(manifest, index_type=index_type)
        index = self.create(name, manifest)
        docs: dict[str, list[Passage]] = {}
        for start in range(0, len(source), batch):
            rows = range(start, min(start + batch, len(source)))
            passages = source.get_passages(rows)
            vectors = source.get_vectors(list(rows))
            out = []
            for p, v in zip(passages, vectors, strict=True):
                doc_id = built_document_id(p.id)
                seq = len(docs.setdefault(doc_id, []))
                docs[doc_id].append(dataclasses.replace(p, score=0.0, vector=None))
                out.append(index.passage_row(p, doc_id, seq, {}, v))
            self.client.insert(index.passages, out)
        documents = [
            Document(doc_id, ps[0].title, " ".join(p.text for p in ps), {})
            for doc_id, ps in docs.items()
        ]
        for start in range(0, len(documents), batch):
            rows_d = [r for d in documents[start : start + batch] for r in _document_rows(d, 0)]
            self.client.insert(index.documents, rows_d)
        return index

    def close(self) -> None:
        self.client.close()


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


class MilvusIndex:
    """One openbook index held in Milvus: a :class:`~openbook.index.engine.DocumentIndex`.
    Thread-safe; writes through one object are serialised."""

    def __init__(self, engine: MilvusEngine, name: str, manifest: Manifest, version: int) -> None:
        self.engine = engine
        self.client = engine.client
        self._name = name
        self._manifest = manifest
        self._version = version
        slug = collection_slug(name)
        self.passages = slug + "_p"
        self.documents = slug + "_d"
        self._write_lock = threading.Lock()
        self._encoder_lock = threading.Lock()
        self._query_encoder: Encoder | None = None
        self._doc_encoder: Encoder | None = None

    # ------------------------------------------------------------------ manifest facts

    @property
    def name(self) -> str:
        return self._name

    @property
    def manifest(self) -> Manifest:
        return self._manifest

    @property
    def views(self) -> tuple[str, ...]:
        return tuple(self._manifest.views)

    @property
    def default_retrieval(self) -> str:
        return self._manifest.default_retrieval

    @property
    def dense(self) -> bool:
        return self._manifest.dense

    @property
    def version(self) -> int:
        return self._version

    def retrieval_mode(self, retrieval: str | None) -> RetrievalMode:
        return check_retrieval(self.name, self.views, self.default_retrieval, retrieval)

    @property
    def query_encoder(self) -> Encoder:
        with self._encoder_lock:
            if self._query_encoder is None:
                self._query_encoder = index_query_encoder(self.name, self._manifest)
            return self._query_encoder

    def check_encoder(self, encoder: Encoder) -> None:
        check_query_encoder(self.name, self._manifest, encoder)

    def __len__(self) -> int:
        rows = self.client.query(self.passages, filter="", output_fields=["count(*)"])
        return int(rows[0]["count(*)"])

    def __repr__(self) -> str:
        m = self._manifest
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

    def search(
        self,
        queries: Sequence[str],
        k: int,
        encoder: Encoder | None = None,
        return_vectors: bool = False,
        retrieval: str | None = None,
        *,
        query_vectors: np.ndarray | None = None,
        where: MetadataFilter | None = None,
    ) -> list[list[Passage]]:
        """Top-k passages per query, best first; as ``LoadedIndex.search`` (dense only)."""
        if isinstance(queries, str):
            raise TypeError("queries must be a list of strings, not a string")
        self.retrieval_mode(retrieval)  # dense: the one view this engine holds yet
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if not queries:
            return []
        if query_vectors is not None:
            q = np.asarray(query_vectors, dtype=np.float32)
            if q.shape != (len(queries), self._manifest.dim):
                raise ValueError(
                    f"index {self.name!r}: query vectors of shape {q.shape}, expected "
                    f"({len(queries)}, {self._manifest.dim})"
                )
        else:
            enc = encoder or self.query_encoder
            self.check_encoder(enc)
            q = enc.encode(list(queries))
        return self.search_vectors(q, k, return_vectors, where=where)

    def search_vectors(
        self,
        query_vectors: np.ndarray,
        k: int,
        return_vectors: bool = False,
        *,
        where: MetadataFilter | None = None,
    ) -> list[list[Passage]]:
        q = query_matrix(self.name, query_vectors, self._manifest.dim, k)
        if len(q) == 0:
            return []
        params: dict[str, Any] = {"metric_type": "IP"}
        if self._manifest.index_type != IndexType.FLAT:
            ef = int(self._manifest.index_params.get("ef_search", _HNSW_EF_SEARCH))
            params["params"] = {"ef": max(k, ef)}
        fields = _PASSAGE_FIELDS + (["vector"] if return_vectors else [])
        found = self.client.search(
            self.passages,
            data=q.tolist(),
            limit=k,
            filter=filter_expression(where),
            output_fields=fields,
            search_params=params,
            anns_field="vector",
        )
        scale = self._manifest.score_scale
        out: list[list[Passage]] = []
        for hits in found:
            row = []
            for hit in hits:
                e = hit["entity"]
                vector = np.asarray(e["vector"], np.float32) if return_vectors else None
                score = float(hit["distance"]) * scale
                row.append(Passage(e["pid"], e["title"], e["text"], score=score, vector=vector))
            out.append(row)
        return out

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
        numbered = {pid: (document_id_of(pid), passage_number(pid)) for pid in passage_ids}
        docs = sorted({doc for doc, _ in numbered.values()})
        if not docs:
            return {}
        rows = self.client.query(
            self.documents,
            filter=f"chunk == 0 and doc_id in {_string_list(docs)}",
            output_fields=["doc_id", "metadata"],
        )
        metadata = {r["doc_id"]: r["metadata"] or {} for r in rows}
        max_words = self._manifest.max_words
        pages: dict[str, int] = {}
        for pid, (doc, n) in numbered.items():
            meta = metadata.get(doc)
            page = None if meta is None or n is None else passage_page(meta, n, max_words)
            if page is not None:
                pages[pid] = page
        return pages

    def put(self, document: Document) -> WriteResult:
        return self.put_many([document], field="document")

    def put_many(self, documents: Sequence[Document], *, field: str = "documents") -> WriteResult:
        """Insert or replace ``documents`` as one write (one version). Validated as a live
        index validates them; the passages are encoded before anything is written."""
        docs = validated_batch(documents, field)
        max_words = self._manifest.max_words
        for i, doc in enumerate(docs):
            _check_fits(field if field == "document" else f"{field}[{i}]", doc, max_words)
        written: dict[str, tuple[str, ...]] = {}
        rows: Rows = []
        for doc in docs:
            passages = doc.passages(max_words)
            vectors = self._document_encoder().encode(
                [p.text for p in passages], titles=[p.title for p in passages]
            )
            written[doc.id] = tuple(p.id for p in passages)
            rows.extend(
                self.passage_row(p, doc.id, n, doc.metadata, v)
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
    ) -> dict[str, Any]:
        """A row of the passages collection."""
        return {
            "pid": passage.id,
            "doc_id": doc_id,
            "seq": seq,
            "title": passage.title,
            "text": passage.text,
            "metadata": dict(metadata),
            "terms": record_terms(record_of(doc_id, passage.title, metadata)),
            "vector": np.asarray(vector, np.float32).tolist(),
        }

    def _next_version(self) -> int:
        self.catch_up()
        return self._version + 1

    def _set_version(self, version: int) -> None:
        self.client.upsert(
            META_COLLECTION,
            [
                {
                    "name": self.name,
                    "manifest": self._manifest.to_json(),
                    "version": version,
                    "_v": [0.0, 0.0],
                }
            ],
        )
        self._version = version

    def _document_encoder(self) -> Encoder:
        with self._encoder_lock:
            if self._doc_encoder is None:
                m = self._manifest
                assert m.encoder is not None
                enc = load_encoder(m.encoder, role="document")
                if enc.dim != m.dim:
                    raise ValueError(
                        f"index {self.name!r}: document encoder {enc.name!r} dim {enc.dim} "
                        f"!= index dim {m.dim}"
                    )
                self._doc_encoder = enc
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
