"""A default answer's latency: hybrid retrieval (today's default) against dense retrieval (the
default the trust issue started from), on the default stack, in the same run.

Each question is asked twice on one running stack (``openbook up``'s processes: Gemma 3 270M
with the shipped adapters and their calibration, index wiki-2018), uncached, one client: once
as users ask it (``retrieval`` left to the index's default, ``hybrid``) and once with
``"retrieval": "dense"``; the order alternates question by question so that drift on a noisy
machine falls on both sides. Reported: median, p90 and mean end-to-end latency of each, the
ratio of medians and the mean of the per-question ratios with a 95% bootstrap interval, and the
answer tokens generated (the generator's work per answer is what retrieval can change: other
passages, other answers).

The adapter's weights are not compared here: a LoRA adapter is merged into the base weights
when the generator loads it, so two adapters of one base cost the same per token; what an
adapter changes is how many tokens it writes, reported by ``openbook experiments trust``.

    .venv/bin/python bench/load/default_latency.py --var var --n 60 --json latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import httpx
import numpy as np

from bench.load.run import REAL_GENERATOR, REAL_INDEX, demo_questions
from openbook_testkit.stack import LocalStack
from openbook_trainer.evaluation.statistics import bootstrap_ci

MODES = ("hybrid", "dense")  # the first is the default (no "retrieval" in the request)


def ask(url: str, question: str, mode: str) -> tuple[float, int]:
    """(seconds, answer tokens) of one uncached default request in ``mode``."""
    body: dict = {"question": question, "use_cache": False}
    if mode != MODES[0]:
        body["retrieval"] = mode
    started = time.perf_counter()
    reply = httpx.post(f"{url}/answer", json=body, timeout=300)
    seconds = time.perf_counter() - started
    reply.raise_for_status()
    answer = reply.json()
    if answer.get("retrieval", mode) != mode:
        raise RuntimeError(f"asked for {mode}, served {answer.get('retrieval')}")
    return seconds, int(answer["hypotheses"][0].get("num_tokens") or 0)


def summary(seconds: list[float], tokens: list[int]) -> dict[str, float]:
    s = np.asarray(seconds) * 1000
    return {
        "p50_ms": float(np.median(s)),
        "p90_ms": float(np.quantile(s, 0.9)),
        "mean_ms": float(s.mean()),
        "mean_tokens": float(np.mean(tokens)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--var", type=Path, default=Path("var"), help="openbook demo prepare's var/")
    ap.add_argument("--n", type=int, default=60, help="questions (each asked once per mode)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    var = args.var.resolve()
    if not (var / "models" / REAL_GENERATOR / "config.json").exists():
        print(f"{var}/models/{REAL_GENERATOR} is missing: run `openbook demo prepare` first")
        return 2
    questions = demo_questions()
    random.Random(args.seed).shuffle(questions)
    questions = questions[: args.n]
    seconds: dict[str, list[float]] = {m: [] for m in MODES}
    tokens: dict[str, list[int]] = {m: [] for m in MODES}
    stack = LocalStack(var, generator=REAL_GENERATOR, default_index=REAL_INDEX)
    print("starting the default stack (openbook up, Gemma 3 270M) ...", flush=True)
    stack.start(timeout_s=600)
    try:
        for q in questions[:2]:  # warm-up: the first requests pay for lazy loading
            for mode in MODES:
                ask(stack.url, q, mode)
        for i, q in enumerate(questions):
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                s, t = ask(stack.url, q, mode)
                seconds[mode].append(s)
                tokens[mode].append(t)
            print(f"\r{i + 1}/{len(questions)} questions", end="", flush=True)
    finally:
        stack.stop()
    print()
    ratios = np.asarray(seconds["hybrid"]) / np.asarray(seconds["dense"])
    per_token = [np.asarray(seconds[m]) / np.maximum(1, np.asarray(tokens[m])) for m in MODES]
    python = platform.python_version()
    result = {
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Python {python}",
        "stack": f"{REAL_GENERATOR}, shipped adapters, {REAL_INDEX}",
        "questions": len(questions),
        "modes": {m: summary(seconds[m], tokens[m]) for m in MODES},
        "ratio_of_medians": float(np.median(seconds["hybrid"]) / np.median(seconds["dense"])),
        "per_question_ratio": bootstrap_ci(ratios).as_dict(),
        "per_token_ratio_of_medians": float(np.median(per_token[0]) / np.median(per_token[1])),
    }
    print(f"machine: {result['machine']}; default stack ({result['stack']})")
    print("| retrieval | p50 ms | p90 ms | mean ms | answer tokens |")
    print("|---|---|---|---|---|")
    for m in MODES:
        r = result["modes"][m]
        print(
            f"| {m} | {r['p50_ms']:.0f} | {r['p90_ms']:.0f} | {r['mean_ms']:.0f} | "
            f"{r['mean_tokens']:.1f} |"
        )
    pq = result["per_question_ratio"]
    print(
        f"hybrid / dense: {result['ratio_of_medians']:.3f} (medians); per question "
        f"{pq['mean']:.3f} [{pq['low']:.3f}, {pq['high']:.3f}]; per answer token "
        f"{result['per_token_ratio_of_medians']:.3f} (medians)"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
