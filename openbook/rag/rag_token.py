"""RAG-Token decoding: one search whose next-token distribution is marginalised over passages.

Sampling (temperature > 0) draws every token from that same marginal, eq. 2 of the paper,
p(y_i|x,y_<i) = sum_z p(z|x) p(y_i|x,z,y_<i), transformed by temperature, then top-k, then
top-p (:mod:`openbook.rag.sampling`); each of the request's samples is one "beam" slot of rows
``z * n + j``, decoded independently.

Greedy decoding may be drafted (:mod:`openbook.rag.drafting`): :meth:`RagTokenRows.draft`
proposes tokens, and the engine hands it the log-probs of the fed draft's positions one at a
time through :meth:`RagTokenRows.advance`, the undrafted step's own code.
"""

from __future__ import annotations

import torch
from torch import Tensor

from openbook.rag.backends import Encoded, GeneratorBackend
from openbook.rag.beam import Finished, GreedySearch, SearchSettings, StopFn, new_search
from openbook.rag.drafting import PassageDrafter, room
from openbook.rag.marginalize import token_marginal, token_posteriors
from openbook.rag.options import Hypothesis
from openbook.rag.scoring import score_candidates


class RagTokenRows:
    """The k * beams decoder rows of one RAG-Token request (row ``z * beams + b``: passage z,
    beam b; sampling: sample b) and its one search over the passage-marginalised distribution.

    ``enc`` holds this request only (n = 1, k = its passages); ``log_prior`` (k,).
    """

    def __init__(
        self,
        enc: Encoded,
        log_prior: Tensor,
        settings: SearchSettings,
        stop: StopFn | None,
        generator: torch.Generator | None = None,
        drafter: PassageDrafter | None = None,
    ) -> None:
        # beams, or independent samples when sampling (rows never move between them)
        k, beams = enc.k, settings.rows_per_item
        vocab = enc.first_logprobs.shape[-1]
        device = enc.first_logprobs.device
        self.k, self.beams, self.vocab = k, beams, vocab
        self.rows = k * beams
        self.prior = log_prior.to(device)[None, :]  # (1, k)
        self._passage_rows = (torch.arange(k, device=device) * beams)[:, None]  # (k, 1)
        # per-passage log p(y_i | x, z, y_<i) of the current step, (1, k, beams, V)
        self._current = enc.first_logprobs.view(1, k, 1, vocab).expand(1, k, beams, vocab)
        self.search = new_search(1, settings, device, stop, self._per_passage, generator)
        self.settings = settings
        # the request's passages' n-gram index when it drafts (greedy only)
        self.drafter = drafter if isinstance(self.search, GreedySearch) else None
        # log p(z|x) + sum_i log p(y_i|x,z,y_<i): the unnormalised posterior p(z|x,y_<=i) of
        # greedy decoding (draft choice only; provenance comes from the search's payload)
        self._log_posterior = self.prior[0].clone()
        # transformers' beam search log-softmaxes the already-normalised marginal once more;
        # doing the same keeps scores bit-compatible.
        first = torch.log_softmax(
            token_marginal(enc.first_logprobs.view(1, k, vocab), self.prior), dim=-1
        )
        self.live = self.search.start(first)
        self._follow_posterior()

    def feed(self) -> tuple[Tensor, Tensor | None]:
        """The token of every row (its beam's) and, after beam moves, the rows to reorder to."""
        tokens = self.search.tokens.view(1, self.beams).expand(self.k, self.beams).reshape(-1)
        source = self.search.source
        if source is None:
            return tokens, None
        return tokens, (self._passage_rows + source.view(1, -1)).reshape(-1)

    def advance(self, lp: Tensor) -> bool:
        """lp: (k * beams, V) per-passage next-token log-probs of the rows fed."""
        self._current = lp.view(1, self.k, self.beams, self.vocab)
        marginal = torch.log_softmax(token_marginal(self._current, self.prior), dim=-1)
        self.live = self.search.advance(marginal.view(self.beams, self.vocab))
        self._follow_posterior()
        return self.live

    def draft(self, limit: int) -> list[int]:
        """Tokens to feed after the decided one (at most ``limit``, and never past the answer's
        ``max_new_tokens``); empty without a drafter or a match."""
        search = self.search
        if self.drafter is None or not self.live or not isinstance(search, GreedySearch):
            return []
        posterior = self._log_posterior.tolist()
        history = search.seq[0].tolist()
        return self.drafter.propose(history, room(search, self.settings, limit), posterior)

    def _follow_posterior(self) -> None:
        if self.drafter is None:
            return
        token = int(self.search.tokens[0])
        self._log_posterior += self._current[0, :, 0, token]

    def decided(self) -> tuple[int, Tensor]:
        """Greedy: the token the latest step decided and its per-passage log-probs (k,)."""
        token = int(self.search.tokens[0])
        return token, self._current[0, :, 0, token]

    def _per_passage(self, source: Tensor, tokens: Tensor) -> Tensor:
        """(1, c, k) per-passage log-probs of the chosen continuations (kept for provenance)."""
        idx = (source * self.vocab + tokens)[:, None, :].expand(1, self.k, -1)
        flat = self._current.reshape(1, self.k, self.beams * self.vocab)
        return flat.gather(2, idx).transpose(1, 2)

    def hypotheses(self, backend: GeneratorBackend, enc: Encoded) -> list[Hypothesis]:
        return _with_provenance(backend, enc, self.prior, [self.k], self.search.result())[0]


def _with_provenance(
    backend: GeneratorBackend,
    enc: Encoded,
    prior: Tensor,
    ks: list[int],
    found: list[list[Finished]],
) -> list[list[Hypothesis]]:
    """log p(y|x) and the per-token passage posteriors of the final hypotheses, from the
    per-passage log-probs the search attached to their tokens (or, without those, by re-scoring
    them under every passage in one teacher-forced pass over the cached encoder states).
    """
    scored = None
    if any(h.payload is None for hyps in found for h in hyps):
        cands = [[h.tokens for h in hyps] for hyps in found]
        scored = score_candidates(backend, enc, cands, ks)
    out: list[list[Hypothesis]] = []
    for i, hyps in enumerate(found):
        res = []
        for c, h in enumerate(hyps):
            length = len(h.tokens)
            if scored is not None:
                chosen = scored[i][c, :, :length]  # (k_i, T)
            else:
                chosen = torch.tensor(h.payload, device=prior.device).reshape(length, -1)
                chosen = chosen.T[: ks[i]]
            lp = prior[i, : ks[i]]
            marginal = torch.logsumexp(chosen + lp[:, None], dim=0)
            res.append(
                Hypothesis(
                    text=backend.decode(h.tokens),
                    token_ids=list(h.tokens),
                    log_prob=float(marginal.sum()),
                    scored_tokens=length,  # every token, BOS and EOS included
                    doc_posterior=None,
                    tokens=backend.token_strings(h.tokens),
                    token_doc_posteriors=token_posteriors(chosen, lp).tolist(),
                    token_log_probs=marginal.tolist(),
                )
            )
        out.append(res)
    return out
