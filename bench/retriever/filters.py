"""What a metadata filter costs: per-query latency with a filter that keeps 1% of the passages
against no filter, per index type, in one run (interleaved, so the ratios share the machine's
state).

Each index is a complete index directory (passages, vectors, faiss index, BM25 view) over the
same synthetic passages: clustered vectors (as ``bench/retriever/run.py``) and texts of random
words; passage ``d<i>`` has title ``T<i mod 100>``, so ``{"_title": "T7"}`` keeps exactly 1%
(the built-in ``_title``: a built index stores no metadata). Queries are searched one at a time,
as the retriever serves one ``/answer``, already encoded (encoding costs the same with or
without a filter); for each query the variants take turns. Reported per index type and
retrieval mode: p50 / p90 ms unfiltered, filtered (1%: the exact scan of the kept rows), and
filtered through faiss' ID selector (``EXACT_FILTER_ROWS`` forced to 0: what a filter keeping
more rows than that costs), each as a ratio of the unfiltered p50; and the one-time cost of the
first filtered search (the index's filter columns, built from its passage store).

    .venv/bin/python bench/retriever/filters.py [--n 50000] [--dim 384] [--queries 200] \
        [--json docs/bench/retriever-filters.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import faiss
import numpy as np

from openbook.index import faiss_index, filtering, open_index
from openbook.index.bm25 import BM25_DIR, build_bm25
from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
from openbook.index.manifest import MANIFEST, Manifest, checksum_fields
from openbook.index.request import SearchRequest
from openbook.index.store import PassageWriter
from openbook.types import Passage
from openbook.validation.metadata_filter import parse_filter

TYPES = ("flat", "hnsw", "hnsw-sq8", "ivfpq")
VOCAB = [f"w{i}" for i in range(5000)]


def clustered(rng: np.random.Generator, n: int, dim: int, centers: np.ndarray) -> np.ndarray:
    labels = rng.integers(0, len(centers), n)
    x = centers[labels] + 0.5 * rng.standard_normal((n, dim), dtype=np.float32)
    return (x * rng.uniform(0.5, 1.5, (n, 1))).astype(np.float32)


def write_index(out: Path, index_type: str, vectors: np.ndarray, texts: list[str]) -> None:
    """A full index directory: passages, vectors, faiss, BM25 view, manifest."""
    out.mkdir(parents=True)
    n, dim = vectors.shape
    writer = PassageWriter(out / PASSAGES_FILE)
    writer.add(Passage(f"d{i}", f"T{i % 100}", t) for i, t in enumerate(texts))
    writer.close()
    np.save(out / VECTORS_FILE, vectors)
    params = faiss_index.default_params(index_type, n, dim)
    index, params = faiss_index.build_faiss(vectors, index_type, params)
    faiss_index.write(index, out / faiss_index.INDEX_FILE)
    build_bm25([f"T{i % 100} {t}" for i, t in enumerate(texts)], out / BM25_DIR)
    Manifest(
        name=f"bench-{index_type}",
        encoder="synthetic",
        query_encoder="synthetic",
        dim=dim,
        count=n,
        index_type=index_type,
        index_params=params,
        views=["dense", "bm25"],
        **checksum_fields(out),
    ).to_file(out / MANIFEST)


def pct(times: list[float]) -> dict[str, float]:
    return {"p50": float(np.percentile(times, 50)), "p90": float(np.percentile(times, 90))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--dim", type=int, default=384)
    ap.add_argument("--queries", type=int, default=200)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", type=int, default=1, help="faiss OpenMP threads")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    faiss.omp_set_num_threads(args.threads)

    rng = np.random.default_rng(0)
    centers = rng.standard_normal((64, args.dim), dtype=np.float32)
    vectors = clustered(rng, args.n, args.dim, centers)
    texts = [" ".join(rng.choice(VOCAB, 40)) for _ in range(args.n)]
    queries = clustered(rng, args.queries, args.dim, centers)
    query_texts = [" ".join(rng.choice(VOCAB, 6)) for _ in range(args.queries)]
    where = parse_filter({"_title": "T7"})
    assert where is not None
    exact_rows = filtering.EXACT_FILTER_ROWS

    report: dict[str, Any] = {
        "passages": args.n,
        "dim": args.dim,
        "queries": args.queries,
        "k": args.k,
        "kept": 0.01,
        "exact_filter_rows": exact_rows,
        "threads": args.threads,
        "machine": platform.processor() or platform.machine(),
        "faiss": faiss.__version__,
        "results": {},
    }
    work = Path(tempfile.mkdtemp(prefix="bench-filters-"))
    try:
        for index_type in args.types.split(","):
            t0 = time.perf_counter()
            write_index(work / index_type, index_type, vectors, texts)
            build_s = time.perf_counter() - t0
            with open_index(work / index_type, verify=False) as index:
                t0 = time.perf_counter()
                index.metadata_columns()
                columns_ms = 1000 * (time.perf_counter() - t0)
                modes = ("dense", "bm25", "hybrid") if index_type == "flat" else ("dense",)
                for mode in modes:
                    times: dict[str, list[float]] = {"none": [], "1%": [], "1% selector": []}
                    for qi in range(args.queries):
                        for variant in times:
                            filtering.EXACT_FILTER_ROWS = (
                                0 if variant == "1% selector" else exact_rows
                            )
                            start = time.perf_counter()
                            hits = index.search(
                                SearchRequest(
                                    [query_texts[qi]],
                                    k=args.k,
                                    query_vectors=queries[qi : qi + 1] if mode != "bm25" else None,
                                    retrieval=mode,
                                    where=None if variant == "none" else where,
                                )
                            )
                            times[variant].append(1000 * (time.perf_counter() - start))
                            if variant != "none":
                                assert all(p.title == "T7" for p in hits[0])
                    filtering.EXACT_FILTER_ROWS = exact_rows
                    ms = {v: pct(t) for v, t in times.items()}
                    label = index_type if mode == "dense" else mode
                    report["results"][label] = {
                        "ms": ms,
                        "filtered_over_unfiltered_p50": ms["1%"]["p50"] / ms["none"]["p50"],
                        "selector_over_unfiltered_p50": ms["1% selector"]["p50"]
                        / ms["none"]["p50"],
                        "filter_columns_ms": columns_ms,
                        "build_s": build_s,
                    }
                    print(label, json.dumps(report["results"][label]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
