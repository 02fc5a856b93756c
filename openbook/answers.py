"""Answer strings in text: SQuAD answer normalisation and DPR's "answer in passage" test.

One implementation for the core (fitting a hybrid index's fusion, ``openbook.index.fusion``)
and the trainer's metrics (``openbook_trainer.evaluation.metrics`` re-exports these).
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, strip punctuation and the articles a/an/the, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def has_answer(text: str, answers: Iterable[str]) -> bool:
    """DPR's "answer string in passage" test, on SQuAD-normalised token sequences."""
    tokens = normalize_answer(text).split()
    for ans in answers:
        a = normalize_answer(ans).split()
        if a and any(tokens[i : i + len(a)] == a for i in range(len(tokens) - len(a) + 1)):
            return True
    return False


answer_in_text = has_answer
