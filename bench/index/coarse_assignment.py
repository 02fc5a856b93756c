"""How often ivfpq's coarse quantizer puts a vector, or a query's probe, where the exact one would.

IVF-PQ finds a neighbour only in the lists it probes, and only if the neighbour was added to
the list its own centroid heads. An HNSW coarse quantizer (``coarse_quantizer="hnsw"``) finds
both approximately, with ``ef_search`` candidates; this measures how approximately, on the
scale benchmark's synthetic corpus at any size (``scale_data``), without building the index:

* k-means as ``faiss_index.build_faiss`` trains ivfpq's centroids (inner-product assignment),
  on ``--train-size`` vectors of the corpus;
* ``--vectors`` rows of the corpus assigned by the HNSW graph of those centroids at each
  ``--ef`` and by the exact (flat) inner-product quantizer: the share that agree;
* ``--queries`` queries: the share of the exact top-``--nprobe`` centroids the graph's probe
  finds (with ``max(ef, nprobe)`` candidates, as the retriever probes).

    .venv/bin/python bench/index/coarse_assignment.py --passages 21015324 --nlist 4096 \\
        --train-size 131072 --ef 16,64,256 --json docs/bench/coarse-assignment-21m.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import faiss
import numpy as np

from bench.index.scale_data import SyntheticCorpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--passages", type=int, default=21_015_324)
    parser.add_argument("--nlist", type=int, default=4096)
    parser.add_argument("--train-size", type=int, default=131_072)
    parser.add_argument("--hnsw-m", type=int, default=16)
    parser.add_argument("--ef-construction", type=int, default=40)
    parser.add_argument("--ef", default="16,64,256", help="efSearch values, comma separated")
    parser.add_argument("--nprobe", type=int, default=32)
    parser.add_argument("--vectors", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=256)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    corpus = SyntheticCorpus(count=args.passages)
    sample = np.ascontiguousarray(corpus.sample(args.train_size), dtype=np.float32)
    started = time.monotonic()
    exact = faiss.IndexFlatIP(corpus.dim)
    clustering = faiss.Clustering(corpus.dim, args.nlist)
    clustering.seed = 1234
    clustering.train(sample, exact)  # as IndexIVF trains with an inner-product quantizer
    train_s = time.monotonic() - started
    centroids = faiss.vector_to_array(clustering.centroids).reshape(args.nlist, corpus.dim)
    middle = args.passages // 2
    vectors = np.ascontiguousarray(
        corpus.rows(middle, min(args.passages, middle + args.vectors)), dtype=np.float32
    )
    queries, _ = corpus.queries(args.queries)
    queries = np.ascontiguousarray(queries, dtype=np.float32)
    _, best = exact.search(vectors, 1)
    _, probe = exact.search(queries, args.nprobe)
    rows = []
    for ef in (int(e) for e in args.ef.split(",")):
        graph = faiss.IndexHNSWFlat(corpus.dim, args.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efConstruction = args.ef_construction
        graph.add(centroids)
        graph.hnsw.efSearch = ef
        _, assigned = graph.search(vectors, 1)
        graph.hnsw.efSearch = max(ef, args.nprobe)
        _, probed = graph.search(queries, args.nprobe)
        found = np.mean(
            [len(set(p) & set(e)) / args.nprobe for p, e in zip(probed, probe, strict=True)]
        )
        rows.append(
            {
                "ef_search": ef,
                "assigned_as_exact": round(float(np.mean(assigned[:, 0] == best[:, 0])), 4),
                "probe_found_of_exact": round(float(found), 4),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    sizes = np.bincount(best[:, 0], minlength=args.nlist)
    result = {
        "command": " ".join(["bench/index/coarse_assignment.py", *(argv or sys.argv[1:])]),
        "machine": platform.processor() or platform.machine(),
        "passages": args.passages,
        "nlist": args.nlist,
        "train_size": len(sample),
        "train_s": round(train_s, 1),
        "vectors": len(vectors),
        "queries": len(queries),
        "nprobe": args.nprobe,
        "hnsw_m": args.hnsw_m,
        "ef_construction": args.ef_construction,
        "lists_empty_of_sample": int((sizes == 0).sum()),
        "hnsw": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
