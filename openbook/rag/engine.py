"""Iteration-level ("continuous") batching: requests join and leave a running decode between steps.

One :class:`DecodingEngine` owns one batch of decoder rows (the backend's :class:`DecodeState`)
and the searches that feed them. Every :meth:`~DecodingEngine.step` feeds one token to every
live row in one forward pass, hands each search the log-probs of its own rows, and then:

* rows whose search finished leave the batch at once (``backend.keep``), so a short answer
  never waits for the longest one of its batch, and its request is finalised (provenance,
  RAG-Sequence ranking) and returned;
* requests whose caller gave up leave the same way, answered with :class:`Abandoned`.

:meth:`~DecodingEngine.add` encodes a new request (its prompt prefill, its own k: no padded
passage slots) and joins its rows to the running batch (``backend.join``, caches left-padded and
masked), so it starts decoding at the next step instead of waiting for the batch to finish.

Rows of a request: RAG-Token, one search over k * beams rows
(:class:`openbook.rag.rag_token.RagTokenRows`); RAG-Sequence, one independent search of
``beams`` rows per passage (:class:`openbook.rag.rag_sequence.PassageRows`), each leaving when it
ends. Searches never see each other's rows, so every request decodes exactly as it would alone
(the tests compare token ids and scores against single-request decoding).

Invariants: ``_groups`` lists the live searches in the order of their rows in ``_state``; a
request is returned exactly once, by the :meth:`~DecodingEngine.step` after it finished; the
engine is used by one thread at a time, under ``torch.inference_mode``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from openbook.rag import rag_sequence
from openbook.rag.beam import Finished, SearchSettings, StopFn
from openbook.rag.errors import Abandoned
from openbook.rag.marginalize import doc_log_prior
from openbook.rag.models import DecodeState, Encoded, GeneratorBackend
from openbook.rag.options import DecodingOptions, GenerationResult, Hypothesis
from openbook.rag.rag_token import RagTokenRows
from openbook.rag.streaming import OnToken, RequestStream
from openbook.types import Passage

# Asked before every step: True once the request's caller gave up (deadline, cancel).
GaveUp = Callable[[], bool]


class Rows(Protocol):
    """Consecutive decoder rows driven by one search."""

    rows: int
    live: bool

    def feed(self) -> tuple[Tensor, Tensor | None]:
        """(rows,) tokens to feed; (rows,) local row order to reorder the cache to, or None."""
        ...

    def advance(self, lp: Tensor) -> bool:
        """Take the rows' next-token log-probs (rows, V); False once the search is over."""
        ...

    def decided(self) -> tuple[int, Tensor | None]:
        """Greedy only: the token decided at the latest step and, for RAG-Token, its
        per-passage log-probs (k,) (:mod:`openbook.rag.streaming`)."""
        ...


@dataclass(eq=False)
class Running:
    """One admitted request: its encoded state (n = 1), prior and searches."""

    tag: Any
    options: DecodingOptions
    enc: Encoded
    log_prior: Tensor  # (k,)
    settings: SearchSettings
    groups: list[Rows]
    gave_up: GaveUp | None
    # the events of a streaming greedy request (None: nothing streamed)
    stream: RequestStream | None = None
    # seconds of engine time this request was charged (its prefill + its share of every step)
    cost_s: float = 0.0
    done: bool = field(default=False)

    def finished(self) -> bool:
        return not any(g.live for g in self.groups)

    def emit(self, groups: Sequence[Rows]) -> None:
        """Stream the tokens ``groups`` (of this request) decided at the latest step."""
        if self.stream is None:
            return
        for z, group in enumerate(self.groups):
            if group not in groups:
                continue
            token, per_passage = group.decided()
            if per_passage is not None:
                self.stream.marginal_token(token, per_passage)
            else:
                self.stream.token(token, passage=z)

    def result(self, backend: GeneratorBackend) -> GenerationResult:
        if self.options.mode == "rag-token":
            (group,) = self.groups
            assert isinstance(group, RagTokenRows)
            hyps: list[Hypothesis] = group.hypotheses(backend, self.enc)
        else:
            per_passage: list[list[Finished]] = [
                g.hypotheses() for g in self.groups if isinstance(g, rag_sequence.PassageRows)
            ]
            hyps = rag_sequence.rank(
                backend,
                self.enc,
                self.log_prior,
                per_passage,
                self.settings,
                thorough=self.options.mode == "rag-sequence-thorough",
            )
        return GenerationResult(hypotheses=hyps, doc_prior=self.log_prior.exp().tolist())


Outcome = tuple[Any, GenerationResult | Abandoned]  # (the tag given to add, its outcome)


class DecodingEngine:
    """Continuous batching over one generator backend (module docstring).

    ``settings_for(options)`` gives a request's search settings, ``stop`` the stop-string check
    of the model family (or None). ``max_rows`` bounds the decoder rows decoded together; a
    request larger than that alone still runs, alone. ``stop_strings``: where the model
    family's decoding cuts an answer, ``answer_prefix``: what it removes from an answer's start
    (both held back while streaming, :mod:`openbook.rag.streaming`).
    """

    def __init__(
        self,
        backend: GeneratorBackend,
        settings_for: Callable[[DecodingOptions], SearchSettings],
        stop: StopFn | None,
        max_rows: int,
        stop_strings: Sequence[str] = (),
        answer_prefix: str = "",
    ) -> None:
        self.backend = backend
        self.settings_for = settings_for
        self.stop = stop
        self.max_rows = max_rows
        self.stop_strings = tuple(stop_strings)
        self.answer_prefix = answer_prefix
        self._state: DecodeState | None = None
        self._groups: list[tuple[Running, Rows]] = []
        self._requests: list[Running] = []
        self._done: list[Outcome] = []

    # ------------------------------------------------------------------ admission

    @property
    def rows(self) -> int:
        """Decoder rows in the running batch."""
        return sum(g.rows for _, g in self._groups)

    def __len__(self) -> int:
        """Requests admitted and not yet returned by :meth:`step` (some may be finished: one
        whose answer ended at its first token is returned by the next step)."""
        return len(self._requests) + len(self._done)

    def accepts(self, rows: int, joining: int = 0) -> bool:
        """Whether a request of ``rows`` decoder rows (passages x beams) may join now, when
        ``joining`` rows were admitted since the last step: the batch is empty and nothing else
        joins, or the family joins running batches and the rows stay within ``max_rows``."""
        if not self._requests and not joining:
            return True
        if not self.backend.joins_running:
            return False
        return self.rows + joining + rows <= self.max_rows

    def add(
        self,
        question: str,
        passages: Sequence[Passage],
        options: DecodingOptions,
        *,
        tag: Any = None,
        gave_up: GaveUp | None = None,
        on_token: OnToken | None = None,
    ) -> Running:
        """Encode one (validated) request and join its rows to the batch; it decodes from the
        next :meth:`step` on, which also returns it once finished. ``on_token``, for a greedy
        request, is called with every token as it is decided (:mod:`openbook.rag.streaming`),
        from the thread that runs the engine, before the request's outcome is returned."""
        started = _now()
        k = len(passages)
        scores = torch.tensor([[float(p.score) for p in passages]])
        log_prior = doc_log_prior(scores)[0]
        enc = self.backend.encode([(question, list(passages))], k)
        settings = self.settings_for(options)
        groups: list[Rows]
        if options.mode == "rag-token":
            groups = [RagTokenRows(enc, log_prior, settings, self.stop)]
        else:
            groups = [
                rag_sequence.PassageRows(enc.first_logprobs[z], settings, self.stop)
                for z in range(k)
            ]
        request = Running(tag, options, enc, log_prior, settings, groups, gave_up)
        if on_token is not None and options.num_beams == 1:
            request.stream = RequestStream(
                on_token,
                log_prior,
                lambda token: self.backend.token_strings([token])[0],
                self.backend.decode,
                self.stop_strings,
                self.answer_prefix,
            )
            request.emit(groups)
        self._requests.append(request)
        live = [g for g in groups if g.live]
        if live:
            state = self.backend.start(enc, options.num_beams)
            if len(live) < len(groups):  # RAG-Sequence passages that ended at their first token
                rows = _rows_of(groups, lambda g: g.live).to(self.backend.device)
                state = self.backend.keep(state, rows)
            self._state = state if self._state is None else self.backend.join([self._state, state])
            self._groups.extend((request, g) for g in live)
        request.cost_s += _now() - started
        if not live:
            self._finish(request)
        return request

    def abort(self) -> list[Any]:
        """Drop every request (after a failed step, whose state is unusable); their tags."""
        tags = [r.tag for r in self._requests]
        self._requests, self._groups, self._state, self._done = [], [], None, []
        return tags

    # ------------------------------------------------------------------ decoding

    def step(self) -> list[Outcome]:
        """One decoding step of every live row; returns the requests that finished (or were
        abandoned) since the last call."""
        self._drop_abandoned()
        if self._groups:
            started = _now()
            self._advance()
            share = (_now() - started) / max(1, len({id(r) for r, _ in self._groups}))
            for request in {id(r): r for r, _ in self._groups}.values():
                request.cost_s += share
            self._leave()
        done, self._done = self._done, []
        return done

    def _advance(self) -> None:
        tokens: list[Tensor] = []
        order: list[Tensor] = []
        reordered = False
        at = 0
        for _, group in self._groups:
            fed, rows = group.feed()
            tokens.append(fed)
            if rows is None:
                rows = torch.arange(group.rows, device=fed.device)
            else:
                reordered = True
            order.append(rows + at)
            at += group.rows
        assert self._state is not None
        if reordered:
            self.backend.reorder(self._state, torch.cat(order))
        lp = self.backend.step(self._state, torch.cat(tokens))
        at = 0
        for _, group in self._groups:
            group.advance(lp[at : at + group.rows])
            at += group.rows
        streaming: dict[int, tuple[Running, list[Rows]]] = {}
        for request, group in self._groups:
            if request.stream is not None:
                streaming.setdefault(id(request), (request, []))[1].append(group)
        for request, groups in streaming.values():
            request.emit(groups)

    def _leave(self) -> None:
        """Rows of finished searches leave; finished requests are finalised."""
        if all(g.live for _, g in self._groups):
            return
        self._keep(lambda request, group: group.live)
        for request in [r for r in self._requests if not r.done and r.finished()]:
            self._finish(request)

    def _drop_abandoned(self) -> None:
        gone = [r for r in self._requests if not r.done and r.gave_up is not None and r.gave_up()]
        if not gone:
            return
        ids = {id(r) for r in gone}
        self._keep(lambda request, group: id(request) not in ids)
        for request in gone:
            request.done = True
            self._requests.remove(request)
            self._done.append((request.tag, Abandoned("the caller gave up")))

    def _keep(self, wanted: Callable[[Running, Rows], bool]) -> None:
        rows: list[int] = []
        kept: list[tuple[Running, Rows]] = []
        at = 0
        for request, group in self._groups:
            if wanted(request, group):
                rows.extend(range(at, at + group.rows))
                kept.append((request, group))
            at += group.rows
        self._groups = kept
        if not kept:
            self._state = None
        elif len(rows) < at:
            assert self._state is not None
            device = self.backend.device
            self._state = self.backend.keep(self._state, torch.tensor(rows, device=device))

    def _finish(self, request: Running) -> None:
        started = _now()
        result = request.result(self.backend)
        for hyp in result.hypotheses:
            hyp.finish_reason = self._finish_reason(hyp.token_ids, request.options)
        request.cost_s += _now() - started
        request.done = True
        self._requests.remove(request)
        self._done.append((request.tag, result))

    def _finish_reason(self, tokens: list[int], options: DecodingOptions) -> str:
        if len(tokens) < options.max_new_tokens:
            return "stop"
        ended = tokens[-1] == self.backend.eos_token_id or (
            self.stop is not None and self.stop(tokens)
        )
        return "stop" if ended else "length"


def _rows_of(groups: Sequence[Rows], wanted: Callable[[Rows], bool]) -> Tensor:
    rows: list[int] = []
    at = 0
    for g in groups:
        if wanted(g):
            rows.extend(range(at, at + g.rows))
        at += g.rows
    return torch.tensor(rows)


def _now() -> float:
    return time.perf_counter()
