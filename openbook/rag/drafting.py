"""Passage-drafted speculative decoding for greedy RAG-Token and RAG-Sequence: n-gram drafts.

Answers are mostly copied from the retrieved passages, so the tokens after the latest generated
n-gram in a passage are a good guess of the tokens the model will choose next (prompt-lookup
decoding, as transformers' ``prompt_lookup_num_tokens``). The engine (:mod:`openbook.rag.engine`)
feeds the token the search decided plus such a draft to every passage row of the request in one
forward pass (``GeneratorBackend.step_many``), hands the search the per-passage log-probs of each
position in turn (:func:`takes_next`: the same ``advance`` an undrafted step calls, so the
marginal, the processors, the stop checks and the provenance are those of an undrafted decode),
keeps the longest prefix of the draft the greedy choice agrees with plus the one token it chose
instead, and drops the rejected tokens from the cache (``GeneratorBackend.drop_fed``). The LM
head runs only for the positions read (``FedLogProbs``): a rejected draft costs the forward
pass over its tokens, not their logits. The answer is the undrafted one (to float tolerance: a
forward over several positions rounds differently from several forwards of one).

Which draft: every passage may propose (the continuation of the first occurrence, in its token
ids, of the longest of the last 3, 2 or 1 generated tokens that occurs in it); the longest match
wins (a longer match is stronger evidence that the answer is being copied from there), ties
going to the passage of highest current posterior p(z | x, y_<=i) (the one the answer has been
following). One draft per request: all its passage rows are fed the same tokens, since the
RAG-Token marginal needs every passage's distribution at every position.

RAG-Sequence (fast and thorough) drafts too: each passage's search is greedy under that passage
alone, so it drafts from its own passage's tokens for its own hypothesis, and its one row is fed
its own draft (:class:`openbook.rag.rag_sequence.PassageRows`). Its answer, token log-probs and
the ranking over passages are those of the undrafted decode.

Only greedy searches draft (``temperature`` 0, ``num_beams`` 1). Beam search keeps several
hypotheses whose caches move between rows at every step; sampling would need speculative
sampling's acceptance rule to keep its distribution: both decode one token per step, in the same
batch, with drafting on.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from openbook.rag.beam import GreedySearch, SearchSettings
    from openbook.rag.engine import Rows

# The longest generated n-gram looked up (transformers' prompt_lookup max_matching_ngram_size
# default is 2; 3 first keeps a short common token from pulling a draft from the wrong place).
MAX_NGRAM = 3


class PassageDrafter:
    """The n-gram index of one request's passages (token ids ``sources``, one list per passage
    slot, as :meth:`~openbook.rag.backends.GeneratorBackend.draft_sources` gives them)."""

    def __init__(self, sources: Sequence[Sequence[int]], max_ngram: int = MAX_NGRAM) -> None:
        self.sources = [list(s) for s in sources]
        self.max_ngram = max_ngram
        # index[n - 1][ngram] = {passage: where its first occurrence's continuation starts}
        self._index: list[dict[tuple[int, ...], dict[int, int]]] = []
        for n in range(1, max_ngram + 1):
            table: dict[tuple[int, ...], dict[int, int]] = {}
            for z, ids in enumerate(self.sources):
                for i in range(len(ids) - n):  # the n-gram must have a continuation
                    table.setdefault(tuple(ids[i : i + n]), {}).setdefault(z, i + n)
            self._index.append(table)

    def propose(
        self, history: Sequence[int], limit: int, log_posterior: Sequence[float]
    ) -> list[int]:
        """Up to ``limit`` tokens likely to follow ``history`` (the generated tokens, the one
        about to be fed last); ``log_posterior`` (k,) breaks ties between passages (module
        docstring). Empty when no n-gram of the history's tail occurs in any passage."""
        if limit <= 0 or not history:
            return []
        for n in range(min(self.max_ngram, len(history)), 0, -1):
            found = self._index[n - 1].get(tuple(history[-n:]))
            if not found:
                continue
            z = max(found, key=lambda p: (log_posterior[p], -p))
            at = found[z]
            return self.sources[z][at : at + limit]
        return []


def room(search: GreedySearch, settings: SearchSettings, limit: int) -> int:
    """How many tokens may be drafted after the one about to be fed: at most ``limit``, and
    never past the answer's ``max_new_tokens``."""
    return max(0, min(limit, settings.max_new_tokens - int(search.seq.shape[1]) - 1))


def takes_next(rows: Rows, lp: Tensor, draft: Sequence[int], position: int) -> bool:
    """Advance ``rows`` by the log-probs (rows, V) of fed position ``position`` (0: after the
    decided token, i: after ``draft[i - 1]``) with their undrafted ``advance``; whether they read
    the next position too: they are live, the draft goes on, and the token they just decided
    is the drafted one. Otherwise the draft is rejected from there on, and the positions read
    (``position + 1``) are the fed tokens the cache keeps."""
    rows.advance(lp)
    return rows.live and position < len(draft) and rows.decided()[0] == draft[position]
