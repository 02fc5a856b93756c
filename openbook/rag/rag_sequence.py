"""RAG-Sequence decoding: a separate search per passage, then passage-marginalised ranking.

Thorough decoding (transformers' ``RagSequenceForGeneration.generate``): the union of every
passage's beam is re-scored under every passage and ranked by log sum_z p(z|x) p(y|x,z).

Fast decoding (paper section 2.4): no re-scoring; p(y|x,z) is taken from passage z's own beam when y
is in it and treated as 0 otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from openbook.rag.beam import Finished, SearchSettings, StopFn, beam_search, greedy_search
from openbook.rag.errors import Abandoned
from openbook.rag.marginalize import sequence_doc_logliks, sequence_log_marginal
from openbook.rag.models import Encoded, GeneratorBackend
from openbook.rag.options import Hypothesis
from openbook.rag.scoring import score_candidates


def decode(
    backend: GeneratorBackend,
    enc: Encoded,
    log_prior: Tensor,
    ks: list[int],
    settings: SearchSettings,
    *,
    thorough: bool,
    stop: StopFn | None = None,
    abandoned: Callable[[], bool] | None = None,
) -> list[list[Hypothesis]]:
    """``abandoned`` is asked before every decoding step and before re-scoring; when it says
    yes, :class:`Abandoned` is raised and no further work is done."""
    per_passage = search_per_passage(backend, enc, settings, stop, abandoned)
    prior = log_prior.to(enc.first_logprobs.device)
    cands: list[list[list[int]]] = []
    origin: list[
        list[dict[int, Finished]]
    ] = []  # candidate -> {passage: that passage's hypothesis}
    for i in range(enc.n):
        seen: dict[tuple[int, ...], int] = {}
        cs: list[list[int]] = []
        org: list[dict[int, Finished]] = []
        for z in range(ks[i]):
            for h in per_passage[i * enc.k + z]:
                key = tuple(h.tokens)
                if key not in seen:
                    seen[key] = len(cs)
                    cs.append(h.tokens)
                    org.append({})
                org[seen[key]].setdefault(z, h)
        cands.append(cs)
        origin.append(org)

    if thorough:
        if abandoned is not None and abandoned():
            raise Abandoned("every caller gave up")
        # a candidate's log-probs under the passage whose search found it are known already
        known = [
            [{z: h.token_logprobs for z, h in org.items()} for org in request] for request in origin
        ]
        scored = score_candidates(backend, enc, cands, ks, known)
    out: list[list[Hypothesis]] = []
    for i in range(enc.n):
        lp = prior[i, : ks[i]]
        skip_first = _skip_bos(backend, cands[i])
        if thorough:
            log_p, post = _thorough(backend, scored[i], cands[i], lp, skip_first)
        else:
            log_p, post = _fast(origin[i], lp, skip_first)
        # torch.topk, as transformers ranks, so that ties resolve identically
        order = torch.topk(log_p, min(settings.num_return_sequences, len(cands[i]))).indices
        out.append(
            [
                Hypothesis(
                    text=backend.decode(cands[i][c]),
                    token_ids=list(cands[i][c]),
                    log_prob=float(log_p[c]),
                    doc_posterior=post[c].tolist(),
                    tokens=None,
                    token_doc_posteriors=None,
                )
                for c in order.tolist()
            ]
        )
    return out


def search_per_passage(
    backend: GeneratorBackend,
    enc: Encoded,
    settings: SearchSettings,
    stop: StopFn | None,
    abandoned: Callable[[], bool] | None = None,
) -> list[list[Finished]]:
    """Independent search for each of the n*k rows; beam search returns every beam, as transformers'
    RAG-Sequence asks ``generate`` for ``num_return_sequences = num_beams``.
    """
    beams = settings.num_beams
    rows = enc.n * enc.k
    state = backend.start(enc, beams)
    group = (torch.arange(rows, device=enc.first_logprobs.device) * beams)[:, None]

    def step(tokens: Tensor, source: Tensor | None) -> Tensor:
        if abandoned is not None and abandoned():
            raise Abandoned("every caller gave up")
        if source is not None:
            backend.reorder(state, (group + source).reshape(-1))
        return backend.step(state, tokens)

    if beams == 1:
        return greedy_search(rows, enc.first_logprobs, step, settings, stop)
    every_beam = replace(settings, num_return_sequences=beams)
    return beam_search(rows, enc.first_logprobs, step, every_beam, stop)


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
