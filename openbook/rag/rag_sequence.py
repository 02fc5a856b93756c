"""RAG-Sequence decoding: a separate search per passage, then passage-marginalised ranking.

Thorough decoding (transformers' ``RagSequenceForGeneration.generate``): the union of every
passage's beam is re-scored under every passage and ranked by log sum_z p(z|x) p(y|x,z).

Fast decoding (paper section 2.4): no re-scoring; p(y|x,z) is taken from passage z's own beam when y
is in it and treated as 0 otherwise.

Sampling (temperature > 0): each passage z draws one answer per sample j from its own
p(y|x,z) (temperature / top-k / top-p applied to every token, :mod:`openbook.rag.sampling`);
sample j's answer is then, of its k draws, the one of highest marginal p(y|x), thorough or fast
as above (:func:`choose_samples`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from openbook.rag.backends import Encoded, GeneratorBackend
from openbook.rag.beam import Finished, GreedySearch, SearchSettings, StopFn, new_search
from openbook.rag.drafting import PassageDrafter, room
from openbook.rag.marginalize import sequence_doc_logliks, sequence_log_marginal
from openbook.rag.options import Hypothesis
from openbook.rag.scoring import score_candidates


class PassageRows:
    """The ``beams`` decoder rows of one passage of a RAG-Sequence request: an independent search
    under that passage alone. Beam search keeps every beam, as transformers' RAG-Sequence asks
    ``generate`` for ``num_return_sequences = num_beams``. Sampling: one row per sample j, drawn
    from p(y|x,z) of this passage alone (:func:`choose_samples` picks among the passages).

    Greedy, it may draft (:mod:`openbook.rag.drafting`): ``drafter`` indexes this passage's
    tokens alone, the text its hypothesis is decoded under.

    first_logprobs: (V,) log p(y_1 | x, z) of the passage.
    """

    def __init__(
        self,
        first_logprobs: Tensor,
        settings: SearchSettings,
        stop: StopFn | None,
        generator: torch.Generator | None = None,
        drafter: PassageDrafter | None = None,
    ):
        beams = settings.num_beams
        if beams > 1:
            settings = replace(settings, num_return_sequences=beams)
        self.settings = settings
        self.rows = settings.rows_per_item  # beams, or samples
        self.search = new_search(1, settings, first_logprobs.device, stop, generator=generator)
        self.drafter = drafter if isinstance(self.search, GreedySearch) else None
        self.live = self.search.start(first_logprobs[None, :])

    def feed(self) -> tuple[Tensor, Tensor | None]:
        source = self.search.source
        return self.search.tokens, None if source is None else source.reshape(-1)

    def advance(self, lp: Tensor) -> bool:
        self.live = self.search.advance(lp)
        return self.live

    def decided(self) -> tuple[int, None]:
        """Greedy: the token the latest step decided for this passage."""
        return int(self.search.tokens[0]), None

    def draft(self, limit: int) -> list[int]:
        """Tokens of this passage to feed after the decided one (at most ``limit``, never past
        ``max_new_tokens``); empty without a drafter or a match."""
        search = self.search
        if self.drafter is None or not self.live or not isinstance(search, GreedySearch):
            return []
        history = search.seq[0].tolist()
        return self.drafter.propose(history, room(search, self.settings, limit), (0.0,))

    def hypotheses(self) -> list[Finished]:
        return self.search.result()[0]


def rank(
    backend: GeneratorBackend,
    enc: Encoded,
    log_prior: Tensor,
    per_passage: list[list[Finished]],
    settings: SearchSettings,
    *,
    thorough: bool,
) -> list[Hypothesis]:
    """The request's answers from its passages' searches (``per_passage[z]``), best first.

    ``enc`` holds this request only (n = 1, k = its passages); ``log_prior`` (k,).
    """
    marg = _marginals(backend, enc, log_prior, per_passage, thorough=thorough)
    # torch.topk, as transformers ranks, so that ties resolve identically
    order = torch.topk(marg.log_p, min(settings.num_return_sequences, len(marg.cands))).indices
    return [marg.hypothesis(backend, c) for c in order.tolist()]


def choose_samples(
    backend: GeneratorBackend,
    enc: Encoded,
    log_prior: Tensor,
    per_passage: list[list[Finished]],
    *,
    thorough: bool,
) -> list[Hypothesis]:
    """Sampling: answer j is, of the k answers drawn for sample j (``per_passage[z][j]``, one
    per passage, each from p(y|x,z) alone), the one of highest marginal p(y|x) =
    sum_z p(z|x) p(y|x,z): computed under every passage (thorough) or from the passages whose
    draws found it (fast), as beam search's candidates are ranked. Answers in draw order.
    """
    marg = _marginals(backend, enc, log_prior, per_passage, thorough=thorough)
    samples = len(per_passage[0]) if per_passage else 0
    out: list[Hypothesis] = []
    for j in range(samples):
        drawn = [marg.index[tuple(hyps[j].tokens)] for hyps in per_passage]
        best = drawn[int(torch.argmax(marg.log_p[drawn]))]  # first of equals: lowest passage
        out.append(marg.hypothesis(backend, best))
    return out


@dataclass
class _Marginals:
    """The distinct answers of a request's passages, with log p(y|x) and p(z|x,y) of each."""

    cands: list[list[int]]
    index: dict[tuple[int, ...], int]
    log_p: Tensor  # (C,)
    post: Tensor  # (C, k)
    skip_first: bool
    thorough: bool

    def hypothesis(self, backend: GeneratorBackend, c: int) -> Hypothesis:
        tokens = self.cands[c]
        pad = backend.pad_token_id if self.thorough else None
        return Hypothesis(
            text=backend.decode(tokens),
            token_ids=list(tokens),
            log_prob=float(self.log_p[c]),
            scored_tokens=_scored(tokens, self.skip_first, pad),
            doc_posterior=self.post[c].tolist(),
            tokens=None,
            token_doc_posteriors=None,
        )


def scoring_tokens(hypotheses: int, passages: int, tokens: int) -> int:
    """Tokens thorough decoding scores when a request finishes: each of its ``hypotheses``
    distinct hypotheses, padded to ``tokens`` (the longest), under every one of its
    ``passages`` passages (a pair already scored by the passage's own search is not scored
    again, so this is an upper bound). The generator's admission plans scoring with it (one
    hypothesis per decoder row, ``max_new_tokens`` long, at worst) and measures scoring's
    speed by it (the engine's count of what was found)."""
    return hypotheses * passages * tokens


def _marginals(
    backend: GeneratorBackend,
    enc: Encoded,
    log_prior: Tensor,
    per_passage: list[list[Finished]],
    *,
    thorough: bool,
) -> _Marginals:
    k = enc.k
    prior = log_prior.to(enc.first_logprobs.device)
    seen: dict[tuple[int, ...], int] = {}
    cands: list[list[int]] = []
    origin: list[dict[int, Finished]] = []  # candidate -> {passage: that passage's hypothesis}
    for z in range(k):
        for h in per_passage[z]:
            key = tuple(h.tokens)
            if key not in seen:
                seen[key] = len(cands)
                cands.append(h.tokens)
                origin.append({})
            origin[seen[key]].setdefault(z, h)
    skip_first = _skip_bos(backend, cands)
    if thorough:
        # a candidate's log-probs under the passage whose search found it are known already
        known: list[list[dict[int, Sequence[float]]]] = [
            [{z: h.token_logprobs for z, h in org.items()} for org in origin]
        ]
        scored = score_candidates(backend, enc, [cands], [k], known)[0]
        log_p, post = _thorough(backend, scored, cands, prior, skip_first)
    else:
        log_p, post = _fast(origin, prior, skip_first)
    return _Marginals(cands, seen, log_p, post, skip_first, thorough)


def _scored(tokens: list[int], skip_first: bool, pad_token_id: int | None) -> int:
    """The tokens of a candidate its score sums: all, less the first when BOS is not scored,
    less padding ids where thorough scoring masks them (``sequence_doc_logliks``)."""
    counted = tokens[1:] if skip_first else tokens
    if pad_token_id is None:
        return len(counted)
    return sum(1 for t in counted if t != pad_token_id)


def _skip_bos(backend: GeneratorBackend, cands: list[list[int]]) -> bool:
    """transformers scores RAG-Sequence candidates with ``exclude_bos_score=True``: the first token
    is not scored when every candidate of the request starts with BOS (BART's forced BOS).
    """
    bos = backend.bos_token_id
    return bos is not None and bool(cands) and all(c and c[0] == bos for c in cands)


def _thorough(
    backend: GeneratorBackend,
    chosen: Tensor,
    cands: list[list[int]],
    log_prior: Tensor,
    skip_first: bool,
) -> tuple[Tensor, Tensor]:
    """chosen: (C, k, T) token log-probs -> (log p(y|x) (C,), p(z|x,y) (C, k))."""
    n_cands, k, width = chosen.shape
    target = torch.full((n_cands, width), backend.pad_token_id, dtype=torch.long)
    for c, toks in enumerate(cands):
        target[c, : len(toks)] = torch.tensor(toks, dtype=torch.long)
    target = target.to(chosen.device)
    priors = log_prior[None, :].expand(n_cands, k)
    log_p = sequence_log_marginal(chosen, priors, target, backend.pad_token_id, skip_first)
    doc_ll = sequence_doc_logliks(chosen, target, backend.pad_token_id, skip_first)
    return log_p, torch.softmax(doc_ll + priors, dim=1)


def _fast(
    origin: list[dict[int, Finished]], log_prior: Tensor, skip_first: bool
) -> tuple[Tensor, Tensor]:
    k = log_prior.shape[0]
    joint = torch.full((len(origin), k), -math.inf, dtype=torch.float32)
    for c, found in enumerate(origin):
        for z, h in found.items():
            lps = h.token_logprobs[1:] if skip_first else h.token_logprobs
            joint[c, z] = float(log_prior[z]) + math.fsum(lps)
    log_p = torch.logsumexp(joint, dim=1)
    return log_p.to(log_prior.device), torch.softmax(joint, dim=1).to(log_prior.device)
