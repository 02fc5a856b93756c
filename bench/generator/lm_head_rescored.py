"""The int8 LM heads as served, rescored, on a real model's hidden states (issue 45, item 2).

    .venv/bin/python bench/generator/lm_head_rescored.py --json var/bench/lm-head-rescored.json

``bench/generator/lm_head.py`` times the products alone on random weights; what an int8 head
costs as ``OPENBOOK_GENERATOR_LM_HEAD=int8`` serves it also depends on how many tokens each
row's screen sends back to the full-precision weights, which depends on a trained model's
hidden states. This captures the final hidden states of every decoding step of the default
generator (``var/models/gemma-3-270m``, greedy RAG-Token, k=5, ``--new-tokens`` tokens) on
``--requests`` SQuAD questions (``bench/generator/llamacpp.py``'s requests), then times, on those
same states, the alternating paths:

* ``packed``: the model's head, its bf16 weights packed for oneDNN (what the service serves);
* ``weight-only`` and ``onednn``: :class:`~openbook.rag.backends.int8_head.Int8Head` with each
  int8 product (``Int8Product``), the near-best tokens of each row scored again exactly.

at the 5 rows of one request's step and at 40 (8 steps stacked, as 8 requests decoding
together). Reported: the median ms per step of each path (the best of 3 alternating rounds),
the tokens rescored per step, rows sent wholly to full precision, and whether every row's
greedy token is the packed head's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.generator.engine import machine_info
from bench.generator.llamacpp import make_requests
from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.backends.int8_head import Int8Head, Int8Product
from openbook.rag.packed_weights import PackedLinear

ROOT = Path(__file__).resolve().parents[2]


def capture_steps(model_dir: Path, data_dir: Path, requests: int, k: int, new_tokens: int):
    """The final hidden states (k, d) of every decoding step of ``requests`` answers."""
    gen = RagGenerator.load(model_dir, device="cpu", dtype="auto")
    head = gen.backend.model.get_output_embeddings()
    captured: list[torch.Tensor] = []

    def keep(_module, inputs, _output) -> None:
        flat = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
        if len(flat) == k:  # a decoding step's rows (the prefill's last positions too)
            captured.append(flat.clone())

    hook = head.register_forward_hook(keep)
    options = DecodingOptions(
        mode="rag-token", num_beams=1, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )
    with torch.inference_mode():
        for question, passages in make_requests(data_dir, requests, k, 100, 0):
            gen.generate(question, passages, options)
    hook.remove()
    return head.weight.detach(), captured


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--model-dir", type=Path, default=ROOT / "var/models/gemma-3-270m")
    ap.add_argument("--data-dir", type=Path, default=ROOT / "data")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    weight, steps = capture_steps(args.model_dir, args.data_dir, args.requests, 5, args.new_tokens)
    plain = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=weight.dtype)
    plain.weight.data = weight
    heads: dict[str, torch.nn.Module] = {"packed": PackedLinear(plain)}
    for product in (Int8Product.WEIGHT_ONLY, Int8Product.ONEDNN):
        heads[product.value] = Int8Head(weight, product)
    results = []
    with torch.inference_mode():
        for rows in (5, 40):
            group = rows // 5
            batches = [torch.cat(steps[i : i + group]) for i in range(0, len(steps), group)]
            batches = [b for b in batches if len(b) == rows]
            reference = [heads["packed"](b).float().argmax(1) for b in batches]
            row: dict = {"rows": rows, "steps": len(batches), "ms": {}, "same_greedy": {}}
            times: dict[str, list[float]] = {name: [] for name in heads}
            for _ in range(3):  # alternating rounds: drift hits every path alike
                for name, head in heads.items():
                    start = time.perf_counter()
                    for batch in batches:
                        head(batch)
                    times[name].append((time.perf_counter() - start) / len(batches) * 1e3)
            for name, head in heads.items():
                row["ms"][name] = min(times[name])
                if isinstance(head, Int8Head):
                    full = head.full_steps
                    per_step = []
                    same = 0
                    for batch, want in zip(batches, reference, strict=True):
                        start_tokens = head.rescored_tokens
                        got = head(batch).float().argmax(1)
                        per_step.append(head.rescored_tokens - start_tokens)
                        same += int(torch.equal(got, want))
                    row["same_greedy"][name] = f"{same}/{len(batches)}"
                    row.setdefault("rescored_per_step", {})[name] = {
                        "median": statistics.median(per_step),
                        "p90": sorted(per_step)[int(0.9 * len(per_step))],
                        "max": max(per_step),
                    }
                    row.setdefault("full_rows", {})[name] = head.full_steps - full
            results.append(row)
            print(
                f"rows {rows} ({row['steps']} steps): "
                + " | ".join(
                    f"{name} {ms:.1f} ms ({row['ms']['packed'] / ms:.2f}x)"
                    for name, ms in row["ms"].items()
                )
                + f" | rescored per step {row.get('rescored_per_step')}"
                + f" | same greedy {row['same_greedy']}"
            )
    report = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),  # processor, its bf16/AMX flags, torch and its threads
        "results": results,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
