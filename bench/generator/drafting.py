"""Passage-drafted decoding (openbook/rag/drafting.py) on against off, in one process and run.

    .venv/bin/python bench/generator/drafting.py --requests 12 --draft-tokens 8

The requests of ``bench/generator/engine.py`` (``<var>/bench/generator-engine-requests.json``: SQuAD
questions with their top-5 passages, retrieved once), greedy RAG-Token, decoded one at a time by
the engine the generator service uses, alternately with drafting off and on (odd requests: on
first), so drift hits both alike. Reported: decode ms/token (the engine's steps after the
prefill, over the answer tokens), tokens per decoding step, drafted tokens accepted, end-to-end
ms/request, and how many answers are identical (they must all be).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage


def _decode(gen: RagGenerator, question: str, passages: list[Passage], opts, draft: int):
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="var/models/gemma-3-270m")
    ap.add_argument("--adapter", default="", help="a LoRA adapter to merge (as the service does)")
    ap.add_argument("--requests-file", default="var/bench/generator-engine-requests.json")
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--draft-tokens", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="as OPENBOOK_GENERATOR_DTYPE")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gen = RagGenerator.load(args.model, dtype=args.dtype)
    if args.adapter:
        gen.apply_adapter(Path(args.adapter), Path(args.model))
    data = json.loads(Path(args.requests_file).read_text())["requests"][: args.requests]
    opts = DecodingOptions(max_new_tokens=args.max_new_tokens)
    reqs = [(r["question"], [Passage(**p) for p in r["passages"]]) for r in data]
    _decode(gen, *reqs[0], opts, 0)  # warm-up
    _decode(gen, *reqs[0], opts, args.draft_tokens)
    runs: dict[int, list[dict]] = {0: [], args.draft_tokens: []}
    same = 0
    for i, (q, ps) in enumerate(reqs):
        order = [0, args.draft_tokens] if i % 2 == 0 else [args.draft_tokens, 0]
        texts = {}
        for draft in order:
            result, stats = _decode(gen, q, ps, opts, draft)
            runs[draft].append(stats)
            texts[draft] = result.hypotheses[0].token_ids
        same += texts[0] == texts[args.draft_tokens]
    print(f"processor: {platform.processor() or platform.machine()}, torch threads {args.threads}")
    print(f"model {args.model} ({gen.dtype}), {len(reqs)} requests, k=5, greedy RAG-Token")
    print("| drafting | decode ms/token | tokens/step | accepted/drafted | ms/request (p50) |")
    print("|---|---|---|---|---|")
    for draft, stats in runs.items():
        tokens = sum(s["tokens"] for s in stats)
        steps = sum(s["steps"] for s in stats)
        drafted = sum(s["drafted"] for s in stats)
        accepted = sum(s["accepted"] for s in stats)
        ms_tok = 1000 * sum(s["decode_s"] for s in stats) / tokens
        p50 = 1000 * statistics.median(s["total_s"] for s in stats)
        ratio = f"{accepted}/{drafted}" if drafted else "-"
        print(f"| {draft or 'off'} | {ms_tok:.1f} | {tokens / steps:.2f} | {ratio} | {p50:.0f} |")
    print(f"identical answers: {same}/{len(reqs)}")


if __name__ == "__main__":
    main()
