"""Greedy and beam search over an abstract next-token log-distribution.

A search never touches a model: its caller (:mod:`openbook.rag.engine`) feeds it the next-token
log-distributions of its rows, one step at a time, and reads back the tokens chosen for every
live row (and, for beam search, which previous beam each row continues). RAG-Token feeds the
passage-marginalised distribution, RAG-Sequence the per-passage one.

The beam search reproduces transformers' (>= 4.50) vectorised beam search decision for decision —
top 2 x num_beams continuations, finished hypotheses scored as sum_logprob / generated_len **
length_penalty, the same early-stopping heuristic — so that RAG decoding yields the token ids
transformers' ``generate`` yields for the same distributions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from openbook.errors import InternalError
from openbook.rag.options import SearchOrSample
from openbook.rag.sampling import sample

_NEG = -1.0e9  # transformers' "impossible" score; kept finite so it can be ranked and added to


@dataclass
class SearchSettings(SearchOrSample):
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
    # Sampling (temperature > 0, openbook.rag.sampling): num_return_sequences independent
    # samples per item instead of a search; num_beams is then 1.
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def rows_per_item(self) -> int:
        """Decoder rows per batch item: its samples, or its beams."""
        return self.rows


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


class Search:
    """One search over ``batch`` items, driven one step at a time by its caller.

    ``start(first)`` takes the step-0 distributions (batch, V); afterwards ``tokens`` (rows,) are
    the tokens to feed the model for every live row (rows = batch, or batch * num_beams) and
    ``source`` (batch, num_beams) or None which previous row each row continues (the caller
    reorders its cache by it before feeding). ``advance(lp)`` takes the next distributions
    (rows, V) of those rows. Both return False once the search is over; ``result()`` then gives
    the finished hypotheses per item, best first.

    Driving a search step by step lets the decoding engine run many searches (requests) in one
    batch, each joining and leaving between steps, with every decision identical to running it
    alone.

    Every kind is built from the same arguments (:func:`new_search`); each allocates its own
    state in :meth:`_allocate`.
    """

    def __init__(
        self,
        batch: int,
        s: SearchSettings,
        device: torch.device,
        stop: StopFn | None = None,
        payload: PayloadFn | None = None,
    ) -> None:
        self.batch = batch
        self.rows = batch * s.rows_per_item  # its beams, or its samples; greedy: one
        self.s = s
        self.stop = stop
        self.payload = payload
        self.tokens = torch.empty(0, dtype=torch.long, device=device)
        self.source: Tensor | None = None
        self._g = 0  # tokens decided so far
        self._allocate(device)

    def _allocate(self, device: torch.device) -> None:
        """The kind's own state for ``batch`` items (``rows`` rows) on ``device``."""
        raise NotImplementedError

    def start(self, first: Tensor) -> bool:
        raise NotImplementedError

    def advance(self, lp: Tensor) -> bool:
        raise NotImplementedError

    def result(self) -> list[list[Finished]]:
        raise NotImplementedError


class GreedySearch(Search):
    """Argmax decoding of ``batch`` independent rows."""

    def _allocate(self, device: torch.device) -> None:
        batch, s = self.batch, self.s
        self.seq = torch.empty(batch, 0, dtype=torch.long, device=device)
        self._raw_lp: list[Tensor] = []
        self._extra: list[Tensor] = []
        self._proc_sum = torch.zeros(batch, device=device)
        self._lengths = torch.full((batch,), s.max_new_tokens, dtype=torch.long)
        self._done = torch.zeros(batch, dtype=torch.bool)

    def start(self, first: Tensor) -> bool:
        return self.advance(first)

    def advance(self, lp: Tensor) -> bool:
        s, g, done = self.s, self._g, self._done
        device = lp.device
        scores = _process(lp, self.seq, g, s)
        nxt = scores.argmax(dim=-1)
        # rows already finished keep feeding padding, as transformers does; their values are
        # discarded
        nxt = torch.where(done.to(device), torch.full_like(nxt, s.pad_token_id), nxt)
        self._raw_lp.append(lp.gather(1, nxt[:, None]).squeeze(1))
        if self.payload is not None:
            self._extra.append(self.payload(torch.zeros_like(nxt)[:, None], nxt[:, None])[:, 0])
        self._proc_sum += torch.where(
            done.to(device), 0.0, scores.gather(1, nxt[:, None]).squeeze(1)
        )
        self.seq = torch.cat([self.seq, nxt[:, None]], dim=1)
        _mark_finished(done, self._lengths, nxt, self.seq, g, s.eos_token_id, self.stop)
        self._g = g + 1
        self.tokens = nxt
        return not (bool(done.all()) or g + 1 == s.max_new_tokens)

    def result(self) -> list[list[Finished]]:
        tok = self.seq.tolist()
        lps = torch.stack(self._raw_lp, dim=1).tolist()
        pay = torch.stack(self._extra, dim=1).tolist() if self._extra else None
        lengths = self._lengths
        return [
            [
                Finished(
                    tok[r][: lengths[r]],
                    float(self._proc_sum[r]),
                    lps[r][: lengths[r]],
                    None if pay is None else pay[r][: lengths[r]],
                )
            ]
            for r in range(self.rows)
        ]


class BeamSearch(Search):
    """Beam search for ``batch`` items with ``s.num_beams`` beams each (transformers' decisions,
    module docstring)."""

    def _allocate(self, device: torch.device) -> None:
        batch, s = self.batch, self.s
        nb, max_new = s.num_beams, s.max_new_tokens
        n_eos = 1 if s.eos_token_id is not None else 0
        self.keep = max(2, 1 + n_eos) * nb
        self._top_nb_mask = torch.zeros(self.keep, dtype=torch.bool, device=device)
        self._top_nb_mask[:nb] = True
        self.run_seq = torch.full(
            (batch, nb, max_new), s.pad_token_id, dtype=torch.long, device=device
        )
        self.run_lp = torch.zeros((batch, nb, max_new), dtype=torch.float32, device=device)
        self.run_score = torch.zeros((batch, nb), device=device)
        self.run_score[:, 1:] = _NEG  # only beam 0 may expand at step 0: all beams are identical
        self.fin_seq = self.run_seq.clone()
        self.fin_lp = self.run_lp.clone()
        self.fin_len = torch.zeros((batch, nb), dtype=torch.long, device=device)
        self.fin_score = torch.full((batch, nb), _NEG, device=device)
        self.fin_done = torch.zeros((batch, nb), dtype=torch.bool, device=device)
        self.can_improve = torch.ones((batch, 1), dtype=torch.bool, device=device)
        self._batch_idx = torch.arange(batch, device=device)[:, None]
        self.run_pay: Tensor | None = None  # (batch, nb, max_new, E) once E is known
        self.fin_pay: Tensor | None = None

    def start(self, first: Tensor) -> bool:
        vocab = first.shape[-1]
        nb = self.s.num_beams
        return self.advance(
            first[:, None, :].expand(self.batch, nb, vocab).reshape(self.batch * nb, vocab)
        )

    def advance(self, lp: Tensor) -> bool:
        s, g, batch, nb = self.s, self._g, self.batch, self.s.num_beams
        max_new, keep, batch_idx = s.max_new_tokens, self.keep, self._batch_idx
        device = lp.device
        vocab = lp.shape[-1]
        scores = _process(lp, self.run_seq[:, :, :g].reshape(batch * nb, g), g, s)
        total = (scores.view(batch, nb, vocab) + self.run_score[:, :, None]).view(batch, nb * vocab)
        cand_score, cand_idx = torch.topk(total, keep)
        src = cand_idx // vocab
        tok = cand_idx % vocab
        cand_seq = self.run_seq[batch_idx, src]
        cand_seq[:, :, g] = tok
        cand_lp = self.run_lp[batch_idx, src]
        cand_lp[:, :, g] = lp.view(batch, nb, vocab)[batch_idx, src, tok]
        cand_pay = None
        if self.payload is not None:
            values = self.payload(src, tok)
            if self.run_pay is None:
                self.run_pay = values.new_zeros(batch, nb, max_new, values.shape[-1])
                self.fin_pay = self.run_pay.clone()
            cand_pay = self.run_pay[batch_idx, src]
            cand_pay[:, :, g] = values

        hits = torch.zeros((batch, keep), dtype=torch.bool, device=device)
        if g + 1 >= max_new:
            hits[:] = True
        if s.eos_token_id is not None:
            hits |= tok == s.eos_token_id
        if self.stop is not None:
            seqs = cand_seq[:, :, : g + 1].tolist()
            for b in range(batch):
                for j in range(keep):
                    if not hits[b, j] and self.stop(seqs[b][j]):
                        hits[b, j] = True

        # live beams for the next step: best non-finished continuations
        live = cand_score + hits.float() * _NEG
        nxt = torch.topk(live, nb).indices
        self.run_seq = cand_seq[batch_idx, nxt]
        self.run_lp = cand_lp[batch_idx, nxt]
        if cand_pay is not None:
            self.run_pay = cand_pay[batch_idx, nxt]
        self.run_score = live[batch_idx, nxt]
        run_src = src[batch_idx, nxt]

        # finished pool: only the top num_beams candidates may finish, scored with length penalty
        just_done = hits & self._top_nb_mask[None, :]
        pen = cand_score / float(g + 1) ** s.length_penalty
        full = self.fin_done.all(dim=-1, keepdim=True) & (s.early_stopping is True)
        pen = (
            pen
            + full.float() * _NEG
            + (~self.can_improve).float() * _NEG
            + (~just_done).float() * _NEG
        )
        m_score = torch.cat([self.fin_score, pen], dim=1)
        best = torch.topk(m_score, nb).indices
        self.fin_score = m_score[batch_idx, best]
        self.fin_seq = torch.cat([self.fin_seq, cand_seq], dim=1)[batch_idx, best]
        self.fin_lp = torch.cat([self.fin_lp, cand_lp], dim=1)[batch_idx, best]
        if cand_pay is not None:
            assert self.fin_pay is not None  # created with run_pay, at the first payload
            self.fin_pay = torch.cat([self.fin_pay, cand_pay], dim=1)[batch_idx, best]
        new_len = torch.full((batch, keep), g + 1, dtype=torch.long, device=device)
        self.fin_len = torch.cat([self.fin_len, new_len], dim=1)[batch_idx, best]
        self.fin_done = torch.cat([self.fin_done, just_done], dim=1)[batch_idx, best]

        g += 1
        self._g = g
        best_len = max_new if s.early_stopping == "never" and s.length_penalty > 0.0 else g
        best_possible = self.run_score[:, :1] / float(best_len) ** s.length_penalty
        worst_done = torch.where(
            self.fin_done, self.fin_score.min(dim=1, keepdim=True).values, _NEG
        )
        self.can_improve = self.can_improve & (best_possible > worst_done).any(dim=-1, keepdim=True)
        still_open = not (bool(self.fin_done.all()) and s.early_stopping is True)
        self.tokens = self.run_seq[:, :, g - 1].reshape(-1)
        self.source = run_src
        return bool(self.can_improve.any()) and still_open and not bool(hits.all())

    def result(self) -> list[list[Finished]]:
        s, nb = self.s, self.s.num_beams
        out: list[list[Finished]] = []
        seqs, lps = self.fin_seq.tolist(), self.fin_lp.tolist()
        lens, scs = self.fin_len.tolist(), self.fin_score.tolist()
        pays = None if self.fin_pay is None else self.fin_pay.tolist()
        for b in range(self.batch):
            hyps = []
            for j in range(min(nb, s.num_return_sequences)):
                if lens[b][j] == 0:  # slot never filled (fewer hypotheses than beams)
                    continue
                n = lens[b][j]
                pay = None if pays is None else pays[b][j][:n]
                hyps.append(Finished(seqs[b][j][:n], scs[b][j], lps[b][j][:n], pay))
            out.append(hyps)
        return out


class SampleSearch(Search):
    """``s.num_return_sequences`` independent samples for each of ``batch`` items (rows
    ``item * n + j``), every token drawn from the row's processed distribution under the
    temperature / top-k / top-p of ``s`` (:mod:`openbook.rag.sampling`), with ``generator``'s
    uniforms. Rows never move: ``source`` stays None. A row ends at EOS or a stop string, as
    greedy's; the search ends when every row has, or at ``max_new_tokens``.

    Greedy decoding is not this search at temperature 0: it stays :class:`GreedySearch`,
    untouched.
    """

    def __init__(
        self,
        batch: int,
        s: SearchSettings,
        device: torch.device,
        stop: StopFn | None,
        payload: PayloadFn | None,
        generator: torch.Generator,
    ) -> None:
        self.generator = generator
        super().__init__(batch, s, device, stop, payload)

    def _allocate(self, device: torch.device) -> None:
        batch, s = self.batch, self.s
        n = self.n = s.num_return_sequences
        self.seq = torch.empty(batch * n, 0, dtype=torch.long, device=device)
        self._raw_lp: list[Tensor] = []
        self._extra: list[Tensor] = []
        self._lengths = [s.max_new_tokens] * (batch * n)
        self._done = [False] * (batch * n)
        self._beam = torch.arange(n, device=device)[None, :].expand(batch, n)

    def start(self, first: Tensor) -> bool:
        """``first``: (batch, V) step-0 distributions, one per item (shared by its samples)."""
        return self.advance(first.repeat_interleave(self.n, dim=0))

    def advance(self, lp: Tensor) -> bool:
        s, g, done = self.s, self._g, self._done
        scores = _process(lp, self.seq, g, s)
        # every row draws, finished or not: a request's stream of uniforms depends on nothing
        # but its own rows and steps
        nxt = sample(scores, s.temperature, s.top_k, s.top_p, self.generator).to(lp.device)
        finished = torch.tensor(done, device=lp.device)
        # rows already finished keep feeding padding, as greedy's do; their values are discarded
        nxt = torch.where(finished, torch.full_like(nxt, s.pad_token_id), nxt)
        self._raw_lp.append(lp.gather(1, nxt[:, None]).squeeze(1))
        if self.payload is not None:
            per_row = self.payload(self._beam, nxt.view(self.batch, self.n))
            self._extra.append(per_row.reshape(self.rows, -1))
        self.seq = torch.cat([self.seq, nxt[:, None]], dim=1)
        _mark_finished(done, self._lengths, nxt, self.seq, g, s.eos_token_id, self.stop)
        self._g = g + 1
        self.tokens = nxt
        return not (all(done) or g + 1 == s.max_new_tokens)

    def result(self) -> list[list[Finished]]:
        """Per item, its samples in the order they were drawn (row j: sample j); ``score`` is
        the sample's unprocessed log-prob sum."""
        tok = self.seq.tolist()
        lps = torch.stack(self._raw_lp, dim=1).tolist()
        pay = torch.stack(self._extra, dim=1).tolist() if self._extra else None
        out: list[list[Finished]] = []
        for b in range(self.batch):
            hyps = []
            for r in range(b * self.n, (b + 1) * self.n):
                n = self._lengths[r]
                hyps.append(
                    Finished(
                        tok[r][:n],
                        math.fsum(lps[r][:n]),
                        lps[r][:n],
                        None if pay is None else pay[r][:n],
                    )
                )
            out.append(hyps)
        return out


def new_search(
    batch: int,
    s: SearchSettings,
    device: torch.device,
    stop: StopFn | None = None,
    payload: PayloadFn | None = None,
    generator: torch.Generator | None = None,
) -> Search:
    """Sampling when ``s`` asks for it (``generator`` then draws its uniforms); else greedy
    search for one beam (as transformers' ``generate``), beam search otherwise."""
    if s.sampling:
        if generator is None:
            raise InternalError("sampling needs the request's random generator")
        return SampleSearch(batch, s, device, stop, payload, generator)
    search = GreedySearch if s.num_beams == 1 else BeamSearch
    return search(batch, s, device, stop, payload)


def _mark_finished(
    done: Tensor | list[bool],
    lengths: Tensor | list[int],
    nxt: torch.Tensor,
    seq: torch.Tensor,
    g: int,
    eos_token_id: int | None,
    stop: StopFn | None,
) -> None:
    """Mark the rows that step ``g`` finished (their token ``nxt`` is EOS, or ``stop`` says
    their sequence ``seq`` is done) and record their length, g + 1. ``done``: one flag per
    row, a bool tensor (greedy) or a list (sampling), ``lengths`` likewise; rows already done
    are left as they are."""
    nxt_cpu = nxt.tolist()
    for r in range(len(done)):
        if done[r]:
            continue
        if (eos_token_id is not None and nxt_cpu[r] == eos_token_id) or (
            stop is not None and stop(seq[r].tolist())
        ):
            done[r] = True
            lengths[r] = g + 1
