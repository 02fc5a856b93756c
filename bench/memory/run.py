"""Generator working memory: measured peak against the admission estimate (openbook/rag/memory.py).

For each request shape (k passages, beams, decoding mode) one fresh process loads the generator,
resets the kernel's peak-RSS mark, generates once, and reports how far resident memory rose above
what the loaded model holds, beside ``RagGenerator.memory.batch_bytes`` for that request. The
estimate is meant as an upper bound: the ratio measured / estimated must stay <= 1 for every
shape, and whether a shape is admitted under the default budget is printed with it.

    .venv/bin/python bench/memory/run.py                 # the default model from ./var
    .venv/bin/python bench/memory/run.py --model var/models/gemma-3-270m --shapes 5:1:rag-token

The service as a whole (its allocator, passage cache, gRPC and tokenizers, requests joining a
running batch, crowds of clients) is measured by ``bench/memory/service.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_SHAPES = [
    "5:1:rag-token",
    "20:1:rag-token",
    "5:4:rag-token",
    "5:4:rag-sequence-thorough",
    "5:16:rag-token",
    "5:16:rag-sequence-thorough",
    "50:1:rag-token",
    "100:1:rag-token",
]
QUESTION = "Who is the President of Peru?"


def _vm_hwm_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(model: str, index: str, shape: str, max_new_tokens: int, dtype: str) -> dict:
    """In this process: load, reset the peak mark, generate once (see the module docstring)."""
    import torch

    from openbook.rag import DecodingOptions, RagGenerator
    from openbook.types import Passage
    from openbook_generator.settings import GeneratorSettings

    k, beams, mode = shape.split(":")
    k, beams = int(k), int(beams)
    with sqlite3.connect(Path(index) / "passages.sqlite") as con:
        rows = con.execute("select id, title, text from passages limit ?", (k,)).fetchall()
    passages = [
        Passage(id=str(i), title=t, text=x, score=-0.1 * j) for j, (i, t, x) in enumerate(rows)
    ]
    generator = RagGenerator.load(model, dtype=dtype)
    options = DecodingOptions(
        mode=mode, num_beams=beams, num_return_sequences=1, max_new_tokens=max_new_tokens
    )
    shape_ = generator.request_shape(QUESTION, passages, options)
    estimate = generator.memory.batch_bytes([shape_])
    budget = GeneratorSettings().memory_mb * 2**20
    with torch.inference_mode():  # warm the allocator and kernels on a tiny request first
        generator.generate(QUESTION, passages[:1], DecodingOptions(max_new_tokens=2))
    Path("/proc/self/clear_refs").write_text("5")  # peak mark := current resident size
    base = _rss_bytes()
    started = time.perf_counter()
    result = generator.generate(QUESTION, passages, options)
    seconds = time.perf_counter() - started
    used = _vm_hwm_bytes() - base
    return {
        "shape": shape,
        "dtype": generator.dtype,
        "prompt_tokens": shape_.prompt_tokens,
        "loaded_mib": round(base / 2**20),
        "measured_mib": round(used / 2**20),
        "estimated_mib": round(estimate / 2**20),
        "ratio": round(used / estimate, 2),
        "admitted_by_default": estimate <= budget,
        "seconds": round(seconds, 1),
        "answer": result.hypotheses[0].text,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="var/models/gemma-3-270m")
    ap.add_argument("--index", default="var/indexes/wiki-2018", help="passages from here")
    ap.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="k:beams:mode")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument(
        "--dtype", default="auto", help="weights' precision (default: auto, the service's policy)"
    )
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child process: one shape
    args = ap.parse_args(argv)
    if args.one:
        print(
            json.dumps(measure(args.model, args.index, args.one, args.max_new_tokens, args.dtype))
        )
        return 0
    if not (Path(args.model) / "config.json").exists():
        print(f"{args.model} is missing: run `openbook demo prepare` first")
        return 2
    results = []
    for shape in args.shapes:
        print(f"{shape} ...", flush=True)
        out = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--index", args.index]
            + ["--max-new-tokens", str(args.max_new_tokens), "--dtype", args.dtype]
            + ["--one", shape],
            capture_output=True,
            text=True,
            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
        )
        if out.returncode != 0:
            print(out.stderr[-3000:])
            return 1
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print()
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs; model {args.model} "
        f"({results[0]['dtype']})"
    )
    from openbook_generator.settings import GeneratorSettings

    print(
        "| k:beams:mode | prompt tokens | measured MiB | estimated MiB | measured / estimated "
        f"| admitted ({GeneratorSettings().memory_mb:,} MiB budget) | seconds |"
    )
    print("|---|---:|---:|---:|---:|---|---:|")
    for r in results:
        print(
            f"| {r['shape']} | {r['prompt_tokens']} | {r['measured_mib']:,} "
            f"| {r['estimated_mib']:,} | {r['ratio']:.2f} "
            f"| {'yes' if r['admitted_by_default'] else 'no (413)'} | {r['seconds']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["ratio"] <= 1.0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
