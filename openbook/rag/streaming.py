"""Tokens as they are decided: the events a streaming request receives while it decodes.

Only greedy searches decide a token for good at each step; beam search may still drop any
running beam, so a beam-search request streams nothing until its final hypotheses.

* RAG-Token, greedy: one event per step, the token chosen from the passage-marginalised
  distribution, with its passage posterior p(z | x, y_<=i) (the paper's Figure 2: the same
  values the final hypothesis carries per token).
* RAG-Sequence, greedy: one event per step and passage, the token passage z's own hypothesis
  took (``passage`` = z); which hypothesis wins is only known at the end, from the marginal.

Each event also carries ``text``: what the token adds to the answer text of its stream. It is
decoded incrementally (:class:`TextStream`), holding back what may still change (a partial
UTF-8 character, the start of a stop string, whitespace the final answer may strip), so the
texts of a stream concatenate to a prefix of its final decoded text, and, whenever the search
ended the way it was heading, to the text itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TokenEvent:
    """One decided token of a streaming request."""

    token_id: int
    token: str  # the token as the tokenizer spells it (the final hypothesis' ``tokens`` entry)
    text: str  # what it adds to its stream's answer text ('' while held back)
    # RAG-Sequence: the passage whose hypothesis this token extends; None: the answer itself
    passage: int | None = None
    # RAG-Token: p(z | x, y_<=i) over the request's k passages; None for RAG-Sequence
    doc_posterior: list[float] | None = None


OnToken = Callable[[TokenEvent], None]
# The answer text of a token sequence, as the final hypothesis will spell it.
Decode = Callable[[Sequence[int]], str]


class TextStream:
    """Incremental detokenisation of one growing token sequence.

    ``push(token_id)`` returns the text the sequence gained, emitting only what is settled:
    text that every longer sequence's decoding also starts with, as far as can be told
    (``stops``: strings at which decoding cuts the answer; ``lead``: the answer prefix that
    decoding removes from the start once it is complete).
    """

    def __init__(self, decode: Decode, stops: Sequence[str] = (), lead: str = "") -> None:
        self.decode = decode
        self.stops = [s for s in stops if s]
        self.lead = lead.strip()
        self.tokens: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        self.tokens.append(token_id)
        text = self.decode(self.tokens)
        if not text.startswith(self.sent):
            return ""  # the decoding changed what was already sent: wait until it agrees again
        if not self.sent and text and self.lead.startswith(text) and text != self.lead:
            return ""  # may be the answer prefix the decoding removes once it is complete
        settled = len(text)
        if text.endswith("\ufffd"):  # a multi-byte character not yet complete
            settled = len(text.rstrip("\ufffd"))
        for stop in self.stops:  # a tail that may be the start of a stop string
            for n in range(min(len(stop) - 1, settled), 0, -1):
                if text[settled - n : settled] == stop[:n]:
                    settled -= n
                    break
        # whitespace at the end may be stripped from the final answer: sent with what follows
        settled = len(text[:settled].rstrip())
        if settled <= len(self.sent):
            return ""
        delta = text[len(self.sent) : settled]
        self.sent = text[:settled]
        return delta


class RequestStream:
    """The events of one streaming request, built from its searches' decided tokens.

    ``log_prior``: (k,) log p(z|x). ``token_string`` spells one token; ``decode``, ``stops``
    and ``lead`` give the answer text (:class:`TextStream`).
    """

    def __init__(
        self,
        on_token: OnToken,
        log_prior: Tensor,
        token_string: Callable[[int], str],
        decode: Decode,
        stops: Sequence[str] = (),
        lead: str = "",
    ) -> None:
        self.on_token = on_token
        self.log_prior = log_prior.float().cpu()
        self.token_string = token_string
        self._texts: dict[int | None, TextStream] = {}
        self._decode, self._stops, self._lead = decode, stops, lead
        # RAG-Token: sum_{j<=i} log p(y_j | x, z, y_<j) per passage, (k,)
        self._joint = self.log_prior.clone()

    def token(self, token_id: int, passage: int | None = None) -> None:
        """A RAG-Sequence token of ``passage``'s hypothesis (or of the answer)."""
        self.on_token(
            TokenEvent(
                token_id, self.token_string(token_id), self._text(passage, token_id), passage
            )
        )

    def marginal_token(self, token_id: int, per_passage: Tensor) -> None:
        """A RAG-Token token and its per-passage log-probs (k,) log p(y_i | x, z, y_<i)."""
        self._joint = self._joint + per_passage.float().cpu()
        posterior = torch.softmax(self._joint, dim=0).tolist()
        text = self._text(None, token_id)
        self.on_token(TokenEvent(token_id, self.token_string(token_id), text, None, posterior))

    def _text(self, passage: int | None, token_id: int) -> str:
        stream = self._texts.get(passage)
        if stream is None:
            stream = self._texts[passage] = TextStream(self._decode, self._stops, self._lead)
        return stream.push(token_id)
