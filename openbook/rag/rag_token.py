"""RAG-Token decoding: one search whose next-token distribution is marginalised over passages."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from openbook.rag.beam import Finished, SearchSettings, StopFn, beam_search, greedy_search
from openbook.rag.errors import Abandoned
from openbook.rag.marginalize import token_marginal, token_posteriors
from openbook.rag.models import Encoded, GeneratorBackend
from openbook.rag.options import Hypothesis
from openbook.rag.scoring import score_candidates


def decode(
    backend: GeneratorBackend,
    enc: Encoded,
    log_prior: Tensor,
    ks: list[int],
    settings: SearchSettings,
    stop: StopFn | None = None,
    abandoned: Callable[[], bool] | None = None,
) -> list[list[Hypothesis]]:
    """Decode ``enc.n`` requests; ``log_prior`` (n, k) is -inf on padding slots, ``ks`` = real k.

    ``abandoned`` is asked before every decoding step and before re-scoring; when it says yes,
    :class:`Abandoned` is raised and no further work is done.
    """
    n, k, beams = enc.n, enc.k, settings.num_beams
    vocab = enc.first_logprobs.shape[-1]
    prior = log_prior.to(enc.first_logprobs.device)
    # transformers' beam search log-softmaxes the already-normalised marginal once more; doing the
    # same keeps scores bit-compatible.
    first = torch.log_softmax(token_marginal(enc.first_logprobs.view(n, k, vocab), prior), dim=-1)
    state = backend.start(enc, beams)
    group = (torch.arange(n * k, device=first.device) * beams).view(n, k, 1)
    # per-passage log p(y_i | x, z, y_<i) of the current step, (n, k, beams * V)
    current = [enc.first_logprobs.view(n, k, 1, vocab).expand(n, k, beams, vocab)]

    def step(tokens: Tensor, source: Tensor | None) -> Tensor:
        if abandoned is not None and abandoned():
            raise Abandoned("every caller gave up")
        if source is not None:
            backend.reorder(state, (group + source[:, None, :]).reshape(-1))
        per_row = tokens.view(n, 1, beams).expand(n, k, beams).reshape(-1)
        lp = backend.step(state, per_row).view(n, k, beams, vocab)
        current[0] = lp
        return torch.log_softmax(token_marginal(lp, prior), dim=-1).view(n * beams, vocab)

    def per_passage(source: Tensor, tokens: Tensor) -> Tensor:
        """(n, c, k) per-passage log-probs of the chosen continuations (kept for provenance)."""
        idx = (source * vocab + tokens)[:, None, :].expand(n, k, -1)
        return current[0].reshape(n, k, beams * vocab).gather(2, idx).transpose(1, 2)

    search = greedy_search if beams == 1 else beam_search
    found = search(n, first, step, settings, stop, per_passage)
    if abandoned is not None and abandoned():
        raise Abandoned("every caller gave up")
    return _with_provenance(backend, enc, prior, ks, found)


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
                    doc_posterior=None,
                    tokens=backend.token_strings(h.tokens),
                    token_doc_posteriors=token_posteriors(chosen, lp).tolist(),
                )
            )
        out.append(res)
    return out
