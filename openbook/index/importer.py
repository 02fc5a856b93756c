"""import_embeddings: an index from DPR's ``psgs_w100.tsv`` + precomputed vectors, no encoding.

Write side.

It is ``build_index`` with a different vector source: the same partial directory, passage
store, resumable ``.npy`` shards, faiss stage, manifest and atomic rename (see ``build.py``).
Only the shards' contents come from embedding files (``embedding_files.py``) instead of an
encoder.

Invariants:
  * Row ``r`` of the index is row ``r`` of the passages file and the ``r``-th vector across the
    embedding files (taken in natural order: ``_2`` before ``_10``). Each vector's id must be
    that passage's id, either as is or after a ``prefix:`` (DPR writes ``wiki:1`` for ``1``).
    This is the order DPR and ``wiki_dpr`` publish in; any other order is an error, not
    silently reordered.
  * Memory is one embedding batch (or one pickle file, which cannot be read partially) plus
    one vector shard, whatever the corpus size: vectors go to disk shard by shard.
  * Bad input (unreadable file, unknown or missing id, a passage without a vector, more
    vectors than passages, mixed dimensions) raises :class:`EmbeddingsError` naming the file,
    and the partial directory is removed: nothing is left that could be mistaken for an index.
    Any other interruption keeps it, and the same command resumes, reusing verified shards.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np

from openbook.errors import InvalidArgument
from openbook.index.embedding_files import (
    EMBEDDING_FORMATS,
    EmbeddingBatch,
    EmbeddingsError,
    iter_embeddings,
    iter_table_passages,
    natural_order,
)
from openbook.index.encoders import DEFAULT_ENCODER, encoder_id, load_encoder
from openbook.index.manifest import Manifest
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import (
    BuildSource,
    build_lock,
    check_files,
    check_inputs,
    stage_and_publish,
)
from openbook.index.store import PassageStore
from openbook.index.vectors import ShardProducer, ShardWork, VectorSource
from openbook.storage.artifacts import partial_dir

PASSAGES_FORMAT = "dpr-tsv"
TABLE_PASSAGES = "embeddings"  # manifest input_format: passages read from parquet/arrow
IMPORT_BATCH_SIZE = 10_000  # vectors read at a time: the batch size of the default options
IMPORT_SCORE_SCALE = 1.0  # DPR's raw inner products: what a spec without a scale gets


def import_embeddings(
    passages: Path | None,
    embeddings: list[Path],
    out_dir: Path,
    spec: IndexSpec,
    options: BuildOptions | None = None,
    *,
    embeddings_format: str = "auto",
) -> Manifest:
    """Build ``spec`` at ``out_dir`` from ``passages`` (DPR tsv) and ``embeddings`` (files of
    one format; see ``embedding_files``). ``passages=None`` takes the passages from the
    embedding files' ``title``/``text`` columns (wiki_dpr parquet/arrow).

    ``spec.encoder`` is recorded as what computed the vectors; ``spec.query_encoder`` (needed
    here) is what the retriever will load to encode questions (checked against the vectors'
    dimension when it is available here). ``spec.score_scale`` None is 1, DPR's raw inner
    products; ``spec.bm25``: also index the passages with BM25, a second view for hybrid
    retrieval (as ``build_index`` does). ``options`` default to reading
    :data:`IMPORT_BATCH_SIZE` vectors at a time; their device, precision and input format play
    no part (nothing is encoded, and the passages are DPR tsv or the tables' columns)."""
    started = time.monotonic()
    options = options or BuildOptions(batch_size=IMPORT_BATCH_SIZE)
    out_dir = Path(out_dir)
    passages = Path(passages) if passages is not None else None
    files = natural_order(embeddings)
    if not files:
        raise InvalidArgument("no embedding files given")
    check_inputs([*([passages] if passages else []), *files], out_dir, options.overwrite)
    spec, source = imported_source(passages, files, spec, options, embeddings_format)
    with build_lock(out_dir):
        try:
            return stage_and_publish(out_dir, spec, options, source, started)
        except EmbeddingsError:
            # Re-running cannot fix bad input; leave nothing half-written behind.
            shutil.rmtree(partial_dir(out_dir), ignore_errors=True)
            raise


def imported_source(
    passages: Path | None,
    embeddings: list[Path],
    spec: IndexSpec,
    options: BuildOptions,
    embeddings_format: str = "auto",
) -> tuple[IndexSpec, BuildSource]:
    """What ``import_embeddings`` builds ``spec`` from (whichever engine it is written to):
    the passages of ``passages`` (None: the embedding files' columns) and the vectors of
    ``embeddings`` (existing files, taken in natural order), checked as its docstring says;
    ``spec`` with its ``score_scale`` resolved (None: :data:`IMPORT_SCORE_SCALE`)."""
    files = natural_order(embeddings)
    if not files:
        raise InvalidArgument("no embedding files given")
    check_files([*([passages] if passages else []), *files])
    if not spec.dense:
        raise InvalidArgument(
            f"index type {spec.index_type!r} takes no vectors; expected a dense type"
        )
    if embeddings_format not in EMBEDDING_FORMATS:
        raise InvalidArgument(
            f"unknown embeddings format {embeddings_format!r}; expected {EMBEDDING_FORMATS}"
        )
    query_encoder = spec.query_encoder
    if not query_encoder:
        raise InvalidArgument("name the document and the query encoder the vectors belong to")
    if spec.score_scale is None:
        spec = replace(spec, score_scale=IMPORT_SCORE_SCALE)

    dim = _first_dim(files, embeddings_format)
    pq_m = spec.ann.pq_m
    if spec.index_type == "ivfpq" and pq_m is not None and dim % pq_m:
        raise InvalidArgument(f"pq_m={pq_m} must divide the vector dim {dim}")
    q_name = _check_query_encoder(query_encoder, dim, files[0])
    batch_size = options.batch_size
    vectors = VectorSource(
        encoder=_recorded_name(spec.encoder),
        query_encoder=q_name,
        dim=dim,
        normalize=False,
        digest=lambda: f"imported:{embeddings_format}",
        produce=_producer(
            str(passages or "the embedding files' passages"),
            files,
            embeddings_format,
            batch_size,
            dim,
        ),
        desc="importing",
        inputs=tuple(files),
    )
    source = BuildSource(
        inputs=[passages] if passages else files,
        input_format=PASSAGES_FORMAT if passages else TABLE_PASSAGES,
        vectors=vectors,
        passages=None
        if passages
        else lambda: iter_table_passages(files, embeddings_format, batch_size),
    )
    return spec, source


def _first_dim(files: list[Path], fmt: str) -> int:
    gen = iter_embeddings(files[:1], fmt, batch_size=1)
    try:
        batch = next(gen, None)
    finally:
        gen.close()
    if batch is None:
        raise EmbeddingsError(f"{files[0]}: no embeddings in the file")
    return int(batch.vectors.shape[1])


def _recorded_name(name: str) -> str:
    """A local encoder dir as an absolute path (as build_index records it); anything else (a
    hub name, a path that exists only where the retriever runs) as given."""
    p = Path(name).expanduser()
    return str(p.resolve()) if p.exists() else name


def _check_query_encoder(name: str, dim: int, first_file: Path) -> str:
    if encoder_id(name) != DEFAULT_ENCODER and not Path(name).expanduser().exists():
        return name  # not on this machine: the retriever checks the dim when it loads it
    enc = load_encoder(name, role="query")
    if enc.dim != dim:
        raise InvalidArgument(
            f"query encoder {enc.name!r} has dim {enc.dim} but the embeddings in "
            f"{first_file} have dim {dim}"
        )
    return encoder_id(name)


def _same_id(embedding_id: str, passage_id: str) -> bool:
    if embedding_id == passage_id:
        return True
    prefix, sep, rest = embedding_id.partition(":")
    return bool(sep) and rest == passage_id


def _row_of(store: PassageStore, embedding_id: str) -> int | None:
    for pid in (embedding_id, embedding_id.partition(":")[2]):
        if pid:
            try:
                return store.rows_for_ids([pid])[0]
            except KeyError:
                pass
    return None


def _producer(tsv: str, files: list[Path], fmt: str, batch_size: int, dim: int) -> ShardProducer:
    def produce(work: ShardWork) -> Iterator[tuple[int, np.ndarray]]:
        store, spans, update = work.store, work.spans, work.update
        count, size = spans[-1][1], spans[0][1] - spans[0][0]
        want = set(work.todo)
        buf: np.ndarray | None = None
        pos = 0  # global row of the batch's first entry
        for batch in iter_embeddings(files, fmt, batch_size):
            n = len(batch.ids)
            if batch.vectors.shape[1] != dim:
                raise EmbeddingsError(
                    f"{batch.path}: entry {batch.first} has dim {batch.vectors.shape[1]}, but "
                    f"{files[0]} has dim {dim}"
                )
            if not np.isfinite(batch.vectors).all():
                j = int(np.argmin(np.isfinite(batch.vectors).all(axis=1)))
                raise EmbeddingsError(
                    f"{batch.path}: entry {batch.first + j} (id {batch.ids[j]!r}) has "
                    "non-finite values"
                )
            _check_ids(store, tsv, batch, pos, count)
            off = 0
            while off < n:
                row = pos + off
                i = row // size
                a, b = spans[i]
                take = min(n - off, b - row)
                if i in want:
                    if buf is None:
                        buf = np.empty((b - a, dim), dtype=np.float32)
                    buf[row - a : row - a + take] = batch.vectors[off : off + take]
                    update(take)
                    if row + take == b:
                        yield i, buf
                        buf = None
                off += take
            pos += n
        if pos < count:
            pid = store.ids(pos, pos + 1)[0]
            raise EmbeddingsError(
                f"{tsv} has {count} passages but the embeddings end after {pos} vectors: "
                f"passage {pid!r} (row {pos}) and later have no vector"
            )

    return produce


def _check_ids(store: PassageStore, tsv: str, batch: EmbeddingBatch, pos: int, count: int) -> None:
    """Entry j of ``batch`` must be passage ``pos + j``; explain the first one that is not."""
    expected = store.ids(pos, min(pos + len(batch.ids), count))
    if batch.ids == expected:
        return
    for j, eid in enumerate(batch.ids):
        if j < len(expected) and _same_id(eid, expected[j]):
            continue
        where = f"{batch.path}: entry {batch.first + j} (id {eid!r})"
        found = _row_of(store, eid)
        if found is None:
            raise EmbeddingsError(f"{where} is not a passage id in {tsv}")
        if j >= len(expected):
            raise EmbeddingsError(
                f"{where}: more vectors than the {count} passages in {tsv} "
                f"(passage row {found} already has one)"
            )
        row = pos + j
        if found > row:
            raise EmbeddingsError(
                f"{tsv}: passage {expected[j]!r} (row {row}) has no vector: {where} is for "
                f"row {found}"
            )
        raise EmbeddingsError(
            f"{where} repeats or is out of order: it is row {found} of {tsv}, expected "
            f"{expected[j]!r} (row {row}); vectors must follow the passages file's order"
        )
