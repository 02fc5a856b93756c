"""The scale benchmark's corpus in Milvus Lite (``bench/index/scale.py --engine milvus``).

The same synthetic vectors, queries and exact top-100 as the files engine's run, through the
product's own path onto the engine: a one-shard ``flat`` files index is built from the streamed
vectors (``scale_build``, which also streams the ground truth), then copied into Milvus Lite
by ``MilvusEngine.copy_index`` — what ``openbook index copy`` runs, the stored vectors
inserted in batches, nothing re-encoded — with the Milvus index ``--milvus-index`` (``hnsw``
by default: the engine offers ``flat``, ``hnsw`` and ``hnsw-sq8``, not IVF-PQ). One process
opens the Milvus Lite database (Milvus Lite runs inside the process that opens it) and answers
with ``MilvusIndex.search`` of query vectors, the retriever servicer's dense call on this
engine; its RSS is the engine's memory. Latency and recall as in ``scale_serve``.

``copy_s`` is the copy's time; ``build_s`` the source's build plus the copy; ``disk_bytes`` the
Milvus data directory's bytes (the files source is scaffolding, reported apart).
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing as mp
import time
from contextlib import suppress
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.index.scale_build import INDEX_NAME, ScaleConfig, ScaleRun, build, disk_bytes
from bench.index.scale_serve import measure, serving_processes
from bench.index.scale_truth import recall_at_k
from openbook.index.request import SearchRequest


def _serve_milvus(db: str, name: str, conn: Connection) -> None:
    """A process holding Milvus Lite on ``db``: load, report the time, answer searches."""
    from openbook.index.milvus_engine import MilvusEngine

    t0 = time.monotonic()
    engine = MilvusEngine(db, timeout_s=None)
    # Milvus Lite reopens a database with its collections released, and the engine does not
    # load them itself (a collection it creates is loaded by its creation): load them all.
    for collection in engine.client.list_collections():
        engine.client.load_collection(collection)
    index = engine.open(name)
    zeros = np.zeros((1, index.manifest.dim), np.float32)
    index.search(SearchRequest(k=1, query_vectors=zeros))  # loaded now
    conn.send(time.monotonic() - t0)
    while (msg := conn.recv()) is not None:
        op, arg = msg
        if op == "params":
            conn.send(True)  # the engine's search parameters are its manifest's
        elif op == "search":
            q, k = arg
            conn.send(index.search(SearchRequest(k=k, query_vectors=q)))
    engine.close()


def copy_into_milvus(source_dir: Path, db: Path, milvus_index: str, progress: bool) -> float:
    """Copy the files index at ``source_dir`` into Milvus Lite at ``db`` (resumable, a no-op
    once complete); returns the seconds spent this time."""
    from tqdm.auto import tqdm

    from openbook.errors import AlreadyExists
    from openbook.index.loaded import open_index
    from openbook.index.milvus_engine import MilvusEngine

    t0 = time.monotonic()
    db.parent.mkdir(parents=True, exist_ok=True)
    engine = MilvusEngine(str(db), timeout_s=None)
    try:
        with open_index(source_dir, verify=False) as source:
            bar = tqdm(total=len(source), unit="psg", desc="milvus copy", disable=not progress)

            def advance(done: int, total: int) -> None:
                bar.update(done - bar.n)

            with suppress(AlreadyExists):  # complete already
                engine.copy_index(INDEX_NAME, source, index_type=milvus_index, progress=advance)
            bar.close()
    finally:
        engine.close()
    return time.monotonic() - t0


def _copy_and_record(
    source_dir: Path, db: Path, milvus_index: str, progress: bool, record: Path
) -> None:
    spent = copy_into_milvus(source_dir, db, milvus_index, progress)
    record.write_text(f"{spent:.3f}\n")


def run_milvus(args: argparse.Namespace, config: ScaleConfig, work: Path) -> dict[str, Any]:
    # the source is exact: none of the IVF-PQ settings apply, so none is recorded in its state
    source_config = dataclasses.replace(
        config, shards=1, index_type="flat", nlist=1, pq_m=1, nprobe=1, rerank=0, train_size=0
    )
    run = ScaleRun(work / "source", source_config)
    built = build(run, progress=not args.no_progress)
    db = work / "milvus" / "scale.db"
    copied = work / "milvus" / "copy_s"
    if not copied.exists():
        # In a child: Milvus Lite runs inside the process that opens a database and keeps it
        # until that process exits, so the serving process could not open it after us.
        ctx = mp.get_context("spawn")
        child = ctx.Process(
            target=_copy_and_record,
            args=(built.shard_dirs[0], db, args.milvus_index, not args.no_progress, copied),
        )
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"copying into Milvus Lite failed (exit code {child.exitcode})")
    copy_s = float(copied.read_text())
    result: dict[str, Any] = {
        "milvus_index": args.milvus_index,
        "build_s": round(built.build_s + copy_s, 3),
        "source_build_s": built.build_s,
        "copy_s": round(copy_s, 3),
        "disk_bytes": disk_bytes([db]),
        "source_disk_bytes": disk_bytes(built.shard_dirs),
    }
    with serving_processes([(_serve_milvus, (str(db), INDEX_NAME))]) as procs:
        result["load_s"] = [round(p.load_s, 3) for p in procs]
        lat5, found5 = measure(procs, built.queries, 5)
        lat100, found100 = measure(procs, built.queries, 100)
        rss = [p.rss() for p in procs]
    result.update(
        {
            "p50_ms_k5": lat5["p50_ms"],
            "p99_ms_k5": lat5["p99_ms"],
            "p50_ms_k100": lat100["p50_ms"],
            "p99_ms_k100": lat100["p99_ms"],
            "recall_at_100": recall_at_k(found100, built.truth),
            "recall_at_5": recall_at_k(found5, built.truth[:, :5]),
            "rss_bytes": [r["VmRSS"] for r in rss],
            "rss_anon_bytes": [r["RssAnon"] for r in rss],
            "rss_file_bytes": [r["RssFile"] for r in rss],
            "rss_peak_bytes": [r["VmHWM"] for r in rss],
        }
    )
    return result
