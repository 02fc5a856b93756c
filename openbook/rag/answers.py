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
    return tokens_have_answer(
        normalize_answer(text).split(), [normalize_answer(a).split() for a in answers]
    )


def tokens_have_answer(tokens: list[str] | str, answers: Iterable[list[str]]) -> bool:
    """:func:`has_answer` on a text and answers already normalised and split: for callers that
    test one passage against many questions (normalising is most of the cost). ``tokens`` may
    also be given joined as :func:`joined_tokens` makes them, the form to test many answers on.

    A token run equals the answer's tokens exactly where " a1 a2 " occurs in " t1 t2 ... ":
    tokens hold no whitespace, so the spaces around each side align the match on token
    boundaries (a substring search in C instead of a Python loop over positions)."""
    text = tokens if isinstance(tokens, str) else joined_tokens(tokens)
    return any(a and f" {' '.join(a)} " in text for a in answers)


def joined_tokens(tokens: list[str]) -> str:
    """The tokens joined by single spaces, with one at each end (:func:`tokens_have_answer`)."""
    return f" {' '.join(tokens)} "


answer_in_text = has_answer
