"""Per-item results appended to a JSONL file, so an interrupted experiment resumes."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from openbook_trainer.evaluation.metrics import exact_match, f1_score


class ResultLog:
    """``key -> result`` pairs on disk; a rerun skips the keys already recorded."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.done: dict[str, dict] = {}
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interruption
                self.done[row["key"]] = row["result"]

    def get(self, key: str) -> dict | None:
        return self.done.get(key)

    def add(self, key: str, result: dict) -> None:
        self.done[key] = result
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"key": key, "result": result}) + "\n")


def qa_row(question: dict, answer: str) -> dict:
    """The logged result of one QA prediction: question, answer, gold answers, EM and F1."""
    gold = question["answers"]
    return {
        "question": question["question"],
        "answer": answer,
        "gold": gold,
        "em": exact_match(answer, gold),
        "f1": f1_score(answer, gold),
    }


def em_f1(rows: Sequence[dict]) -> dict[str, float]:
    """Mean EM and F1 of :func:`qa_row` results, in percent."""
    return {
        "em": 100.0 * sum(r["em"] for r in rows) / len(rows),
        "f1": 100.0 * sum(r["f1"] for r in rows) / len(rows),
    }
