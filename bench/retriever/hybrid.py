"""What hybrid retrieval costs: per-question latency of dense, BM25 and hybrid search over one
index with both views, in one run (interleaved, so the ratios share the machine's state).

Each question is searched one at a time, as the retriever serves a single /answer, with the
encoder already loaded; the modes take turns question by question so a noisy neighbour slows
all three alike. Reported: p50 / p90 milliseconds per mode and hybrid's p50 as a ratio of
dense's, plus the reference the ratio matters against: a default answer's generation time is
measured by bench/load (about a second on 2 CPU cores), which retrieval adds to.

    .venv/bin/python bench/retriever/hybrid.py --index var/indexes/wiki-2018 [--n 200]
        [--query-encoder-adapter var/models/all-MiniLM-L6-v2-squad-query-lora] [--json out]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import numpy as np

from openbook.index import open_index
from openbook.index.encoders import load_adapted_encoder
from openbook.index.request import SearchRequest

MODES = ("dense", "bm25", "hybrid")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--index", type=Path, default=Path("var/indexes/wiki-2018"))
    ap.add_argument("--questions", type=Path, default=Path("data/squad/questions.jsonl"))
    ap.add_argument("--query-encoder-adapter", type=Path, default=None)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    rows = [json.loads(line) for line in args.questions.read_text().splitlines() if line]
    questions = [r["question"] for r in random.Random(0).sample(rows, min(args.n, len(rows)))]
    encoder = (
        load_adapted_encoder(args.query_encoder_adapter) if args.query_encoder_adapter else None
    )
    times: dict[str, list[float]] = {m: [] for m in MODES}
    with open_index(args.index, verify=False) as index:
        missing = {"dense", "bm25"} - set(index.views)
        if missing:
            raise SystemExit(f"{args.index}: needs both views, lacks {sorted(missing)}")
        for mode in MODES:  # warm: encoder, bm25 mmap, page cache
            index.search(
                SearchRequest(questions[:3], k=args.k, retrieval=mode),
                encoder=encoder if mode != "bm25" else None,
            )
        for q in questions:
            for mode in MODES:
                enc = encoder if mode != "bm25" else None
                start = time.perf_counter()
                index.search(SearchRequest([q], k=args.k, retrieval=mode), encoder=enc)
                times[mode].append(1000 * (time.perf_counter() - start))
    report = {
        "index": str(args.index),
        "passages": len(index),
        "questions": len(questions),
        "k": args.k,
        "machine": platform.processor() or platform.machine(),
        "ms": {
            m: {"p50": float(np.percentile(t, 50)), "p90": float(np.percentile(t, 90))}
            for m, t in times.items()
        },
    }
    report["hybrid_over_dense_p50"] = report["ms"]["hybrid"]["p50"] / report["ms"]["dense"]["p50"]
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
