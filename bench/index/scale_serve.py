"""Serve the scale benchmark's shards, one process each, and measure search across them.

What is measured, and how it relates to the running product:

* One process per shard, each holding one shard index loaded by ``open_index`` (what the
  retriever's registry calls, ``verify=True`` by default as the registry's first load does:
  every checksum read) and answering ``LoadedIndex.search`` of a request of query vectors
  (``SearchRequest(query_vectors=...)``) — the search the retriever's servicer makes for a
  dense request once its query encoder has produced the vectors
  (``openbook_retriever/servicer.py``). The ``Retrieve`` RPC takes query texts only and
  these vectors have no encoder, so the RPC layer itself is not in the path: the processes
  receive query vectors over a pipe instead (pickled, as gRPC would serialise them).
* The fan-out sends each query to every shard at once and merges their top-k with the
  gateway's own ``merge_results`` (``openbook_gateway/retrieval.py``). Latency is one query
  at a time, wall clock from the send to the merged top-k.
* RSS per shard from ``/proc/<pid>/status`` after the searches: ``VmRSS`` (what the issue's
  12 GB budget counts), split into ``RssAnon`` (the faiss index: PQ codes, ids, quantizer)
  and ``RssFile`` (pages of the memory-mapped ``vectors.npy`` that re-ranking touched, and the
  passage store's: the kernel may drop them under pressure).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

from bench.index.scale_build import row_of
from bench.index.scale_truth import recall_at_k
from openbook.index.request import SearchRequest


def _serve_shard(path: str, verify: bool, conn: Connection) -> None:
    """A shard process: load, report the load time, then answer until told to stop."""
    from openbook.index.loaded import open_index

    t0 = time.monotonic()
    index = open_index(Path(path), verify=verify)
    conn.send(time.monotonic() - t0)
    while (msg := conn.recv()) is not None:
        op, arg = msg
        if op == "params":
            index.set_search_params(**arg)
            conn.send(True)
        elif op == "search":
            q, k = arg
            conn.send(index.search(SearchRequest(k=k, query_vectors=q)))


@dataclass
class ShardProcess:
    process: Any  # multiprocessing's SpawnProcess
    conn: Connection
    load_s: float

    def rss(self) -> dict[str, int]:
        """VmRSS, RssAnon, RssFile and VmHWM of the process, in bytes."""
        out = {}
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
        return out


@contextmanager
def shard_processes(dirs: Sequence[Path], verify: bool = True) -> Iterator[list[ShardProcess]]:
    """Start one process per shard directory (loading in parallel); stop them on exit."""
    with serving_processes([(_serve_shard, (str(d), verify)) for d in dirs]) as procs:
        yield procs


@contextmanager
def serving_processes(
    targets: Sequence[tuple[Callable[..., None], tuple[Any, ...]]],
) -> Iterator[list[ShardProcess]]:
    """Start ``target(*args, conn)`` per entry: a process that sends its load time, then
    answers ``("params", {...})`` and ``("search", (q, k))`` until sent None."""
    ctx = mp.get_context("spawn")  # no inherited faiss/OpenMP state
    started = []
    try:
        for target, args in targets:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=target, args=(*args, child), daemon=True)
            p.start()
            started.append((p, parent))
        procs = [ShardProcess(p, conn, float(conn.recv())) for p, conn in started]
        yield procs
    finally:
        for p, conn in started:
            with suppress(BrokenPipeError, OSError):
                conn.send(None)
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def set_params(procs: Sequence[ShardProcess], **params: int) -> None:
    for s in procs:
        s.conn.send(("params", params))
    for s in procs:
        s.conn.recv()


def fan_out(procs: Sequence[ShardProcess], q: np.ndarray, k: int) -> list[list[int]]:
    """One request as the gateway makes it: every shard at once, top-k merged by score.
    Returns the merged rows per query."""
    from openbook_gateway.retrieval import merge_results

    for s in procs:
        s.conn.send(("search", (q, k)))
    per_shard = [s.conn.recv() for s in procs]
    merged = merge_results(per_shard, k)
    return [[row_of(p.id) for p in hits] for hits in merged]


def measure(
    procs: Sequence[ShardProcess], queries: np.ndarray, k: int, warmup: int = 5
) -> tuple[dict[str, float], list[list[int]]]:
    """p50/p99 ms of single-query requests at ``k`` (after ``warmup`` untimed ones) and the
    rows each query got."""
    for i in range(min(warmup, len(queries))):
        fan_out(procs, queries[i : i + 1], k)
    ms, found = [], []
    for i in range(len(queries)):
        t0 = time.perf_counter()
        rows = fan_out(procs, queries[i : i + 1], k)
        ms.append((time.perf_counter() - t0) * 1000)
        found.extend(rows)
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "mean_ms": round(float(np.mean(ms)), 3),
    }, found


def sweep(
    procs: Sequence[ShardProcess],
    queries: np.ndarray,
    truth: np.ndarray,
    settings: Sequence[tuple[int, ...]],
) -> list[dict[str, float]]:
    """recall@100 and k=100 latency for each (nprobe, rerank[, ef_search]): the trade-off
    curve (ef_search: an hnsw coarse quantizer's; absent: left as it was)."""
    out = []
    for nprobe, rerank, *ef in settings:
        extra = {"ef_search": ef[0]} if ef else {}
        set_params(procs, nprobe=nprobe, rerank=rerank, **extra)
        lat, found = measure(procs, queries, 100, warmup=2)
        out.append(
            {
                "nprobe": nprobe,
                "rerank": rerank,
                **extra,
                "recall_at_100": recall_at_k(found, truth),
                **lat,
            }
        )
    return out
