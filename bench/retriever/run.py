"""Retriever index benchmark: approximate/compressed index types against exact flat search.

Measures, per index type and in one run (so ratios vs flat share the same machine state):
build throughput (vectors/s, index construction only; encoding is excluded), bytes per passage
of the index file (what must sit in RAM; vectors.npy is memory-mapped and not counted),
recall@k against flat's exact top-k, single-query latency (p50/p99 ms) and batched QPS.

Vectors are synthetic (no encoder): 100k x 768-d by default (DPR's dim), ``--n 1000000`` for
the 1M case (~3 GiB of vectors plus indexes; needs a dedicated machine). ``--data clustered``
(default) draws from a mixture of Gaussians with spread norms, closer to real embeddings than
``--data gaussian`` (isotropic noise, the worst case for any ANN index).

Uses the same build/search functions as ``openbook.index`` (faiss_index.build_faiss/search).

    .venv/bin/python bench/retriever/run.py                       # 100k, all types
    .venv/bin/python bench/retriever/run.py --n 20000 --dim 128   # quick smoke run
    .venv/bin/python bench/retriever/run.py --n 1000000 --json out.json
    .venv/bin/python bench/retriever/run.py --index var/indexes/wiki-2018  # the demo corpus

``--index DIR`` benchmarks the vectors of a built dense index instead (its ``vectors.npy``),
with the demo SQuAD questions encoded by the index's query encoder as queries.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from openbook.index import faiss_index
from openbook.index.spec import AnnParams

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "flat": ("flat", {}),
    "hnsw": ("hnsw", {}),
    "hnsw-mips2l2": ("hnsw", {"hnsw_transform": "mips_to_l2"}),
    "hnsw-sq8": ("hnsw-sq8", {}),
    "ivfpq": ("ivfpq", {}),
    "ivfpq-rerank4": ("ivfpq", {"rerank": 4}),
    "hnsw-sq8-rerank2": ("hnsw-sq8", {"rerank": 2}),
}


def make_data(
    kind: str, n: int, nq: int, dim: int, seed: int, normalize: bool
) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = np.empty((n, dim), dtype=np.float32)
    if kind == "gaussian":
        for s in range(0, n, 50_000):
            m = min(50_000, n - s)
            x[s : s + m] = rng.standard_normal((m, dim), dtype=np.float32)
        q = rng.standard_normal((nq, dim), dtype=np.float32)
    else:
        centers = rng.standard_normal((max(16, n // 100), dim), dtype=np.float32)
        for s in range(0, n, 50_000):
            m = min(50_000, n - s)
            c = centers[rng.integers(0, len(centers), m)]
            noise = rng.standard_normal((m, dim), dtype=np.float32) * 0.6
            scale = rng.lognormal(0.0, 0.25, (m, 1)).astype(np.float32)
            x[s : s + m] = (c + noise) * scale
        picks = rng.integers(0, n, nq)
        q = x[picks] + rng.standard_normal((nq, dim), dtype=np.float32) * 0.6
    if normalize:
        x /= np.linalg.norm(x, axis=1, keepdims=True)
        q /= np.linalg.norm(q, axis=1, keepdims=True)
    return x, q.astype(np.float32)


def index_data(index_dir: Path, nq: int) -> tuple[np.ndarray, np.ndarray]:
    """The passage vectors of a built dense index and ``nq`` demo questions encoded as queries."""
    from openbook.index import load_encoder, open_index
    from openbook_trainer.demo.data import default_data_dir

    index = open_index(index_dir)
    m = index.manifest
    if not m.dense:
        raise SystemExit(f"{index_dir}: a {m.index_type} index has no vectors to benchmark")
    x = np.ascontiguousarray(np.load(index_dir / "vectors.npy"), dtype=np.float32)
    rows = (default_data_dir() / "squad" / "questions.jsonl").read_text().splitlines()[:nq]
    questions = [json.loads(r)["question"] for r in rows]
    q = load_encoder(m.query_encoder or m.encoder, role="query").encode(questions)
    return x, q.astype(np.float32)


def recall_at_k(rows: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(r) & set(t)) / k for r, t in zip(rows, truth, strict=True)]))


def bench_one(
    name: str,
    x: np.ndarray,
    q: np.ndarray,
    k: int,
    n_latency: int,
    extra: dict[str, Any],
    tmp: Path,
) -> tuple[dict[str, Any], np.ndarray]:
    index_type, variant = VARIANTS[name]
    n, dim = x.shape
    params = faiss_index.default_params(index_type, n, dim, AnnParams(**{**variant, **extra}))
    t0 = time.perf_counter()
    index, params = faiss_index.build_faiss(x, index_type, params)
    build_s = time.perf_counter() - t0
    path = tmp / f"{name}.faiss"
    faiss_index.write(index, path)
    size = path.stat().st_size

    factor = int(params.get("rerank", 0) or 0)

    def search(qs: np.ndarray) -> np.ndarray:
        # mirrors LoadedIndex's dense search (vectors in RAM here, memory-mapped there)
        if factor > 1:
            _, cand = faiss_index.search(index, index_type, params, qs, k * factor)
            return faiss_index.rerank_exact(qs, cand, x, k)[1]
        return faiss_index.search(index, index_type, params, qs, k)[1]

    search(q[:10])  # warm-up
    lat = []
    for i in range(min(n_latency, len(q))):
        t = time.perf_counter()
        search(q[i : i + 1])
        lat.append(time.perf_counter() - t)
    t = time.perf_counter()
    rows = search(q)
    batch_s = time.perf_counter() - t
    path.unlink()
    res = {
        "type": name,
        "params": {k_: v for k_, v in params.items() if k_ != "phi"},
        "build_s": round(build_s, 3),
        "build_vectors_per_s": round(n / build_s, 1),
        "index_bytes": size,
        "bytes_per_passage": round(size / n, 2),
        "latency_ms_p50": round(1000 * float(np.percentile(lat, 50)), 4),
        "latency_ms_p99": round(1000 * float(np.percentile(lat, 99)), 4),
        "qps_batched": round(len(q) / batch_s, 1),
    }
    return res, rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=100_000, help="passages (use 1000000 for 1M)")
    ap.add_argument("--dim", type=int, default=768)
    ap.add_argument("--queries", type=int, default=1000)
    ap.add_argument("--latency-queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--data", choices=("clustered", "gaussian"), default="clustered")
    ap.add_argument("--normalize", action="store_true", help="L2-normalise (MiniLM-like)")
    ap.add_argument(
        "--types",
        default="flat,hnsw,hnsw-sq8,ivfpq",
        help=f"comma list from {','.join(VARIANTS)}; flat is always run",
    )
    ap.add_argument("--hnsw-m", type=int, default=32)
    ap.add_argument("--ef-construction", type=int, default=128)
    ap.add_argument("--ef-search", type=int, default=128)
    ap.add_argument("--nprobe", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0, help="faiss OpenMP threads (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write results here")
    ap.add_argument("--index", type=Path, help="benchmark this built dense index's vectors")
    args = ap.parse_args(argv)

    types = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in types if t not in VARIANTS]
    if unknown:
        ap.error(f"unknown type(s) {unknown}; choose from {list(VARIANTS)}")
    types = ["flat"] + [t for t in types if t != "flat"]
    if args.threads:
        faiss.omp_set_num_threads(args.threads)

    t = time.perf_counter()
    if args.index:
        x, q = index_data(args.index, args.queries)
        args.n, args.dim, args.queries, args.data = *x.shape, len(q), f"index {args.index}"
    else:
        x, q = make_data(args.data, args.n, args.queries, args.dim, args.seed, args.normalize)
    print(
        f"data: {args.data} {args.n}x{args.dim} (+{args.queries} queries) "
        f"in {time.perf_counter() - t:.1f}s; faiss threads {faiss.omp_get_max_threads()}",
        file=sys.stderr,
    )
    extra = {
        "hnsw_m": args.hnsw_m,
        "ef_construction": args.ef_construction,
        "ef_search": args.ef_search,
        "nprobe": args.nprobe,
    }

    results, truth = [], None
    with tempfile.TemporaryDirectory() as tmp:
        for name in types:
            print(f"building {name} ...", file=sys.stderr, flush=True)
            res, rows = bench_one(name, x, q, args.k, args.latency_queries, extra, Path(tmp))
            if truth is None:
                truth = rows
            res[f"recall@{args.k}"] = round(recall_at_k(rows, truth), 4)
            results.append(res)

    flat = results[0]
    for r in results:
        r["vs_flat"] = {
            "bytes": round(r["index_bytes"] / flat["index_bytes"], 4),
            "latency_p50": round(r["latency_ms_p50"] / flat["latency_ms_p50"], 4),
            "qps": round(r["qps_batched"] / flat["qps_batched"], 4),
        }

    rk = f"recall@{args.k}"
    hdr = (
        f"{'type':<18}{rk:>10}{'B/psg':>10}{'p50 ms':>10}{'p99 ms':>10}{'qps':>10}"
        f"{'build/s':>11}{'xB':>8}{'xp50':>8}{'xqps':>8}"
    )
    print(hdr)
    for r in results:
        v = r["vs_flat"]
        print(
            f"{r['type']:<18}{r[rk]:>10.4f}{r['bytes_per_passage']:>10.1f}"
            f"{r['latency_ms_p50']:>10.3f}{r['latency_ms_p99']:>10.3f}{r['qps_batched']:>10.0f}"
            f"{r['build_vectors_per_s']:>11.0f}{v['bytes']:>8.3f}{v['latency_p50']:>8.3f}"
            f"{v['qps']:>8.2f}"
        )
    if args.json:
        meta = {
            "n": args.n,
            "dim": args.dim,
            "queries": args.queries,
            "k": args.k,
            "data": args.data,
            "normalize": args.normalize,
            "seed": args.seed,
            "faiss": faiss.__version__,
            "threads": faiss.omp_get_max_threads(),
            "cpu_count": os.cpu_count(),
            "machine": platform.platform(),
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
