"""Reading training / evaluation examples from JSONL.

One JSON object per line: the input under ``question`` or ``input``, the output(s) under
``answers``, ``target`` or ``answer`` (a string or a list of strings). That covers open-domain
QA (several gold answers), abstractive QA, Jeopardy question generation (input = answer entity,
target = question) and FEVER (input = claim, target = label word). Optional: ``id``, and
``gold_ids`` (passage ids that support the answer; used for recall@k when present).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from openbook.validation.jsonl import json_object

INPUT_KEYS = ("question", "input")
TARGET_KEYS = ("answers", "target", "answer")


class DataError(ValueError):
    """A data file is missing or malformed; the message names the file and line."""


@dataclass
class Example:
    question: str
    answers: list[str]
    id: str = ""
    gold_ids: list[str] = field(default_factory=list)


def read_examples(path: Path, limit: int | None = None) -> list[Example]:
    """All examples of a JSONL file (the first ``limit`` if given), validated line by line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    out: list[Example] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if limit is not None and len(out) >= limit:
                break
            out.append(_parse(line, f"{path}:{lineno}", default_id=str(lineno)))
    if not out:
        raise DataError(f"{path}: no examples")
    return out


def _parse(line: str, where: str, default_id: str) -> Example:
    row = json_object(line, where, DataError)
    question = _first(row, INPUT_KEYS)
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: needs a non-empty string under one of {INPUT_KEYS}")
    target = _first(row, TARGET_KEYS)
    answers = [target] if isinstance(target, str) else target
    if (
        not isinstance(answers, list)
        or not answers
        or not all(isinstance(a, str) and a.strip() for a in answers)
    ):
        raise DataError(
            f"{where}: needs a non-empty string or list of strings under one of {TARGET_KEYS}"
        )
    gold = row.get("gold_ids", [])
    if not isinstance(gold, list) or not all(isinstance(g, str | int) for g in gold):
        raise DataError(f"{where}: gold_ids must be a list of passage ids")
    return Example(
        question=question,
        answers=list(answers),
        id=str(row.get("id", default_id)),
        gold_ids=[str(g) for g in gold],
    )


def _first(row: dict, keys: tuple[str, ...]) -> object:
    for k in keys:
        if k in row:
            return row[k]
    return None
