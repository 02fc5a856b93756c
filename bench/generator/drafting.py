"""Passage-drafted decoding (openbook/rag/drafting.py) on against off, in one process and run.

    .venv/bin/python bench/generator/drafting.py --requests 40 --draft-tokens 2,4,8 \
        --adapter var/models/gemma-3-270m-squad-lora --json var/bench/drafting-speed.json

SQuAD questions with their top-k passages from ``--index`` (``bench/generator/engine.py``'s
seeded draw, retrieved once and cached under ``<var>/bench``), greedy RAG-Token, decoded one at
a time by the engine the generator service uses, with drafting off and at each
``--draft-tokens`` size, request by request in rotating order so that drift hits every size
alike. Reported per size: decode ms/token (the engine's steps after the prefill, over the
answer tokens), tokens per decoding step, drafted tokens accepted, ms/request (p50), the paired
ratios of decode and request time against drafting off with their 95% intervals (the
evaluation's paired bootstrap on the log times), and how many answers have the undrafted ids
(they must all).

Exactness (issue 45's proof; timing-free, so a busy machine does not matter):

    .venv/bin/python bench/generator/drafting.py --exactness 500 --index wiki-2018 \
        --adapter data/adapters/gemma-3-270m-squad --out var/bench/drafting-exactness.jsonl

decodes ``--exactness`` SQuAD questions (the seeded draw of ``bench/generator/engine.py``, with
their top-k passages from ``--index``) with drafting off and on, in each ``--modes``, and
compares token ids (equal), log p(y|x) and the passage posteriors (largest differences
reported). One JSON line per request is appended to ``--out``: an interrupted run resumes.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import time
from pathlib import Path

import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage


def decode_once(gen: RagGenerator, question: str, passages: list[Passage], opts, draft: int):
    """One request through ``gen``'s engine as ``RagGenerator.generate`` drives it (add, then
    step until done), so that the engine's counters can be read: the result and its timings,
    decoding steps after the prefill and drafted/accepted tokens. ``draft``: tokens drafted
    per step (0 = off)."""
    gen.set_draft_tokens(draft)
    with torch.inference_mode():
        engine = gen.engine()
        started = time.perf_counter()
        engine.add(question, passages, opts)
        prefilled = time.perf_counter()
        steps = 0
        while True:
            out = engine.step()
            steps += 1
            if out:
                break
        done = time.perf_counter()
    ((_, result),) = out
    tokens = len(result.hypotheses[0].token_ids)
    return result, dict(
        decode_s=done - prefilled,
        total_s=done - started,
        tokens=tokens,
        steps=steps,
        drafted=engine.drafted_tokens,
        accepted=engine.accepted_tokens,
    )


def _posteriors(result) -> list[float]:
    """The best hypothesis' passage posteriors, flattened: per token (RAG-Token) or over the
    answer (RAG-Sequence)."""
    best = result.hypotheses[0]
    if best.token_doc_posteriors is not None:
        return [p for token in best.token_doc_posteriors for p in token]
    return list(best.doc_posterior or [])


def exactness(gen: RagGenerator, args: argparse.Namespace) -> None:
    """Drafting on against off on ``args.exactness`` requests, resumable (module docstring)."""
    from tqdm import tqdm

    reqs = _requests(args, args.exactness)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            row = json.loads(line)
            done.add((row["i"], row["mode"]))
    # Question by question, every mode of a question together: an interrupted run still covers
    # each mode on the same questions.
    todo = [(i, m) for i in range(len(reqs)) for m in args.modes.split(",") if (i, m) not in done]
    with out.open("a") as sink:
        for i, mode in tqdm(todo, desc="drafting exactness", unit="request"):
            r = reqs[i]
            passages = [Passage(**p) for p in r["passages"]]
            opts = DecodingOptions(mode=mode, max_new_tokens=args.max_new_tokens)
            off, _ = decode_once(gen, r["question"], passages, opts, 0)
            on, stats = decode_once(gen, r["question"], passages, opts, args.draft_tokens[0])
            a, b = off.hypotheses[0], on.hypotheses[0]
            pa, pb = _posteriors(off), _posteriors(on)
            row = dict(
                i=i,
                mode=mode,
                same_ids=[h.token_ids for h in off.hypotheses]
                == [h.token_ids for h in on.hypotheses],
                log_prob_diff=abs(a.log_prob - b.log_prob),
                posterior_diff=max((abs(x - y) for x, y in zip(pa, pb, strict=False)), default=0),
                tokens=stats["tokens"],
                steps=stats["steps"],
                drafted=stats["drafted"],
                accepted=stats["accepted"],
            )
            sink.write(json.dumps(row) + "\n")
            sink.flush()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    print(f"model {args.model} ({gen.dtype}), k={args.k}, index {args.index}, greedy")
    print(
        "| mode | requests | identical ids | max abs d log p | max abs d posterior "
        "| accepted/drafted | tokens/step |"
    )
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes.split(","):
        mine = [r for r in rows if r["mode"] == mode]
        if not mine:
            continue
        same = sum(r["same_ids"] for r in mine)
        dlp = max(r["log_prob_diff"] for r in mine)
        dpost = max(r["posterior_diff"] for r in mine)
        accepted = sum(r["accepted"] for r in mine)
        drafted = sum(r["drafted"] for r in mine)
        per_step = sum(r["tokens"] for r in mine) / max(1, sum(r["steps"] for r in mine))
        print(
            f"| {mode} | {len(mine)} | {same}/{len(mine)} | {dlp:.2e} | {dpost:.2e} | "
            f"{accepted}/{drafted} | {per_step:.2f} |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="var/models/gemma-3-270m")
    ap.add_argument("--adapter", default="", help="a LoRA adapter to merge (as the service does)")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument(
        "--draft-tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[8],
        help="drafted tokens per step; several, comma-separated, for the speed run",
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="as OPENBOOK_GENERATOR_DTYPE")
    ap.add_argument("--exactness", type=int, default=0, help="requests of the exactness run")
    ap.add_argument("--modes", default="rag-token,rag-sequence-fast", help="exactness modes")
    ap.add_argument("--index", default="wiki-2018", help="exactness: where passages come from")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--var", default="var")
    ap.add_argument("--data", default="data")
    ap.add_argument("--out", default="var/bench/drafting-exactness.jsonl")
    ap.add_argument("--json", default="", help="speed: write the table and every request here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = RagGenerator.load(args.model, dtype=args.dtype)
    if args.adapter:
        gen.apply_adapter(Path(args.adapter), Path(args.model))
    if args.exactness:
        exactness(gen, args)
        return
    speed(gen, args)


def _requests(args: argparse.Namespace, n: int) -> list[dict]:
    """``n`` SQuAD questions with their top-k passages: ``bench/generator/engine.py``'s seeded
    draw (cached under ``<var>/bench``, so both scripts decode the same requests)."""
    from bench.generator.engine import load_requests

    req_args = argparse.Namespace(
        var=Path(args.var), index=args.index, k=args.k, questions=n, seed=0, data=Path(args.data)
    )
    return load_requests(req_args)


def paired_ratio(on: list[float], off: list[float]) -> tuple[float, float, float]:
    """Geometric mean of on/off over paired requests and its 95% interval: the evaluation's
    paired bootstrap (``paired_difference_ci``) on the log times."""
    from openbook_trainer.evaluation.statistics import paired_difference_ci

    ci = paired_difference_ci([math.log(x) for x in on], [math.log(x) for x in off])
    return math.exp(ci.mean), math.exp(ci.low), math.exp(ci.high)


def speed(gen: RagGenerator, args: argparse.Namespace) -> None:
    """Drafting off against each ``--draft-tokens`` size, request by request in rotating order
    (drift hits every size alike); paired ratios against off with their 95% intervals."""
    from tqdm import tqdm

    sizes = [0] + [d for d in args.draft_tokens if d > 0]
    data = _requests(args, args.requests)
    opts = DecodingOptions(max_new_tokens=args.max_new_tokens)
    reqs = [(r["question"], [Passage(**p) for p in r["passages"]]) for r in data]
    # Off: the first size to decode a request would prefill it and the others reuse that.
    gen.backend.set_passage_cache(0)
    for draft in sizes:  # warm-up
        decode_once(gen, *reqs[0], opts, draft)
    runs: dict[int, list[dict]] = {d: [] for d in sizes}
    same = dict.fromkeys(sizes, 0)
    for i, (q, ps) in enumerate(tqdm(reqs, desc="requests")):
        order = sizes[i % len(sizes) :] + sizes[: i % len(sizes)]
        ids = {}
        for draft in order:
            result, stats = decode_once(gen, q, ps, opts, draft)
            runs[draft].append(stats)
            ids[draft] = result.hypotheses[0].token_ids
        for draft in sizes:
            same[draft] += ids[draft] == ids[0]
    lines = [
        f"processor: {platform.processor() or platform.machine()}, torch threads {args.threads}",
        f"model {args.model} ({gen.dtype}), {len(reqs)} requests, k={args.k}, greedy RAG-Token, "
        f"up to {args.max_new_tokens} new tokens",
        "| drafting | decode ms/token | tokens/step | accepted/drafted | ms/request (p50) "
        "| decode time vs off (95% CI) | request time vs off (95% CI) | identical ids |",
        "|---|---|---|---|---|---|---|---|",
    ]
    off = runs[0]
    for draft, stats in runs.items():
        tokens = sum(s["tokens"] for s in stats)
        steps = sum(s["steps"] for s in stats)
        drafted = sum(s["drafted"] for s in stats)
        accepted = sum(s["accepted"] for s in stats)
        ms_tok = 1000 * sum(s["decode_s"] for s in stats) / tokens
        p50 = 1000 * statistics.median(s["total_s"] for s in stats)
        ratio = f"{accepted}/{drafted}" if drafted else "-"
        vs = ["-", "-"]
        if draft:
            for j, key in enumerate(("decode_s", "total_s")):
                r, lo, hi = paired_ratio([s[key] for s in stats], [s[key] for s in off])
                vs[j] = f"{r:.3f}x ({lo:.3f}-{hi:.3f})"
        lines.append(
            f"| {draft or 'off'} | {ms_tok:.1f} | {tokens / steps:.2f} | {ratio} | {p50:.0f} "
            f"| {vs[0]} | {vs[1]} | {same[draft]}/{len(reqs)} |"
        )
    print("\n".join(lines))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(
            json.dumps({"args": vars(args), "table": lines, "runs": runs}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
