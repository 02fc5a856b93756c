"""Measure the default prompt: greedy answers on gold passages, SQuAD EM/F1.

For each question the prompt is built from its gold passage (the SQuAD paragraph it was asked
on; for the leaders, the office's passage of the 2016 snapshot scored against ``answer_2016``,
and of the 2018 snapshot against ``answer_2018``), decoded greedily by the generator the
services run (:class:`openbook.rag.RagGenerator` over that one passage: at most
``--max-new-tokens``, stopping at end of sequence or the prompt's stop strings). The KV cache of
the shared prefix is computed once and forked for every question.

    .venv/bin/python -m openbook_trainer.demo.check_prompt --model-dir var/models/gemma-3-270m \
        --squad 60 --threads 2

``--dtype`` picks the precision the weights are loaded in (float32 by default; ``bfloat16`` or
``auto``, the generator service's hardware policy, to measure what reduced precision costs);
``--out`` also records every prediction, so two runs can be compared answer by answer.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.backends import CausalBackend
from openbook.rag.prompting import PromptSpec
from openbook.types import Passage
from openbook_trainer.demo.data import (
    LEADERS_QUESTIONS,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    default_data_dir,
    read_jsonl,
)
from openbook_trainer.demo.prompt import default_prompt, load_prompt
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
    """Greedy decoding of one answer per question from its gold passage alone, by openbook's
    generator (RAG-Token over a single passage is plain greedy decoding of the prompt)."""

    def __init__(self, generator: RagGenerator, max_new_tokens: int = 16) -> None:
        self.generator = generator
        self.options = DecodingOptions(max_new_tokens=max_new_tokens)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        prompt: PromptSpec | None = None,
        max_new_tokens: int = 16,
        dtype: str = "float32",
    ) -> GreedyAnswerer:
        """The causal LM in ``model_dir`` on the CPU in ``dtype`` (float32 unless asked),
        prompted with ``prompt`` (default: the prompt file in ``model_dir``)."""
        generator = RagGenerator.load(model_dir, device="cpu", dtype=dtype)
        spec = getattr(generator.backend, "spec", None)
        if spec is None:
            raise ValueError(f"{model_dir}: not a causal LM with a prompt file")
        if prompt is not None and prompt != spec:
            backend = CausalBackend(generator.backend.model, generator.backend.tokenizer, prompt)
            generator = RagGenerator(
                backend, model_version=generator.model_version, generation=generator.generation
            )
        return cls(generator, max_new_tokens)

    def answer(self, item: QAItem) -> str:
        passage = Passage(id="gold", title=item.title, text=item.text)
        result = self.generator.generate(item.question, [passage], self.options)
        return result.hypotheses[0].text


def evaluate(answerer: GreedyAnswerer, items: list[QAItem], show: bool = False) -> dict[str, Any]:
    em = f1 = 0.0
    predictions = []
    start = time.monotonic()
    for item in items:
        pred = answerer.answer(item)
        e, f = exact_match(pred, item.answers), f1_score(pred, item.answers)
        em, f1 = em + e, f1 + f
        predictions.append({"question": item.question, "prediction": pred, "em": bool(e)})
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
        "predictions": predictions,
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
    parser.add_argument(
        "--dtype",
        default="float32",
        help="precision of the weights: float32 (default), bfloat16, float16 or auto "
        "(the generator service's hardware policy)",
    )
    parser.add_argument("--show", action="store_true", help="print every prediction")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    data_dir = args.data_dir or default_data_dir()
    prompt = load_prompt(args.prompt) if args.prompt else default_prompt()
    answerer = GreedyAnswerer.load(args.model_dir, prompt, args.max_new_tokens, args.dtype)

    sets: dict[str, list[QAItem]] = {}
    if args.squad:
        sets[f"squad (seed {args.seed})"] = squad_items(data_dir, args.squad, args.seed)
    if not args.no_leaders:
        sets["leaders-2016"] = leaders_items(data_dir, 2016)
        sets["leaders-2018"] = leaders_items(data_dir, 2018)

    results: dict[str, Any] = {
        "model_dir": str(args.model_dir),
        "dtype": answerer.generator.dtype,
        "sets": {},
    }
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
