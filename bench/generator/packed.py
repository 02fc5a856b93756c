"""Weights packed for oneDNN (openbook/rag/packed_weights.py) against the model's own modules.

    .venv/bin/python bench/generator/packed.py --requests 200 \
        --adapter var/models/gemma-3-270m-squad-lora --json var/bench/packed.json

The default generator loaded twice in one process, plain and packed (``RagGenerator.
pack_weights``, what the service does by default), decodes SQuAD questions with their top-k
passages (``bench/generator/engine.py``'s seeded draw), greedy RAG-Token, one request at a
time, the two alternating request by request so that drift hits both alike. Reported: how many
answers are bitwise the same (token ids, log p(y|x), every per-token passage posterior) and how
many have the same token ids, the
largest difference of log p(y|x), ms/request and decode ms/step of each, and the paired ratios
(plain / packed) with their 95% intervals (the evaluation's paired bootstrap on the log times).

``--dtype float32`` packs a float32 model, as the service does by default (``auto``; the
model's dtype on a CPU without bf16 arithmetic): torch's plain float32 product is MKL's, the
packed one oneDNN's, another rounding: how much faster, how many answers change.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch
from tqdm import tqdm

from bench.generator.drafting import _requests, decode_once, paired_ratio
from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.packed_weights import Packing
from openbook.types import Passage
from openbook_generator.model_setup import ModelSetup


def _load(args: argparse.Namespace, packed: bool) -> RagGenerator:
    gen = RagGenerator.load(args.model, dtype=args.dtype)
    if args.adapter:  # merged first, then set up: as the service loads a model
        gen.apply_adapter(Path(args.adapter), Path(args.model))
    packing = Packing(args.packing) if packed else Packing.OFF
    # no passage cache: each side prefills every request (no reuse across sides)
    ModelSetup(passage_cache_bytes=0, packed_weights=packing).apply(gen)
    if packed and not gen.weights_packed:
        raise SystemExit(
            f"{args.model} in {gen.dtype} is not packed under --packing {args.packing}"
        )
    return gen


def _same(a, b) -> bool:
    return (
        a.token_ids == b.token_ids
        and a.log_prob == b.log_prob
        and a.token_doc_posteriors == b.token_doc_posteriors
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="var/models/gemma-3-270m")
    ap.add_argument("--adapter", default="", help="a LoRA adapter to merge (as the service does)")
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="as OPENBOOK_GENERATOR_DTYPE")
    ap.add_argument("--packing", default="auto", choices=["auto", "bf16"], help="as the setting")
    ap.add_argument("--index", default="wiki-2018")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--var", default="var")
    ap.add_argument("--data", default="data")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sides = {"plain": _load(args, packed=False), "packed": _load(args, packed=True)}
    data = _requests(args, args.requests)
    reqs = [(r["question"], [Passage(**p) for p in r["passages"]]) for r in data]
    opts = DecodingOptions(max_new_tokens=args.max_new_tokens)
    for gen in sides.values():  # warm-up
        decode_once(gen, *reqs[0], opts, 0)
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    same, same_ids, most = 0, 0, 0.0
    for i, (q, ps) in enumerate(tqdm(reqs, desc="requests")):
        best = {}
        for name in list(sides) if i % 2 == 0 else list(sides)[::-1]:
            result, stats = decode_once(sides[name], q, ps, opts, 0)
            runs[name].append(stats)
            best[name] = result.hypotheses[0]
        same += _same(best["plain"], best["packed"])
        same_ids += best["plain"].token_ids == best["packed"].token_ids
        most = max(most, abs(best["plain"].log_prob - best["packed"].log_prob))
    lines = [
        f"processor: {platform.processor() or platform.machine()} "
        f"({torch.backends.cpu.get_cpu_capability()}), torch {torch.__version__}, "
        f"{args.threads} threads",
        f"model {args.model} ({sides['plain'].dtype}{', packing ' + args.packing}), "
        f"{len(reqs)} requests, k={args.k}, greedy RAG-Token, up to {args.max_new_tokens} tokens",
        f"bitwise the same answers: {same}/{len(reqs)}; the same token ids: {same_ids}; "
        f"largest |log p(y|x) difference|: {most:.3g}",
        "| weights | ms/request (p50) | decode ms/step | prefill ms (p50) |",
        "|---|---:|---:|---:|",
    ]
    for name, stats in runs.items():
        steps = sum(s["steps"] for s in stats)
        per_step = 1000 * sum(s["decode_s"] for s in stats) / steps
        p50 = 1000 * statistics.median(s["total_s"] for s in stats)
        prefill = 1000 * statistics.median(s["total_s"] - s["decode_s"] for s in stats)
        lines.append(f"| {name} | {p50:.0f} | {per_step:.1f} | {prefill:.0f} |")
    ratios = {}
    for key in ("total_s", "decode_s"):
        r, lo, hi = paired_ratio([s[key] for s in runs["plain"]], [s[key] for s in runs["packed"]])
        ratios[key] = (r, lo, hi)
        lines.append(f"plain / packed, {key}: {r:.3f}x [{lo:.3f}, {hi:.3f}] (paired, 95%)")
    print("\n".join(lines))
    if args.json:
        out = {"lines": lines, "same": same, "same_ids": same_ids, "n": len(reqs)}
        out["max_logp_diff"] = most
        out.update(runs=runs, ratios=ratios)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
