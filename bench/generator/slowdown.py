"""What the generator's speed model reads while it serves: its slowdowns (prefill, step,
scoring; openbook_generator/speed.py) after each of a run of requests, from the service's
``openbook_generator_slowdown`` metric.

Starts the generator as users run it (``python -m openbook_generator``, the default settings
unless given) and sends it default questions (k=5, greedy), one at a time: with
``--passages new`` every request brings passages the service has not seen, with ``--passages
same`` every request the same five, which the passage cache then gives (their heads are not
prefilled again). A slowdown far from 1 that keeps moving under steady traffic is the speed
model misreading the work it is told about: admission plans every request with it
(docs/serving.md, "Admission").

    .venv/bin/python bench/generator/slowdown.py --passages same --json same.json
    .venv/bin/python bench/generator/slowdown.py --passages new --json new.json
    # another tree's service (git worktree add /work/bl-X X):
    .venv/bin/python bench/generator/slowdown.py \
        --env PYTHONPATH=/work/bl-X:/work/bl-X/services/generator --json X.json
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import sys
import time
import urllib.request
from pathlib import Path

from bench.generator.serving import generator_process

QUESTION = "who wrote it?"
K = 5


def _slowdowns(metrics_port: int) -> dict[str, float]:
    """The slowdown metric by kind, as a scrape reads it."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("openbook_generator_slowdown{"):
            kind = line.split('kind="', 1)[1].split('"', 1)[0]
            out[kind] = round(float(line.split()[-1]), 3)
    return out


def run(args: argparse.Namespace) -> dict:
    from openbook.v1 import common_pb2, generator_pb2

    with sqlite3.connect(args.index / "passages.sqlite") as con:
        rows = con.execute(
            "select id, title, text from passages limit ?", (K * args.requests,)
        ).fetchall()
    results: dict = {"passages": args.passages, "requests": []}
    with generator_process(args.model, args.adapter, {}, args.env, "openbook-slowdown-") as service:
        results["start"] = _slowdowns(service.metrics_port)
        print("start", json.dumps(results["start"]), flush=True)
        for i in range(args.requests):
            at = 0 if args.passages == "same" else i * K
            passages = [
                common_pb2.Passage(id=str(pid), title=title, text=text, score=0.0)
                for pid, title, text in rows[at : at + K]
            ]
            started = time.perf_counter()
            service.stub.Generate(
                generator_pb2.GenerateRequest(question=QUESTION, passages=passages), timeout=120
            )
            seconds = round(time.perf_counter() - started, 3)
            row = {"seconds": seconds, **_slowdowns(service.metrics_port)}
            results["requests"].append(row)
            print(i, json.dumps(row), flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", type=Path, default=Path("var/models/gemma-3-270m"))
    ap.add_argument("--adapter", type=Path, default=Path("var/models/gemma-3-270m-squad-lora"))
    ap.add_argument("--index", type=Path, default=Path("var/indexes/wiki-2018"))
    ap.add_argument("--passages", choices=("same", "new"), default="same")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument(
        "--env", nargs="*", default=[], help="NAME=VALUE for the service (PYTHONPATH: a tree)"
    )
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = run(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
