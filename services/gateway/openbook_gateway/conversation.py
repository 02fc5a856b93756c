"""Conversations: the question a follow-up is retrieved and answered with.

Chat front ends send the whole conversation, and a follow-up ("When did he take office?")
means nothing on its own: retrieval would search for "he". openbook has no model that rewrites
a question, so the follow-up is expanded with what the conversation said just before it: the
question, then the most recent earlier user message, the last assistant answer and the user
message before that (:func:`contextual_question`). Both views of an index read it the same way:
BM25 gets the earlier turns' names and nouns as terms, the dense encoder embeds them with the
question. The generator gets the same text, so the answer, the cache key and the reported
``question_used`` all agree on what was asked.

Invariants:

* No history, or none that says anything: the question itself, unchanged (single-turn requests
  are answered and cached exactly as before conversations existed).
* The question comes first and whole; earlier turns follow only as far as they fit: each is cut
  to ``CONVERSATION_TURN_CHARS`` and the whole is at most ``MAX_QUESTION_CHARS``, so the
  retrieval query and the generator's prompt are bounded however long the conversation is.
* Only ``CONVERSATION_USER_TURNS`` user messages and one assistant message before the question
  are read (``openbook.validation.limits``); system, developer and tool messages never are.
* Earlier turns are text to search with, not input to validate: control characters become
  spaces, whitespace runs one space, an answer's ``[i]`` citation markers and an abstention's
  message are dropped.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from openbook.validation.limits import (
    CONVERSATION_TURN_CHARS,
    CONVERSATION_USER_TURNS,
    MAX_QUESTION_CHARS,
)

Role = Literal["user", "assistant"]

# How an answer withheld for its low confidence starts (openai_format.abstention): it says
# nothing about the subject, so it is not searched with.
ABSTENTION_PREFIX = "I am not confident enough to answer"
# The " [1][2]" an OpenAI-style answer ends with (citation_markers).
_MARKERS = re.compile(r"(\s*\[\d+\])+\s*$")
_SPACES = re.compile(r"\s+")
# Joins the question and the earlier turns.
SEPARATOR = " "


@dataclass(frozen=True)
class Turn:
    """One earlier message of a conversation: who said it, and its text."""

    role: Role
    text: str


def plain(text: str) -> str:
    """``text`` as one line to search with: control characters are spaces, whitespace runs one
    space, an answer's trailing citation markers and an abstention's message are gone."""
    text = "".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text)
    text = _SPACES.sub(" ", _MARKERS.sub("", text)).strip()
    return "" if text.startswith(ABSTENTION_PREFIX) else text


def _cut(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, at a word boundary where there is one."""
    if len(text) <= limit:
        return text
    cut = text[:limit]
    space = cut.rfind(" ")
    return cut[:space] if space > limit // 2 else cut


def recent(history: Iterable[Turn]) -> list[Turn]:
    """The turns of ``history`` (oldest first) that :func:`contextual_question` reads, in their
    order, each cleaned (:func:`plain`) and cut to ``CONVERSATION_TURN_CHARS``: the last
    ``CONVERSATION_USER_TURNS`` user messages and the last assistant message that say anything.
    Also the conversation state a stored response keeps: all the next turn can need."""
    cleaned = [Turn(t.role, _cut(plain(t.text), CONVERSATION_TURN_CHARS)) for t in history]
    kept: list[int] = []
    users = 0
    answered = False
    for at in range(len(cleaned) - 1, -1, -1):
        turn = cleaned[at]
        if not turn.text:
            continue
        if turn.role == "user" and users < CONVERSATION_USER_TURNS:
            users += 1
            kept.append(at)
        elif turn.role == "assistant" and not answered:
            answered = True
            kept.append(at)
    return [cleaned[at] for at in sorted(kept)]


def contextual_question(question: str, history: Sequence[Turn]) -> str:
    """The question to retrieve and answer with: ``question`` followed by the turns of
    ``history`` it may refer to (module docstring), the most recent first, as many as fit in
    ``MAX_QUESTION_CHARS``. ``question`` itself is kept as sent (its checks are the request's)."""
    turns = [t for t in recent(history) if t.text.casefold() != question.strip().casefold()]
    if not turns:
        return question
    # What fits is chosen by recency: the latest user turn, then the last answer, then older
    # user turns; the question is then followed by them newest first.
    users = [t for t in reversed(turns) if t.role == "user"]
    answers = [t for t in turns if t.role == "assistant"]
    ordered = users[:1] + answers + users[1:]
    out = question
    for turn in ordered:
        room = MAX_QUESTION_CHARS - len(out) - len(SEPARATOR)
        if room <= 0:
            break
        text = _cut(turn.text, room)
        if text:
            out += SEPARATOR + text
    return out
