"""Greedy and beam search over an abstract next-token log-distribution.

The search never touches a model: a ``step`` callback receives the tokens chosen for every live row
(and, for beam search, which previous beam each row continues) and returns the next
log-distributions. RAG-Token plugs in the passage-marginalised distribution, RAG-Sequence the
per-passage one.

The beam search reproduces transformers' (>= 4.50) vectorised beam search decision for decision —
top 2 x num_beams continuations, finished hypotheses scored as sum_logprob / generated_len **
length_penalty, the same early-stopping heuristic — so that RAG decoding yields the token ids
transformers' ``generate`` yields for the same distributions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

_NEG = -1.0e9  # transformers' "impossible" score; kept finite so it can be ranked and added to


@dataclass
class SearchSettings:
    num_beams: int = 1
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    num_return_sequences: int = 1
    eos_token_id: int | None = None
    pad_token_id: int = 0
    early_stopping: bool | str = False
    # Logits processors configured by the model's generation config (seq2seq models only use the
    # first two; they refer to the decoder-start-relative step as transformers does).
    forced_bos_token_id: int | None = None
    forced_eos_token_id: int | None = None
    no_repeat_ngram_size: int = 0
    # Tokens that precede the generated ones in transformers' ``input_ids`` (the decoder start
    # token), needed for n-gram blocking to see the same history.
    history_prefix: tuple[int, ...] = ()


@dataclass
class Finished:
    """One decoded hypothesis of one batch item."""

    tokens: list[int]
    score: (
        float  # ranking score: processed log-prob sum / len ** length_penalty (beam), sum (greedy)
    )
    token_logprobs: list[float] = field(default_factory=list)  # unprocessed log p of each token
    # per token, the values the search's ``payload`` attached to it (e.g. per-passage log-probs)
    payload: list[list[float]] | None = None


# step(tokens (batch*beams,), source_beams (batch, beams) or None) -> log-probs (batch*beams, V)
StepFn = Callable[[Tensor, Tensor | None], Tensor]
# stop(tokens generated so far) -> finished early (stop string); EOS and length are handled here
StopFn = Callable[[list[int]], bool]
# payload(source beams (batch, c), tokens (batch, c)) -> (batch, c, E) float values attached to each
# of the c continuations chosen at the current step, computed from the distributions that step
# was given; they follow their hypothesis into ``Finished.payload``.
PayloadFn = Callable[[Tensor, Tensor], Tensor]


def _process(scores: Tensor, history: Tensor, gen_len: int, s: SearchSettings) -> Tensor:
    """Apply the logits processors to (rows, V) log-probs; ``history``: (rows, gen_len) ids."""
    if s.no_repeat_ngram_size > 0:
        scores = _block_repeated_ngrams(scores, history, s)
    if s.eos_token_id is not None and gen_len < s.min_new_tokens:
        scores = scores.clone()
        scores[:, s.eos_token_id] = -float("inf")
    if s.forced_bos_token_id is not None and gen_len == 0:
        scores = torch.full_like(scores, -float("inf"))
        scores[:, s.forced_bos_token_id] = 0.0
    if s.forced_eos_token_id is not None and gen_len == s.max_new_tokens - 1:
        scores = torch.full_like(scores, -float("inf"))
        scores[:, s.forced_eos_token_id] = 0.0
    return scores


def _block_repeated_ngrams(scores: Tensor, history: Tensor, s: SearchSettings) -> Tensor:
    n = s.no_repeat_ngram_size
    prefix = torch.tensor(s.history_prefix, dtype=torch.long, device=history.device)
    full = torch.cat([prefix.expand(history.shape[0], -1), history], dim=1).tolist()
    if len(full[0]) + 1 < n:
        return scores
    scores = scores.clone()
    for row, seq in enumerate(full):
        tail = tuple(seq[len(seq) - n + 1 :]) if n > 1 else ()
        banned = {
            seq[i + n - 1] for i in range(len(seq) - n + 1) if tuple(seq[i : i + n - 1]) == tail
        }
        if banned:
            scores[row, list(banned)] = -float("inf")
    return scores


def greedy_search(
    batch: int,
    first: Tensor,
    step: StepFn,
    s: SearchSettings,
    stop: StopFn | None = None,
    payload: PayloadFn | None = None,
) -> list[list[Finished]]:
    """Argmax decoding of ``batch`` independent rows; ``first`` (batch, V): step-0 distribution."""
    device = first.device
    tokens = torch.empty(batch, 0, dtype=torch.long, device=device)
    raw_lp: list[Tensor] = []
    extra: list[Tensor] = []
    proc_sum = torch.zeros(batch, device=device)
    lengths = torch.full((batch,), s.max_new_tokens, dtype=torch.long)
    done = torch.zeros(batch, dtype=torch.bool)
    lp = first
    for g in range(s.max_new_tokens):
        scores = _process(lp, tokens, g, s)
        nxt = scores.argmax(dim=-1)
        # rows already finished keep feeding padding, as transformers does; their values are
        # discarded
        nxt = torch.where(done.to(device), torch.full_like(nxt, s.pad_token_id), nxt)
        raw_lp.append(lp.gather(1, nxt[:, None]).squeeze(1))
        if payload is not None:
            extra.append(payload(torch.zeros_like(nxt)[:, None], nxt[:, None])[:, 0])
        proc_sum += torch.where(done.to(device), 0.0, scores.gather(1, nxt[:, None]).squeeze(1))
        tokens = torch.cat([tokens, nxt[:, None]], dim=1)
        nxt_cpu = nxt.tolist()
        for r in range(batch):
            if done[r]:
                continue
            if (s.eos_token_id is not None and nxt_cpu[r] == s.eos_token_id) or (
                stop is not None and stop(tokens[r].tolist())
            ):
                done[r] = True
                lengths[r] = g + 1
        if bool(done.all()) or g + 1 == s.max_new_tokens:
            break
        lp = step(nxt, None)
    tok = tokens.tolist()
    lps = torch.stack(raw_lp, dim=1).tolist()
    pay = torch.stack(extra, dim=1).tolist() if extra else None
    return [
        [
            Finished(
                tok[r][: lengths[r]],
                float(proc_sum[r]),
                lps[r][: lengths[r]],
                None if pay is None else pay[r][: lengths[r]],
            )
        ]
        for r in range(batch)
    ]


def beam_search(
    batch: int,
    first: Tensor,
    step: StepFn,
    s: SearchSettings,
    stop: StopFn | None = None,
    payload: PayloadFn | None = None,
) -> list[list[Finished]]:
    """Beam search for ``batch`` items with ``s.num_beams`` beams each.

    ``first`` (batch, V) is the step-0 distribution shared by all beams of an item. Returns, per
    item, the finished hypotheses best first (at most ``num_return_sequences``).
    """
    nb, max_new = s.num_beams, s.max_new_tokens
    device = first.device
    vocab = first.shape[-1]
    n_eos = 1 if s.eos_token_id is not None else 0
    keep = max(2, 1 + n_eos) * nb
    top_nb_mask = torch.zeros(keep, dtype=torch.bool, device=device)
    top_nb_mask[:nb] = True

    run_seq = torch.full((batch, nb, max_new), s.pad_token_id, dtype=torch.long, device=device)
    run_lp = torch.zeros((batch, nb, max_new), dtype=torch.float32, device=device)
    run_score = torch.zeros((batch, nb), device=device)
    run_score[:, 1:] = _NEG  # only beam 0 may expand at step 0: all beams are identical there
    fin_seq = run_seq.clone()
    fin_lp = run_lp.clone()
    fin_len = torch.zeros((batch, nb), dtype=torch.long, device=device)
    fin_score = torch.full((batch, nb), _NEG, device=device)
    fin_done = torch.zeros((batch, nb), dtype=torch.bool, device=device)
    can_improve = torch.ones((batch, 1), dtype=torch.bool, device=device)
    batch_idx = torch.arange(batch, device=device)[:, None]
    run_pay = fin_pay = None  # (batch, nb, max_new, E) once the payload's width is known

    lp = first[:, None, :].expand(batch, nb, vocab).reshape(batch * nb, vocab)
    g = 0
    while True:
        scores = _process(lp, run_seq[:, :, :g].reshape(batch * nb, g), g, s)
        total = (scores.view(batch, nb, vocab) + run_score[:, :, None]).view(batch, nb * vocab)
        cand_score, cand_idx = torch.topk(total, keep)
        src = cand_idx // vocab
        tok = cand_idx % vocab
        cand_seq = run_seq[batch_idx, src]
        cand_seq[:, :, g] = tok
        cand_lp = run_lp[batch_idx, src]
        cand_lp[:, :, g] = lp.view(batch, nb, vocab)[batch_idx, src, tok]
        cand_pay = None
        if payload is not None:
            values = payload(src, tok)
            if run_pay is None:
                run_pay = values.new_zeros(batch, nb, max_new, values.shape[-1])
                fin_pay = run_pay.clone()
            cand_pay = run_pay[batch_idx, src]
            cand_pay[:, :, g] = values

        hits = torch.zeros((batch, keep), dtype=torch.bool, device=device)
        if g + 1 >= max_new:
            hits[:] = True
        if s.eos_token_id is not None:
            hits |= tok == s.eos_token_id
        if stop is not None:
            seqs = cand_seq[:, :, : g + 1].tolist()
            for b in range(batch):
                for j in range(keep):
                    if not hits[b, j] and stop(seqs[b][j]):
                        hits[b, j] = True

        # live beams for the next step: best non-finished continuations
        live = cand_score + hits.float() * _NEG
        nxt = torch.topk(live, nb).indices
        run_seq = cand_seq[batch_idx, nxt]
        run_lp = cand_lp[batch_idx, nxt]
        if cand_pay is not None:
            run_pay = cand_pay[batch_idx, nxt]
        run_score = live[batch_idx, nxt]
        run_src = src[batch_idx, nxt]

        # finished pool: only the top num_beams candidates may finish, scored with length penalty
        just_done = hits & top_nb_mask[None, :]
        pen = cand_score / float(g + 1) ** s.length_penalty
        full = fin_done.all(dim=-1, keepdim=True) & (s.early_stopping is True)
        pen = (
            pen + full.float() * _NEG + (~can_improve).float() * _NEG + (~just_done).float() * _NEG
        )
        m_score = torch.cat([fin_score, pen], dim=1)
        best = torch.topk(m_score, nb).indices
        fin_score = m_score[batch_idx, best]
        fin_seq = torch.cat([fin_seq, cand_seq], dim=1)[batch_idx, best]
        fin_lp = torch.cat([fin_lp, cand_lp], dim=1)[batch_idx, best]
        if cand_pay is not None:
            fin_pay = torch.cat([fin_pay, cand_pay], dim=1)[batch_idx, best]
        new_len = torch.full((batch, keep), g + 1, dtype=torch.long, device=device)
        fin_len = torch.cat([fin_len, new_len], dim=1)[batch_idx, best]
        fin_done = torch.cat([fin_done, just_done], dim=1)[batch_idx, best]

        g += 1
        best_len = max_new if s.early_stopping == "never" and s.length_penalty > 0.0 else g
        best_possible = run_score[:, :1] / float(best_len) ** s.length_penalty
        worst_done = torch.where(fin_done, fin_score.min(dim=1, keepdim=True).values, _NEG)
        can_improve = can_improve & (best_possible > worst_done).any(dim=-1, keepdim=True)
        still_open = not (bool(fin_done.all()) and s.early_stopping is True)
        if not (bool(can_improve.any()) and still_open and not bool(hits.all())):
            break
        lp = step(run_seq[:, :, g - 1].reshape(-1), run_src)

    out: list[list[Finished]] = []
    seqs, lps, lens, scs = fin_seq.tolist(), fin_lp.tolist(), fin_len.tolist(), fin_score.tolist()
    pays = None if fin_pay is None else fin_pay.tolist()
    for b in range(batch):
        hyps = []
        for j in range(min(nb, s.num_return_sequences)):
            if lens[b][j] == 0:  # slot never filled (fewer hypotheses than beams)
                continue
            n = lens[b][j]
            pay = None if pays is None else pays[b][j][:n]
            hyps.append(Finished(seqs[b][j][:n], scs[b][j], lps[b][j][:n], pay))
        out.append(hyps)
    return out
