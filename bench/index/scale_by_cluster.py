"""recall@100 of a built scale run by the size of each query's cluster.

At 21M passages a query's exact top-100 lies inside its own cluster (``scale_data``), so
recall depends on the cluster's size against the lists' length: a smaller run with fewer
``--centres`` and 21M's list length measures the clusters 21M has, and this breakdown lets
its recall be re-weighted by 21M's share of queries per size (docs/benchmarks.md, "The
paper's scale"). In one process, both shards loaded (no checksums), merged by score:

    .venv/bin/python bench/index/scale_by_cluster.py WORK 32:8:64,32:16:64 [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from bench.index.scale_build import ScaleConfig, row_of
from bench.index.scale_truth import RunningTopK
from openbook.index.loaded import open_index
from openbook.index.request import SearchRequest

BINS = (0, 5_000, 10_000, 20_000, 40_000, 80_000, 10**12)


def by_size(sizes: np.ndarray, recall: np.ndarray) -> list[dict[str, float]]:
    """Mean recall and query count per cluster-size bin (``BINS``), the empty ones left out."""
    out = []
    for lo, hi in zip(BINS, BINS[1:], strict=False):
        sel = (sizes >= lo) & (sizes < hi)
        if sel.any():
            out.append(
                {
                    "from": lo,
                    "to": hi,
                    "queries": int(sel.sum()),
                    "recall_at_100": float(recall[sel].mean()),
                }
            )
    return out


def query_share(passages: int, centres: int) -> list[dict[str, float]]:
    """The share of queries (drawn from passages) per cluster-size bin of a corpus."""
    from bench.index.scale_data import SyntheticCorpus

    sizes = SyntheticCorpus(count=passages, n_centres=centres).cluster_sizes()
    weights = sizes / sizes.sum()
    return [
        {"from": lo, "to": hi, "share": float(weights[(sizes >= lo) & (sizes < hi)].sum())}
        for lo, hi in zip(BINS, BINS[1:], strict=False)
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("work", type=Path, help="a finished run's --work directory")
    p.add_argument("settings", help="nprobe:rerank:ef_search,...")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    config = ScaleConfig(**json.loads((args.work / "state.json").read_text())["config"])
    corpus = config.corpus()
    queries, sources = corpus.queries(config.queries)
    truth = RunningTopK(queries, 100)
    truth.load(args.work / "truth.npz")
    sizes = corpus.cluster_sizes()[corpus.centres_of(sources)]
    shards = [open_index(d, verify=False) for d in sorted(args.work.glob("index/shard-*/scale"))]
    report: dict = {
        "work": str(args.work),
        "passages": config.passages,
        "centres": config.n_centres,
    }
    report["query_cluster_sizes"] = sizes.round().tolist()
    report["settings"] = []
    for item in args.settings.split(","):
        nprobe, rerank, ef = (int(v) for v in item.split(":"))
        for s in shards:
            s.set_search_params(nprobe=nprobe, rerank=rerank, ef_search=ef)
        recall = np.empty(len(queries))
        for i in range(len(queries)):
            request = SearchRequest(k=100, query_vectors=queries[i : i + 1])
            hits = sorted((h for s in shards for h in s.search(request)[0]), key=lambda h: -h.score)
            found = {row_of(h.id) for h in hits[:100]}
            recall[i] = len(found & set(truth.rows[i].tolist())) / 100
        row = {
            "nprobe": nprobe,
            "rerank": rerank,
            "ef_search": ef,
            "recall_at_100": float(recall.mean()),
        }
        row["by_cluster_size"] = by_size(sizes, recall)
        report["settings"].append(row)
        print(json.dumps(row), flush=True)
    for s in shards:
        s.close()
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
