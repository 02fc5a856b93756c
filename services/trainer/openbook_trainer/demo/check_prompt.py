"""Measure the default prompt: greedy answers on gold passages, SQuAD EM/F1.

For each question the prompt is built from its gold passage (the SQuAD paragraph it was asked
on; for the leaders, the office's passage of the 2016 snapshot scored against ``answer_2016``,
and of the 2018 snapshot against ``answer_2018``), decoded greedily with plain transformers
(at most ``--max-new-tokens``, stopping at the prompt's stop strings). The KV cache of the
shared prefix is computed once and copied for every question.

    .venv/bin/python -m openbook_trainer.demo.check_prompt --model-dir var/models/gemma-3-270m \
        --squad 60 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openbook_trainer.demo.data import (
    LEADERS_QUESTIONS,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    default_data_dir,
    read_jsonl,
)
from openbook_trainer.demo.prompt import PromptTemplate, default_prompt, load_prompt
from openbook_trainer.evaluation.metrics import exact_match, f1_score


@dataclass(frozen=True)
class QAItem:
    title: str
    text: str
    question: str
    answers: tuple[str, ...]


def squad_items(data_dir: Path, n: int, seed: int = 0) -> list[QAItem]:
    """``n`` questions drawn with ``seed`` from ``squad/questions.jsonl``, with gold paragraphs."""
    paragraphs = {p["id"]: p for p in read_jsonl(data_dir / SQUAD_PARAGRAPHS)}
    questions = list(read_jsonl(data_dir / SQUAD_QUESTIONS))
    chosen = random.Random(seed).sample(questions, min(n, len(questions)))
    return [
        QAItem(
            paragraphs[q["paragraph"]]["title"],
            paragraphs[q["paragraph"]]["text"],
            q["question"],
            tuple(q["answers"]),
        )
        for q in chosen
    ]


def leaders_items(data_dir: Path, year: int) -> list[QAItem]:
    """Every leaders question on the office's passage of snapshot ``year`` (2016 or 2018)."""
    passages = {p["id"]: p for p in read_jsonl(data_dir / f"leaders/wiki{year}.jsonl")}
    items = []
    for q in read_jsonl(data_dir / LEADERS_QUESTIONS):
        passage = passages[f"{year}:{q['position']}"]
        items.append(
            QAItem(passage["title"], passage["text"], q["question"], (q[f"answer_{year}"],))
        )
    return items


class GreedyAnswerer:
    """Greedy decoding of one answer per prompt, reusing the KV cache of the prompt prefix."""

    def __init__(
        self, model: Any, tokenizer: Any, prompt: PromptTemplate, max_new_tokens: int = 16
    ) -> None:
        import torch
        from transformers import DynamicCache

        self.torch = torch
        self.model, self.tokenizer, self.prompt = model, tokenizer, prompt
        self.max_new_tokens = max_new_tokens
        self.prefix_ids: list[int] = tokenizer(prompt.prefix)["input_ids"]
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        with torch.inference_mode():
            cache = DynamicCache(config=model.config)
            model(input_ids=torch.tensor([self.prefix_ids]), past_key_values=cache, use_cache=True)
        self.prefix_cache = cache

    def answer(self, item: QAItem) -> str:
        torch = self.torch
        full = self.tokenizer(self.prompt.render(item.title, item.text, item.question))
        ids: list[int] = full["input_ids"]
        n = len(self.prefix_ids)
        if ids[:n] == self.prefix_ids:
            cache, new_ids = copy.deepcopy(self.prefix_cache), ids[n:]
        else:  # the tokenizer merged across the prefix boundary: no reuse
            from transformers import DynamicCache

            cache, new_ids = DynamicCache(config=self.model.config), ids
        generated: list[int] = []
        text = ""
        with torch.inference_mode():
            out = self.model(
                input_ids=torch.tensor([new_ids]), past_key_values=cache, logits_to_keep=1
            )
            for _ in range(self.max_new_tokens):
                next_id = int(out.logits[0, -1].argmax())
                if next_id in self.eos_ids:
                    break
                generated.append(next_id)
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                if any(s in text for s in self.prompt.stop):
                    break
                out = self.model(
                    input_ids=torch.tensor([[next_id]]),
                    past_key_values=out.past_key_values,
                    logits_to_keep=1,
                )
        for stop in self.prompt.stop:
            text = text.split(stop, 1)[0]
        return text.strip()


def evaluate(answerer: GreedyAnswerer, items: list[QAItem], show: bool = False) -> dict[str, Any]:
    em = f1 = 0.0
    start = time.monotonic()
    for item in items:
        pred = answerer.answer(item)
        e, f = exact_match(pred, item.answers), f1_score(pred, item.answers)
        em, f1 = em + e, f1 + f
        if show:
            print(
                f"  [{'EM' if e else f'{f:.2f}'}] {item.question!r} -> {pred!r} "
                f"(gold {item.answers[0]!r})",
                file=sys.stderr,
            )
    n = max(len(items), 1)
    return {
        "n": len(items),
        "em": round(100 * em / n, 1),
        "f1": round(100 * f1 / n, 1),
        "seconds": round(time.monotonic() - start, 1),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", type=Path, default=Path("var/models/gemma-3-270m"))
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument(
        "--prompt",
        type=Path,
        default=None,
        help="prompt JSON (default: the built-in default prompt)",
    )
    parser.add_argument("--squad", type=int, default=60, help="number of SQuAD questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-leaders", action="store_true")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--show", action="store_true", help="print every prediction")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    data_dir = args.data_dir or default_data_dir()
    prompt = load_prompt(args.prompt) if args.prompt else default_prompt()
    tokenizer = AutoTokenizer.from_pretrained(str(args.model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(args.model_dir), dtype=torch.float32)
    model.eval()
    answerer = GreedyAnswerer(model, tokenizer, prompt, args.max_new_tokens)

    sets: dict[str, list[QAItem]] = {}
    if args.squad:
        sets[f"squad (seed {args.seed})"] = squad_items(data_dir, args.squad, args.seed)
    if not args.no_leaders:
        sets["leaders-2016"] = leaders_items(data_dir, 2016)
        sets["leaders-2018"] = leaders_items(data_dir, 2018)

    results: dict[str, Any] = {"model_dir": str(args.model_dir), "sets": {}}
    for name, items in sets.items():
        print(f"{name}: {len(items)} questions", file=sys.stderr, flush=True)
        res = evaluate(answerer, items, show=args.show)
        results["sets"][name] = res
        print(
            f"{name:22s} n={res['n']:3d}  EM {res['em']:5.1f}  F1 {res['f1']:5.1f}  "
            f"({res['seconds']:.0f} s)",
            flush=True,
        )
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    return results


if __name__ == "__main__":
    main()
