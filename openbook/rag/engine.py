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

Chunked prefill: given ``chunk_passages``, :meth:`~DecodingEngine.add` only registers the
request, and each :meth:`~DecodingEngine.prefill` call encodes its next ``chunk_passages``
passages (``backend.concat_encoded`` joins the chunks once all are encoded, then its rows join the
batch). The caller interleaves those calls with :meth:`~DecodingEngine.step`, so one large
prompt (k=100) never stops the running batch for the whole of its prefill: the generator's
scheduler decides, between any two pieces of work, which runs next.

Rows of a request: RAG-Token, one search over k * beams rows
(:class:`openbook.rag.rag_token.RagTokenRows`); RAG-Sequence, one independent search of
``beams`` rows per passage (:class:`openbook.rag.rag_sequence.PassageRows`), each leaving when it
ends. Searches never see each other's rows, so every request decodes exactly as it would alone
(the tests compare token ids and scores against single-request decoding). A sampling request
(temperature > 0) has one row per sample where a beam would be, and its own random generator
(:mod:`openbook.rag.sampling`): with a seed, it draws the same answers in any batch.

Drafting (``draft_tokens`` > 0, :mod:`openbook.rag.drafting`): a step where some greedy search
(a RAG-Token request, or one passage of a RAG-Sequence request) has a draft feeds every row its
token plus its search's draft (others: padding) in one pass; each search consumes as many
positions as it accepts, and the rejected tokens leave the cache (``backend.drop_fed``), so a
request decodes exactly as undrafted.

Invariants: ``_groups`` lists the live searches in the order of their rows in ``_state``; a
request still prefilling has no rows there (``enc`` is None); a request is returned exactly once,
by the :meth:`~DecodingEngine.step` after it finished (or was abandoned); the engine is used by one
thread at a time, under ``torch.inference_mode``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from openbook.rag import rag_sequence
from openbook.rag.backends import DecodeState, Encoded, GeneratorBackend
from openbook.rag.beam import Finished, SearchSettings, StopFn
from openbook.rag.confidence import (
    AnyCalibration,
    confidence_features,
    confidences,
    normalized_texts,
)
from openbook.rag.drafting import PassageDrafter, takes_next
from openbook.rag.errors import Abandoned
from openbook.rag.marginalize import doc_log_prior
from openbook.rag.options import DecodingOptions, GenerationResult, Hypothesis
from openbook.rag.rag_token import RagTokenRows
from openbook.rag.sampling import request_generator
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

    def draft(self, limit: int) -> list[int]:
        """Tokens to feed after the decided one, at most ``limit`` (:mod:`openbook.rag.drafting`);
        empty for a search that does not draft (beam search, sampling) or found no match."""
        ...


@dataclass(eq=False)
class Running:
    """One admitted request: its passages, prior and, once prefilled, encoded state (n = 1) and
    searches."""

    tag: Any
    question: str
    passages: Sequence[Passage]
    options: DecodingOptions
    log_prior: Tensor  # (k,)
    settings: SearchSettings
    gave_up: GaveUp | None
    # passages encoded per prefill call (all of them: one call)
    chunk_passages: int
    # None while prefilling; then the request's encoded state
    enc: Encoded | None = None
    groups: list[Rows] = field(default_factory=list)
    # the chunks encoded so far, while prefilling
    parts: list[Encoded] = field(default_factory=list)
    on_token: OnToken | None = None
    # the events of a streaming greedy request (None: nothing streamed)
    stream: RequestStream | None = None
    # seconds of engine time this request was charged (its prefill + its share of every step)
    cost_s: float = 0.0
    # prompt tokens its prefill took from a cache instead of computing (Encoded.reused_tokens)
    reused_tokens: int = 0
    # decoding steps its rows took part in
    steps: int = 0
    done: bool = field(default=False)

    @property
    def prefilled(self) -> int:
        """Passages encoded so far."""
        return len(self.passages) if self.enc is not None else sum(p.k for p in self.parts)

    @property
    def rows(self) -> int:
        """Decoder rows the request has (or will have, once prefilled)."""
        return len(self.passages) * self.options.rows_per_passage

    def finished(self) -> bool:
        return self.enc is not None and not any(g.live for g in self.groups)

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
        assert self.enc is not None
        if self.options.mode == "rag-token":
            (group,) = self.groups
            assert isinstance(group, RagTokenRows)
            hyps: list[Hypothesis] = group.hypotheses(backend, self.enc)
        elif self.options.sampling:
            hyps = rag_sequence.choose_samples(
                backend,
                self.enc,
                self.log_prior,
                [g.hypotheses() for g in self.groups if isinstance(g, rag_sequence.PassageRows)],
                thorough=self.options.mode == "rag-sequence-thorough",
            )
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
        return GenerationResult(
            hypotheses=hyps,
            doc_prior=self.log_prior.exp().tolist(),
            cached_input_tokens=self.reused_tokens,
        )

    def scored_tokens(self) -> int:
        """The tokens RAG-Sequence thorough scores for this request's :meth:`result`: its
        passages' distinct hypotheses, padded to the longest, under every passage
        (:func:`rag_sequence.scoring_tokens`)."""
        found = {
            tuple(h.tokens)
            for g in self.groups
            if isinstance(g, rag_sequence.PassageRows)
            for h in g.hypotheses()
        }
        width = max((len(h) for h in found), default=0)
        return rag_sequence.scoring_tokens(len(found), len(self.passages), width)


Outcome = tuple[Any, GenerationResult | Abandoned]  # (the tag given to add, its outcome)


class DecodingEngine:
    """Continuous batching over one generator backend (module docstring).

    ``settings_for(options)`` gives a request's search settings, ``stop`` the stop-string check
    of the model family (or None). ``max_rows`` bounds the decoder rows decoded together; a
    request larger than that alone still runs, alone. ``stop_strings``: where the model
    family's decoding cuts an answer, ``answer_prefix``: what it removes from an answer's start
    (both held back while streaming, :mod:`openbook.rag.streaming`). ``calibration``: the
    model's map of an answer's raw confidence, or of its features (the request's passages and
    prior), to its calibrated confidence (:mod:`openbook.rag.confidence`), or None.
    """

    def __init__(
        self,
        backend: GeneratorBackend,
        settings_for: Callable[[DecodingOptions], SearchSettings],
        stop: StopFn | None,
        max_rows: int,
        stop_strings: Sequence[str] = (),
        answer_prefix: str = "",
        calibration: AnyCalibration | None = None,
        draft_tokens: int = 0,
    ) -> None:
        self.backend = backend
        # tokens a greedy search (RAG-Token or RAG-Sequence) drafts per step
        # (openbook/rag/drafting.py); 0: none.
        # Only where the family verifies drafts (``backend.drafts()``).
        self.draft_tokens = draft_tokens if backend.drafts() else 0
        # drafted steps, tokens drafted and tokens of those accepted, since the engine started
        # (the benchmark's tokens per step)
        self.drafted_steps = 0
        self.drafted_tokens = 0
        self.accepted_tokens = 0
        self.calibration = calibration
        self.settings_for = settings_for
        self.stop = stop
        self.max_rows = max_rows
        self.stop_strings = tuple(stop_strings)
        self.answer_prefix = answer_prefix
        self._state: DecodeState | None = None
        self._groups: list[tuple[Running, Rows]] = []
        self._requests: list[Running] = []
        self._done: list[Outcome] = []
        # seconds of the latest step's forward pass and searches, and of finalising the requests
        # that finished at it (the generator's scheduler measures its speed from these); of
        # the latter, the seconds and tokens of RAG-Sequence thorough's scoring
        # (rag_sequence.scoring_tokens), which the scheduler measures as work of its own
        self.last_step_s = 0.0
        self.last_finish_s = 0.0
        self.last_scoring_s = 0.0
        self.last_scored_tokens = 0
        # prompt tokens of the latest prefill chunk whose keys/values were reused, not computed
        self.last_reused_tokens = 0

    # ------------------------------------------------------------------ admission

    @property
    def rows(self) -> int:
        """Decoder rows in the running batch."""
        return sum(g.rows for _, g in self._groups)

    @property
    def prefilling(self) -> list[Running]:
        """Requests added with chunks still to encode, first added first."""
        return [r for r in self._requests if r.enc is None]

    @property
    def requests(self) -> list[Running]:
        """Requests admitted and not finished: prefilling or decoding."""
        return list(self._requests)

    def pending(self) -> bool:
        """Whether :meth:`step` has work: rows to decode, outcomes to return, or a request
        whose caller gave up to drop."""
        return bool(
            self._groups
            or self._done
            or any(r.gave_up is not None and r.gave_up() for r in self._requests)
        )

    def __len__(self) -> int:
        """Requests admitted and not yet returned by :meth:`step` (some may be finished: one
        whose answer ended at its first token is returned by the next step)."""
        return len(self._requests) + len(self._done)

    def accepts(self, rows: int, joining: int = 0) -> bool:
        """Whether a request of ``rows`` decoder rows (passages x beams) may join now, when
        ``joining`` rows were admitted since the last step: the batch is empty and nothing else
        joins, or the family joins running batches and the rows (those of requests still
        prefilling included) stay within ``max_rows``."""
        if not self._requests and not joining:
            return True
        if not self.backend.joins_running:
            return False
        pending = sum(r.rows for r in self.prefilling)
        return self.rows + pending + joining + rows <= self.max_rows

    def add(
        self,
        question: str,
        passages: Sequence[Passage],
        options: DecodingOptions,
        *,
        tag: Any = None,
        gave_up: GaveUp | None = None,
        on_token: OnToken | None = None,
        chunk_passages: int | None = None,
    ) -> Running:
        """Admit one (validated) request. Without ``chunk_passages`` (or when the family cannot
        concatenate encoded passages) its whole prompt is encoded here and its rows join the
        batch: it decodes from the next :meth:`step` on, which also returns it once finished.
        With ``chunk_passages``, nothing is encoded yet: :meth:`prefill` encodes that many
        passages per call (all of them where the family cannot concatenate encoded passages),
        and the rows join once all are encoded. ``on_token``, for a greedy
        request, is called with every token as it is decided (:mod:`openbook.rag.streaming`),
        from the thread that runs the engine, before the request's outcome is returned."""
        k = len(passages)
        chunk = k
        if chunk_passages is not None and self.backend.concats_encoded():
            chunk = max(1, min(k, chunk_passages))
        scores = torch.tensor([[float(p.score) for p in passages]])
        request = Running(
            tag,
            question,
            passages,
            options,
            doc_log_prior(scores)[0],
            self.settings_for(options),
            gave_up,
            chunk,
            on_token=on_token,
        )
        self._requests.append(request)
        if chunk_passages is None:
            self.prefill(request)
        return request

    def prefill(self, request: Running) -> bool:
        """Encode the next chunk of ``request`` (one of :attr:`prefilling`); once the last one
        is encoded, its rows join the batch. True when it has no chunk left."""
        if request.enc is not None:
            return True
        started = _now()
        at = request.prefilled
        chunk = list(request.passages[at : at + request.chunk_passages])
        part = self.backend.encode([(request.question, chunk)], len(chunk))
        request.parts.append(part)
        self.last_reused_tokens = part.reused_tokens
        request.reused_tokens += part.reused_tokens
        if request.prefilled == len(request.passages):
            parts, request.parts = request.parts, []
            request.enc = parts[0] if len(parts) == 1 else self.backend.concat_encoded(parts)
            self._join(request)
        request.cost_s += _now() - started
        if request.enc is not None and not any(g.live for g in request.groups):
            self._finish(request)
        return request.enc is not None

    def _join(self, request: Running) -> None:
        """Start the searches of a request that was just encoded; its live rows join the batch."""
        enc, options = request.enc, request.options
        assert enc is not None
        # a sampling request's own random generator: its draws depend on nothing else in the
        # batch (openbook.rag.sampling); the passages of RAG-Sequence share it, drawing in
        # passage order at every step
        generator = request_generator(options.seed) if options.sampling else None
        groups: list[Rows]
        drafts = self.draft_tokens > 0 and not options.sampling and options.num_beams == 1
        sources = self.backend.draft_sources(request.question, request.passages) if drafts else None
        if options.mode == "rag-token":
            drafter = PassageDrafter(sources) if sources is not None else None
            groups = [
                RagTokenRows(
                    enc, request.log_prior, request.settings, self.stop, generator, drafter
                )
            ]
        else:
            # each passage's greedy search drafts from that passage alone
            groups = [
                rag_sequence.PassageRows(
                    enc.first_logprobs[z],
                    request.settings,
                    self.stop,
                    generator,
                    PassageDrafter([sources[z]]) if sources is not None else None,
                )
                for z in range(enc.k)
            ]
        request.groups = groups
        # one row per passage decides its token at every step (greedy, or a single sample)
        if request.on_token is not None and options.rows_per_passage == 1:
            request.stream = RequestStream(
                request.on_token,
                request.log_prior,
                lambda token: self.backend.token_strings([token])[0],
                self.backend.decode,
                self.stop_strings,
                self.answer_prefix,
            )
            request.emit(groups)
        live = [g for g in groups if g.live]
        if live:
            state = self.backend.start(enc, options.rows_per_passage)
            if len(live) < len(groups):  # RAG-Sequence passages that ended at their first token
                rows = _rows_of(groups, lambda g: g.live).to(self.backend.device)
                state = self.backend.keep(state, rows)
            self._state = state if self._state is None else self.backend.join([self._state, state])
            self._groups.extend((request, g) for g in live)

    def abort_request(self, request: Running) -> None:
        """Drop a request still prefilling (whose chunk failed); it is not returned by
        :meth:`step`."""
        if request.enc is None and request in self._requests:
            self._requests.remove(request)
            request.parts, request.done = [], True

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
        self.last_step_s = self.last_finish_s = self.last_scoring_s = 0.0
        self.last_scored_tokens = 0
        if self._groups:
            started = _now()
            self._advance()
            self.last_step_s = _now() - started
            stepped = {id(r): r for r, _ in self._groups}.values()
            for request in stepped:
                request.cost_s += self.last_step_s / len(stepped)
                request.steps += 1
            started = _now()
            self._leave()
            self.last_finish_s = _now() - started
        done, self._done = self._done, []
        return done

    def _advance(self) -> None:
        if self.draft_tokens:
            drafts = [group.draft(self.draft_tokens) for _, group in self._groups]
            if any(drafts):
                self._advance_drafted(drafts)
                return
        feeds = [group.feed() for _, group in self._groups]
        self._reorder([rows for _, rows in feeds])
        assert self._state is not None
        lp = self.backend.step(self._state, torch.cat([fed for fed, _ in feeds]))
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

    def _reorder(self, reorders: list[Tensor | None]) -> None:
        """Reorder the cache's rows as the searches reordered theirs (``reorders``: each
        group's new order of its rows, None where it kept them), if any did; the groups' rows
        stand one after another in the cache, in ``self._groups``' order."""
        if all(rows is None for rows in reorders):
            return
        order: list[Tensor] = []
        at = 0
        device = next(rows.device for rows in reorders if rows is not None)
        for (_, group), rows in zip(self._groups, reorders, strict=True):
            order.append((torch.arange(group.rows, device=device) if rows is None else rows) + at)
            at += group.rows
        assert self._state is not None
        self.backend.reorder(self._state, torch.cat(order))

    def _advance_drafted(self, drafts: list[list[int]]) -> None:
        """One forward pass over the decided token and the draft of every drafting request
        (other rows: their token, then padding); then position by position, every search still
        reading advanced by that position's log-probs (:func:`~openbook.rag.drafting.takes_next`),
        the LM head run once per position over the rows of those searches only; then the
        rejected tokens leave the cache."""
        fed = 1 + max(len(d) for d in drafts)
        tokens: list[Tensor] = []
        reorders: list[Tensor | None] = []
        for (_, group), draft in zip(self._groups, drafts, strict=True):
            token, rows = group.feed()
            row = token.new_full((group.rows, fed), self.backend.pad_token_id)
            row[:, 0] = token
            if draft:
                row[:, 1 : 1 + len(draft)] = torch.tensor(draft, device=token.device)
            tokens.append(row)
            reorders.append(rows)
        self._reorder(reorders)
        assert self._state is not None
        fed_tokens = torch.cat(tokens)
        lp = self.backend.step_many(self._state, fed_tokens)  # (N, fed, V), as read
        spans: list[Tensor] = []
        at = 0
        for _, group in self._groups:
            spans.append(torch.arange(at, at + group.rows, device=fed_tokens.device))
            at += group.rows
        read = [0] * len(self._groups)  # positions each search read: the fed tokens it keeps
        reading = list(range(len(self._groups)))
        for position in range(fed):
            if not reading:
                break
            every = len(reading) == len(self._groups)
            here = lp.at(position, None if every else torch.cat([spans[j] for j in reading]))
            still: list[int] = []
            offset = 0
            for j in reading:
                request, group = self._groups[j]
                mine = here[offset : offset + group.rows]
                offset += group.rows
                read[j] += 1
                if takes_next(group, mine, drafts[j], position):
                    still.append(j)
                if request.stream is not None:
                    request.emit([group])
            reading = still
        for draft, used in zip(drafts, read, strict=True):
            if draft:
                self.drafted_steps += 1
                self.drafted_tokens += len(draft)
                self.accepted_tokens += used - 1
        groups = [group for _, group in self._groups]
        kept = [torch.full((g.rows,), used) for g, used in zip(groups, read, strict=True)]
        self.backend.drop_fed(self._state, fed, torch.cat(kept))

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
        if request.options.mode == "rag-sequence-thorough":
            self.last_scoring_s += _now() - started
            self.last_scored_tokens += request.scored_tokens()
        calibration = self.calibration
        # the passages' normalised texts, once per request and only for a calibration that
        # reads features (normalising k passages is not free on the decoding thread)
        normalized = (
            normalized_texts(request.passages)
            if calibration is not None and calibration.needs_features
            else None
        )
        for hyp in result.hypotheses:
            hyp.finish_reason = self._finish_reason(hyp.token_ids, request.options)
            features = (
                confidence_features(
                    hyp,
                    request.passages,
                    result.doc_prior,
                    question=request.question,
                    normalized=normalized,
                )
                if normalized is not None
                else None
            )
            hyp.raw_confidence, hyp.confidence = confidences(
                hyp.log_prob, hyp.scored_tokens, calibration, features
            )
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
