"""Building an index straight into Milvus: ``openbook index build`` / ``import`` with the
engine ``milvus`` (issue 41).

Write side. The passages and vectors come from the sources a files build reads
(``build.encoded_source``: the document encoder; ``importer.imported_source``: precomputed
embedding files); instead of ``vectors.npy`` and a faiss index, each shard of vectors the
source produces is written into Milvus as it comes, with its passages' BM25 weights, through
the fill ``openbook index to-milvus`` uses (``MilvusEngine.begin_fill``), so the index holds
what a copy of the files build of the same spec would hold: the same manifest (encoder
pairing, ``score_scale``, type and parameters), the same sparse weights, the same documents.

Stages, in a local work directory (:attr:`MilvusTarget.work_dir`, never served):

1. the passages, into a SQLite passage store (``stages.stage_passages``): the vector sources
   read them from it;
2. their BM25 view (bm25s, ``bm25/``): a passage's weights need the whole corpus's
   statistics, so it is indexed before the first insert, and read as ``to-milvus`` reads a
   built index's (``milvus_engine.stored_bm25``);
3. the index created in Milvus, marked as being filled (not served), or the fill found there
   resumed;
4. the vectors, shard by shard (``BuildOptions.shard_size`` passages: the unit of resuming),
   each shard upserted with its passages and recorded done in Milvus before the next is
   encoded; ``on_batch(done, total)`` after each (the progress bar, a test's interruption);
5. the documents, then the fill marked complete: the index is served. The work directory is
   removed.

Resuming: the fill's record in Milvus (``copying``: the passages written) is keyed by the
build's fingerprint (``stages.build_fingerprint``: inputs, encoder weights, shard size) and
its spec. Re-running the same command after an interruption (killed, Milvus gone) reuses
the work directory's passages and BM25 view, and encodes and writes only the shards from the
one holding the recorded count on: passage ids are primary keys and rows are upserted, so a
shard written twice holds each passage once. A run of another fingerprint or spec finds the
index AlreadyExists; ``overwrite`` drops it first (the old index is gone while the new one is
built: Milvus has no rename to publish it atomically).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from itertools import chain
from pathlib import Path

from tqdm.auto import tqdm

from openbook.errors import InvalidArgument
from openbook.index.bm25 import BM25_DIR
from openbook.index.build import encoded_source
from openbook.index.embedding_files import EmbeddingsError
from openbook.index.faiss_index import default_params
from openbook.index.importer import imported_source
from openbook.index.layout import BUILD_STATE_DIR, PASSAGES_FILE
from openbook.index.manifest import Manifest
from openbook.index.milvus_engine import (
    AVGDL_SAMPLE,
    FillSource,
    MilvusEngine,
    stored_bm25,
)
from openbook.index.passages import read_passages
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.index.stages import (
    BuildSource,
    build_fingerprint,
    build_lock,
    check_files,
    check_shard_vectors,
    prepare_workdir,
    stage_bm25,
    stage_passages,
)
from openbook.index.store import PassageStore
from openbook.index.vectors import ShardWork

BatchHook = Callable[[int, int], None]  # (passages written, total) after each shard


@dataclass(frozen=True)
class MilvusTarget:
    """Where a build into Milvus writes: the Milvus at ``uri`` (``OPENBOOK_MILVUS_URI``: a
    server, or a ``.db`` path opened as Milvus Lite in this process) with ``token`` (""
    for none); ``work_dir``, the local directory of the stages that precede the inserts
    (module docstring: kept for resuming, removed when the build completes); ``shards``, the
    passages collection's ``num_shards`` (None: Milvus's default; Milvus Lite holds one)."""

    uri: str
    work_dir: Path
    token: str = ""
    shards: int | None = None

    def __post_init__(self) -> None:
        if self.shards is not None and (type(self.shards) is not int or self.shards < 1):
            raise InvalidArgument(f"shards must be an integer >= 1, got {self.shards!r}")


@dataclass(frozen=True)
class MilvusBuilt:
    """A build into Milvus that completed: the index's name, its passages, the manifest
    Milvus holds, the passage its run resumed at (0: built from the start) and its seconds."""

    name: str
    count: int
    manifest: Manifest
    resumed_at: int
    seconds: float


def build_into_milvus(
    inputs: list[Path],
    target: MilvusTarget,
    spec: IndexSpec,
    options: BuildOptions | None = None,
    *,
    on_batch: BatchHook | None = None,
) -> MilvusBuilt:
    """``build_index`` of ``spec`` over ``inputs``, written into Milvus (module docstring)."""
    options = options or BuildOptions()
    _check_dense(spec)
    inputs = [Path(p) for p in inputs]
    check_files(inputs)
    spec, source = encoded_source(inputs, spec, options)
    return write_into_milvus(target, spec, options, source, on_batch=on_batch)


def import_into_milvus(
    passages: Path | None,
    embeddings: list[Path],
    target: MilvusTarget,
    spec: IndexSpec,
    options: BuildOptions,
    *,
    embeddings_format: str = "auto",
    on_batch: BatchHook | None = None,
) -> MilvusBuilt:
    """``import_embeddings`` of ``spec``, written into Milvus (module docstring). Bad input
    (``EmbeddingsError``) leaves nothing behind: no work directory, no index under way."""
    _check_dense(spec)
    spec, source = imported_source(passages, embeddings, spec, options, embeddings_format)
    try:
        return write_into_milvus(target, spec, options, source, on_batch=on_batch)
    except EmbeddingsError:
        _discard(target, spec.name)
        raise


def _check_dense(spec: IndexSpec) -> None:
    if not spec.dense:
        raise InvalidArgument(
            "index_type: the milvus engine holds dense indexes (each with its BM25 view); "
            "a bm25-only index is the files engine's"
        )


def write_into_milvus(
    target: MilvusTarget,
    spec: IndexSpec,
    options: BuildOptions,
    source: BuildSource,
    *,
    on_batch: BatchHook | None = None,
) -> MilvusBuilt:
    """Run the stages (module docstring) of ``spec`` from ``source`` into ``target``;
    ``spec.score_scale`` resolved, ``source.vectors`` present (a dense spec)."""
    started = time.monotonic()
    vectors = source.vectors
    if vectors is None or spec.score_scale is None:
        raise InvalidArgument("a build into Milvus needs a dense spec and its vectors")
    work = Path(target.work_dir)
    state = work / BUILD_STATE_DIR
    fingerprint = build_fingerprint(spec, options, source)
    key = hashlib.sha256(
        json.dumps({"build": fingerprint, "spec": asdict(spec)}, sort_keys=True).encode()
    ).hexdigest()
    with build_lock(work):
        prepare_workdir(work, state, fingerprint)
        read = source.passages or (
            lambda: read_passages(source.inputs, source.input_format, spec.max_words)
        )
        count = stage_passages(work, state, read)
        if count == 0:
            raise InvalidArgument("no passages found in the inputs")
        if not (state / "bm25.done").is_file():
            stage_bm25(work, count, options.progress)
            (state / "bm25.done").write_text("ok")
        manifest = Manifest(
            name=spec.name,
            encoder=vectors.encoder,
            query_encoder=vectors.query_encoder,
            dim=vectors.dim,
            count=count,
            index_type=spec.index_type,
            index_params=default_params(spec.index_type, count, vectors.dim, spec.ann),
            normalize=vectors.normalize,
            score_scale=float(spec.score_scale),
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            input_format=source.input_format,
            max_words=spec.max_words,
            views=spec.views,
        )
        store = PassageStore(work / PASSAGES_FILE)
        engine = MilvusEngine(target.uri, token=target.token)
        try:
            if options.overwrite:
                _drop_unless_resumable(engine, spec.name, key)
            fill = engine.begin_fill(
                spec.name,
                manifest,
                stored_bm25(work / BM25_DIR, store.get(range(min(count, AVGDL_SAMPLE)))),
                FillSource(
                    f"a build of {', '.join(str(p) for p in source.inputs)}",
                    key,
                    count,
                    resume_with="run the same build again",
                ),
                shards=target.shards,
            )
            size = options.shard_size
            spans = [(a, min(a + size, count)) for a in range(0, count, size)]
            todo = [i for i, (_, stop) in enumerate(spans) if stop > fill.resumed_at]
            initial = spans[todo[0]][0] if todo else count
            desc = f"{vectors.desc} into Milvus"
            with tqdm(
                total=count, initial=initial, unit="psg", desc=desc, disable=not options.progress
            ) as bar:
                work_order = ShardWork(store, spans, todo, bar.update)
                for i, vecs in vectors.produce(work_order):
                    check_shard_vectors(i, vecs, spans[i], vectors.dim)
                    a, b = spans[i]
                    fill.write(a, list(chain.from_iterable(store.iter_passages(a, b))), vecs)
                    if on_batch is not None:
                        on_batch(b, count)
            index = fill.finish(store.iter_passages(0, count))
            built = MilvusBuilt(
                spec.name,
                len(index),
                index.manifest,
                fill.resumed_at,
                round(time.monotonic() - started, 3),
            )
        finally:
            store.close()
            engine.close()
    shutil.rmtree(work, ignore_errors=True)
    return built


def _drop_unless_resumable(engine: MilvusEngine, name: str, key: str) -> None:
    """``overwrite``: drop index ``name`` unless it is this very build, cut short (resumed)."""
    if engine.describe(name) is None:
        return
    under_way = engine.stats(name).get("copying")
    if not under_way or under_way.get("checksum") != key:
        engine.drop(name)


def _discard(target: MilvusTarget, name: str) -> None:
    """Bad input: remove the work directory and the index's fill under way, if any (a
    complete index of that name is someone else's and stays)."""
    shutil.rmtree(target.work_dir, ignore_errors=True)
    engine = MilvusEngine(target.uri, token=target.token)
    try:
        if engine.describe(name) is not None and engine.stats(name).get("copying"):
            engine.drop(name)
    finally:
        engine.close()


__all__ = [
    "MilvusBuilt",
    "MilvusTarget",
    "build_into_milvus",
    "import_into_milvus",
    "write_into_milvus",
]
