"""The paper's scale on this machine: a DPR-shaped (768-d) corpus of ``--passages`` synthetic
vectors built as a compressed (IVF-PQ), sharded files index, served one process per shard,
measured: build time, bytes on disk, RSS per shard, p50/p99 latency at k=5 and k=100, and
recall@100 against exact search (issue 41, item 4; docs/benchmarks.md, "The paper's scale").

    .venv/bin/python bench/index/scale.py --passages 2000000 --shards 2 --json out.json
    # the paper's 21,015,324 passages, in the background, resumable:
    nohup nice -n 10 .venv/bin/python bench/index/scale.py --passages 21015324 --shards 2 \\
        --json docs/bench/scale-21m.json > var/bench/scale/21m.log 2>&1 &

Vectors: ``scale_data.SyntheticCorpus`` (clustered, anisotropic, seeded per block, streamed).
Build: ``scale_build`` (the project's shard format, one trained quantizer, resumable; state
under ``--work``, default ``var/bench/scale/<passages>x<shards>``). Ground truth: exact top-100
of ``--queries`` perturbed passages, folded in as the vectors stream past
(``scale_truth``), cached in the work directory. Serving: ``scale_serve`` (one process per
shard, the servicer's search call, the gateway's merge). ``--engine milvus``: the same corpus
and queries in Milvus Lite (``scale_milvus``).

Re-running the same command resumes an interrupted build and re-measures a finished one.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.index.scale_build import (
    ScaleConfig,
    ScaleRun,
    build,
    disk_bytes,
)
from bench.index.scale_truth import recall_at_k

DEFAULT_SWEEP = ((4, 0), (8, 0), (4, 4), (8, 4), (16, 4), (32, 4))


def machine() -> dict[str, Any]:
    """The processor and memory, and the load when measured (the machine is shared)."""
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        model = next(
            (ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")),
            "",
        )
    except OSError:
        pass
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) * 1024
    return {
        "processor": model or platform.processor(),
        "cpus": os.cpu_count(),
        "memory_bytes": mem,
        "loadavg": os.getloadavg(),
        "note": "shared with other sessions' builds and tests while measured",
    }


def index_report(args: argparse.Namespace, config: ScaleConfig) -> dict[str, Any]:
    if args.engine == "milvus":
        return {"type": f"milvus {args.milvus_index}", "note": "the engine's own parameters"}
    return {
        "type": "ivfpq",
        "nlist": config.nlist,
        "pq_m": config.pq_m,
        "nbits": 8,
        "nprobe": config.nprobe,
        "rerank": config.rerank,
        "train_size": min(config.train_size, config.passages),
        "vectors_dtype": config.vectors_dtype,
        "coarse_quantizer": config.coarse_quantizer,
        **(
            {
                "hnsw_m": config.hnsw_m,
                "ef_construction": config.ef_construction,
                "ef_search": config.ef_search,
            }
            if config.coarse_quantizer == "hnsw"
            else {}
        ),
    }


def _parse_sweep(text: str) -> list[tuple[int, ...]]:
    """``nprobe:rerank[:ef_search]`` settings (ef_search: an hnsw coarse quantizer's)."""
    if not text:
        return []
    settings = []
    for item in text.split(","):
        nprobe, rerank, *ef = item.split(":") + ([] if ":" in item else ["0"])
        settings.append((int(nprobe), int(rerank or 0), *(int(e) for e in ef[:1])))
    return settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--passages", type=int, required=True)
    p.add_argument("--shards", type=int, default=2)
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--work", type=Path, help="state, truth and shards (default var/bench/scale/NxS)"
    )
    p.add_argument("--engine", choices=("files", "milvus"), default="files")
    p.add_argument(
        "--milvus-index",
        choices=("flat", "hnsw", "hnsw-sq8"),
        default="hnsw",
        help="the Milvus index of --engine milvus",
    )
    p.add_argument("--queries", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nlist", type=int, default=256)
    p.add_argument("--pq-m", type=int, default=96)
    p.add_argument("--nprobe", type=int, default=8)
    p.add_argument("--rerank", type=int, default=4)
    p.add_argument("--train-size", type=int, default=65_536)
    p.add_argument(
        "--coarse-quantizer",
        choices=("flat", "hnsw"),
        default="flat",
        help="ivfpq's list assignment: exact, or an HNSW graph of the centroids",
    )
    p.add_argument("--hnsw-m", type=int, default=32, help="--coarse-quantizer hnsw: graph M")
    p.add_argument(
        "--ef-construction", type=int, default=128, help="--coarse-quantizer hnsw: graph build"
    )
    p.add_argument(
        "--ef-search",
        type=int,
        default=128,
        help="--coarse-quantizer hnsw: efSearch assigning the vectors, and the probe's default",
    )
    p.add_argument(
        "--centres",
        type=int,
        default=4096,
        help="the corpus's clusters (scale_data; fewer: a smaller N with a larger N's clusters)",
    )
    p.add_argument(
        "--vectors-dtype",
        choices=("float32", "float16"),
        default="float32",
        help="vectors.npy's dtype (float32: the product's layout; float16: half the disk)",
    )
    p.add_argument(
        "--sweep",
        default=",".join(f"{a}:{b}" for a, b in DEFAULT_SWEEP),
        help="nprobe:rerank[:ef_search] settings for the recall/latency curve ('' for none)",
    )
    p.add_argument("--no-verify", action="store_true", help="load shards without checksums")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument(
        "--remove-after", action="store_true", help="delete the built shards once measured"
    )
    return p.parse_args(argv)


def run_files(args: argparse.Namespace, config: ScaleConfig, work: Path) -> dict[str, Any]:
    from bench.index.scale_serve import measure, set_params, shard_processes, sweep

    run = ScaleRun(work, config)
    run.state["phase"] = "building"
    run.save_state()
    built = build(run, progress=not args.no_progress)
    run.state["phase"] = "measuring"
    run.save_state()
    files = {"vectors.npy": 0, "index.faiss": 0, "passages.sqlite": 0}
    for d in built.shard_dirs:
        for name in files:
            files[name] += (d / name).stat().st_size
    result: dict[str, Any] = {
        "build_s": built.build_s,
        "train_s": built.train_s,
        "shard_build_s": built.shard_s,
        "disk_bytes": disk_bytes(built.shard_dirs),
        "disk_bytes_by_file": files,
    }
    with shard_processes(built.shard_dirs, verify=not args.no_verify) as procs:
        result["load_s"] = [round(p.load_s, 3) for p in procs]
        result["verified_on_load"] = not args.no_verify
        set_params(procs, nprobe=config.nprobe, rerank=config.rerank)
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
        result["sweep"] = sweep(procs, built.queries, built.truth, _parse_sweep(args.sweep))
    run.state["phase"] = "done"
    run.save_state()
    if args.remove_after:
        shutil.rmtree(run.index_root, ignore_errors=True)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = ScaleConfig(
        passages=args.passages,
        shards=args.shards if args.engine == "files" else 1,
        seed=args.seed,
        nlist=args.nlist,
        pq_m=args.pq_m,
        nprobe=args.nprobe,
        rerank=args.rerank,
        train_size=args.train_size,
        queries=args.queries,
        vectors_dtype=args.vectors_dtype,
        coarse_quantizer=args.coarse_quantizer,
        hnsw_m=args.hnsw_m,
        ef_construction=args.ef_construction,
        ef_search=args.ef_search,
        n_centres=args.centres,
    )
    engine = args.engine
    work = args.work or Path("var/bench/scale") / f"{engine}-{config.passages}x{config.shards}"
    started = time.monotonic()
    before = machine()
    if engine == "files":
        result = run_files(args, config, work)
    else:
        from bench.index.scale_milvus import run_milvus

        result = run_milvus(args, config, work)
    report = {
        "passages": config.passages,
        "shards": config.shards,
        "dim": config.dim,
        "engine": engine,
        **result,
        "queries": config.queries,
        "index": index_report(args, config),
        "data": f"bench/index/scale_data.py: {config.n_centres} Zipf-weighted Gaussian centres, "
        "rank-128 "
        "power-law noise, lognormal(0, 0.1) norms, unnormalised inner product; queries are "
        "perturbed passages",
        "machine": {"before": before, "after": machine()},
        "wall_s": round(time.monotonic() - started, 1),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join(
            ["bench/index/scale.py", *(argv if argv is not None else sys.argv[1:])]
        ),
    }
    text = json.dumps(report, indent=2) + "\n"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    sys.exit(main())
