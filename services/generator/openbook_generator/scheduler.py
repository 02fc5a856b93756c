"""The generator's continuous batching loop: admission by measured speed, fair scheduling.

A bounded waiting line feeds one decoding thread, which owns the batches
(:class:`openbook.rag.engine.DecodingEngine`) of every loaded model. Between any two pieces of
work the thread admits waiting requests (while the running requests are fewer than
``max_batch_size``, their estimated memory together stays within the budget
(:mod:`openbook.rag.memory`) and a batch accepts their rows), then runs ONE piece of work:

* a **prefill chunk** of one admitted request (``chunk_tokens`` prompt tokens at most, whole
  passages): a k=100 prompt is prefilled in many chunks, not in one pause of everything else;
* or one **decoding step** of one batch, which answers every request that finished at it.

Requests of up to ``solo_rows`` decoder rows (passages x beams) share one batch per model, so
that a short answer never waits for a whole batch to end; a larger request decodes in a batch
of its own, so that its rows do not make every step of the small requests slow.

Which piece runs next is decided by **least attained service**: the work of the request that
has had the least engine time so far (a step counts for its batch's least-served request).
A request that just arrived goes first, so a default question is answered in about the time it
takes alone even while a k=100 request is running, and the large request runs in the gaps.
So that the large request still finishes in time, a request whose deadline comes near (its
estimated remaining work would take more than half of the time it has left) gets every other
piece of work, and all of them once its remaining work fills the time left.

**Admission by measured speed** (:mod:`openbook_generator.speed`): the engine's speed is
measured on every piece of work, and every request's remaining work is estimated from it (its
prefill tokens, its share of the steps of its batch for the tokens it is expected to decode).
A request is refused at once (:class:`~openbook.errors.Overloaded`, the gateway's 429) when
the work due before its deadline (that of every request with an earlier deadline, and its own)
would not fit in the time it has, or when it would push an admitted request past its deadline;
its ``Retry-After`` is how long that work takes to drain. One that could not finish in time
even alone (at the worst case of its ``max_new_tokens``) is refused with
:class:`~openbook.errors.TooLarge` (the gateway's 413), saying what to lower. The check and the
entry into the line are one step under the lock (a crowd arriving together is checked one by
one); every plan is scaled by :class:`Lateness` (the late tail of taken / planned); and a
waiting request that can no longer make its deadline (the engine slowed down after it was
admitted) is refused between two pieces of work instead of being started.

Invariants:
* the line never holds more than ``max_queue`` requests: ``submit`` fails at once (backpressure);
* a request whose caller gave up (deadline passed, cancelled) leaves the line at once and is
  never run; once running, it leaves its batch before the next piece of work;
* no wait is unbounded: every caller waits at most its own timeout;
* a model reload never disturbs running requests: they finish on the engine of the model they
  started on, while new requests start on the new model.
"""

from __future__ import annotations

import logging
import math
import queue
import statistics
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from openbook.compute_threads import ComputeThreads
from openbook.errors import DeadlineExceeded, Overloaded, TooLarge
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.rag.engine import DecodingEngine, Running
from openbook.rag.errors import Abandoned
from openbook.rag.memory import RequestShape
from openbook.rag.streaming import OnToken, TokenEvent
from openbook.serving.batcher import Waiting, WaitingLine, bounded_timeout, resolve
from openbook.types import Passage
from openbook_generator.speed import EngineSpeed

log = logging.getLogger(__name__)

Generated = tuple[GenerationResult, str]  # the result and the model version that produced it

# Admission plans with this fraction of a deadline: the estimate is an estimate, and the
# gateway's own work (retrieval, HTTP) comes out of the same deadline.
DEADLINE_SHARE = 0.8
# Weight of a finished request in the running estimate of the share of ``max_new_tokens`` that
# answers use (stop strings and EOS end most answers early), and where it starts.
STEPS_WEIGHT = 0.1
INITIAL_STEPS_SHARE = 0.5
# A waiting request is shed unless it is expected to finish this share of its whole time
# (admission to deadline) before its deadline: a result that is ready just in time is still
# late once the reply has crossed a starved process and the network (a 504, not an answer).
SHED_MARGIN_SHARE = 0.1
# Lateness: the quantile of taken/planned it plans with, over how many recent requests, and
# which requests count (those whose plan filled at least this share of their time left).
LATENESS_QUANTILE = 0.9
LATENESS_SAMPLES = 32
LATENESS_TIGHT_SHARE = 0.25


@dataclass
class StageTimes:
    """When (``time.time_ns()``, 0: not yet) a request was admitted into the line, taken into a
    batch and resolved: written by the scheduler, read by the servicer's trace spans once the
    request is resolved."""

    admitted_ns: int = 0
    started_ns: int = 0
    finished_ns: int = 0


@dataclass(frozen=True)
class GenerateItem:
    """A validated request waiting for a place, with the shape its memory is estimated from."""

    question: str
    passages: Sequence[Passage]
    options: DecodingOptions
    shape: RequestShape
    # called from the decoding thread with every token decided (a streaming request)
    on_token: OnToken | None = None
    # admission's plan, set when it enters the line: when (time.monotonic()) and the seconds
    # it was expected to take to finish (the work due before it and its own), compared with
    # what it took
    admitted_at: float = 0.0
    planned_s: float = 0.0
    # the stages' wall-clock times, for tracing (None: not traced); shared by the copies
    # ``replace`` makes of this item
    times: StageTimes | None = None


@dataclass(frozen=True)
class SchedulingOptions:
    """How the decoding thread batches and orders work (the module docstring)."""

    max_batch_size: int = 8  # requests admitted at once, over all batches
    max_wait_ms: float = 5.0  # an idle engine waits this long for requests arriving together
    max_queue: int = 32
    solo_rows: int = 16  # requests with more decoder rows decode in a batch of their own
    chunk_tokens: int = 1024  # prompt tokens per prefill chunk (whole passages; one at least)


@dataclass(eq=False)
class _Batch:
    """One decoding batch: the engine of one model, shared by small requests or holding one
    large request (``solo``)."""

    generator: RagGenerator
    engine: DecodingEngine
    solo: bool


@dataclass(eq=False)
class _Admitted:
    """A request taken from the line: its batch and engine entry once added."""

    waiting: Waiting
    seq: int  # arrival order, the tie-break of equal service
    batch: _Batch | None = None
    running: Running | None = None


# Put in a stream's queue once its request is resolved (answered, failed or dropped).
_RESOLVED = object()


class Scheduler(WaitingLine[GenerateItem, Generated]):
    """Continuous batching of generate requests with measured-speed admission (module
    docstring).

    ``current()`` is the model new requests start on. ``fits(shapes)`` says whether requests of
    those shapes may run together (the memory budget). ``on_step(requests, queued)`` is told the
    requests of every decoding step, ``on_drop(where, n)`` of requests dropped because their
    caller gave up (``where``: "queued" or "running"), ``on_admit(shape)`` of every request about
    to start (before its first tensor), ``on_finish(shape, idle)`` of every request
    that ended (answered or failed) once its memory is dropped, with whether nothing runs or waits
    now (called by the decoding thread). ``submit`` (:class:`WaitingLine`) blocks
    for a result; :meth:`stream` yields tokens as they are decided, then the result;
    :meth:`admission` refuses what cannot finish in time.
    """

    def __init__(
        self,
        current: Callable[[], RagGenerator],
        options: SchedulingOptions,
        *,
        fits: Callable[[list[RequestShape]], bool],
        on_step: Callable[[int, int], None] | None = None,
        on_drop: Callable[[str, int], None] | None = None,
        on_admit: Callable[[RequestShape], None] | None = None,
        on_finish: Callable[[RequestShape, bool], None] | None = None,
        compute: ComputeThreads | None = None,
    ) -> None:
        super().__init__(
            max_queue=options.max_queue,
            name="generate-scheduler",
            on_drop=None if on_drop is None else (lambda n: on_drop("queued", n)),
        )
        self._current = current
        self.options = options
        self.max_batch_size = options.max_batch_size
        self.max_wait_s = options.max_wait_ms / 1000.0
        self._fits = fits
        self._on_step = on_step
        self._on_running_drop = on_drop
        self._on_admit = on_admit
        self._on_finish = on_finish
        # sized on the decoding thread (torch's OpenMP size is per thread), between two pieces
        # of work; None: the thread keeps torch's default
        self._compute = compute
        self._resizing: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models hooked
        self._batches: list[_Batch] = []
        # id(waiting) -> the admitted request
        self._running: dict[int, _Admitted] = {}
        self._arrivals = 0
        self._urgent_turn = False  # urgent requests get every other piece of work
        # run by the decoding thread between two pieces of work (calibration)
        self._jobs: list[Callable[[], None]] = []
        self.speed = EngineSpeed()
        self.lateness = Lateness()
        self.steps_share = INITIAL_STEPS_SHARE
        self._start()

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def slowdown(self, kind: str) -> float:
        """The measured slowdown of ``kind`` ("prefill", "step") of work (speed.py)."""
        with self._cond:
            speed = self.speed
            return (speed.prefill_slowdown if kind == "prefill" else speed.step_slowdown).factor

    # ------------------------------------------------------------------ admission

    def admission(
        self, shape: RequestShape, options: DecodingOptions, time_left_s: float | None
    ) -> float:
        """Refuse a request of ``shape`` whose deadline is ``time_left_s`` from now if it cannot
        finish in time (module docstring): :class:`TooLarge` if not even alone,
        :class:`Overloaded` (with ``retry_after_s``) if not behind the work already here.
        Returns the seconds it is expected to take before :class:`Lateness` scales them (what
        the lateness of this request is measured against; 0: not estimated)."""
        if time_left_s is None:
            return 0.0
        with self._cond:
            if not self.speed.known:
                return 0.0  # nothing measured yet: nothing to refuse on
            now = time.monotonic()
            allowed = time_left_s * DEADLINE_SHARE
            lateness = self.lateness.factor
            joins_shared = shape.rows <= self.options.solo_rows
            alone = lateness * self._work_s(shape, options, shape.rows, 0, worst=True)
            if alone > allowed:
                raise TooLarge(
                    f"this request would take about {alone:.0f}s of generation at the speed "
                    f"measured now ({self.speed.describe()}; {shape.passages} passages x "
                    f"{shape.beams} beams, {shape.input_tokens} prompt tokens, up to "
                    f"{shape.new_tokens} new tokens) and its deadline allows {time_left_s:.0f}s: "
                    "use fewer passages (k), beams or new tokens"
                )
            # the shared batch as it would be with this request in it
            shared = self._shared_batch_rows(shape if joins_shared else None)
            rows = shared if joins_shared else shape.rows
            mine = lateness * self._work_s(shape, options, rows, 0)
            deadline = now + time_left_s
            work = [(d, lateness * w) for d, w in self._work_ahead(shared)]
            due = sum(w for d, w in work if d <= deadline) + mine
            late = due - allowed
            # and no admitted request with a later deadline may be pushed past it
            for d, _ in work:
                if d > deadline:
                    due_d = sum(w for e, w in work if e <= d) + mine
                    late = max(late, due_d - (d - now) * DEADLINE_SHARE)
            if late > 0:
                raise Overloaded(
                    f"the generator has about {due - mine:.0f}s of work due before this "
                    f"request's deadline and this request needs about {mine:.1f}s more, which "
                    f"does not fit in the {time_left_s:.0f}s it allows ({self.speed.describe()}); "
                    f"retry in {math.ceil(late)}s",
                    retry_after_s=late,
                )
            return due / lateness

    def _work_ahead(self, shared: int) -> list[tuple[float, float]]:
        """(deadline, estimated remaining seconds) of every request running or waiting, when
        the shared batch decodes ``shared`` rows; a request with no deadline counts as due at
        the end of time. Under ``_cond``."""
        out = []
        for admitted in self._running.values():
            out.append((_deadline(admitted.waiting), self._remaining_s(admitted, shared)))
        for waiting in self._waiting:
            out.append((_deadline(waiting), self._waiting_work_s(waiting.payload, shared)))
        return out

    def _waiting_work_s(self, item: GenerateItem, shared: int) -> float:
        """Estimated engine seconds of waiting ``item`` once started: in a batch of its own if
        it is large, else in the shared batch of ``shared`` rows."""
        rows = item.shape.rows if item.shape.rows > self.options.solo_rows else shared
        return self._work_s(item.shape, item.options, rows, 0)

    def retry_after_s(self) -> float:
        """How long until a place in the line frees: the shortest remaining work of a running
        request (when it ends, a waiting one moves in)."""
        with self._cond:
            shared = self._shared_batch_rows(None)
            left = [self._remaining_s(a, shared) for a in self._running.values()]
        return min(left, default=1.0)

    def _enqueue(self, payload, timeout_s, on_cancel):
        """Admit ``payload`` (:meth:`admission`, with ``timeout_s`` as its deadline) and put it
        in the line, under one hold of the lock: requests arriving together are each checked
        against the others, never all against the same state (which admitted a crowd that
        could not finish in time)."""
        try:
            with self._cond:
                planned = self.admission(payload.shape, payload.options, timeout_s)
                admitted = replace(payload, admitted_at=time.monotonic(), planned_s=planned)
                if payload.times is not None:
                    payload.times.admitted_ns = time.time_ns()
                return super()._enqueue(admitted, timeout_s, on_cancel)
        except Overloaded as exc:
            if exc.retry_after_s is None:
                exc.retry_after_s = self.retry_after_s()
            raise

    # ------------------------------------------------------------------ estimates

    def _shared_batch_rows(self, joining: RequestShape | None) -> int:
        """Rows the shared batch is expected to decode while the work here (and ``joining``)
        is done: as many of its requests at once as ``max_batch_size`` lets run, of their mean
        rows. Under ``_cond``."""
        rows = [
            a.waiting.payload.shape.rows
            for a in self._running.values()
            if a.batch is not None and not a.batch.solo
        ]
        rows += [
            w.payload.shape.rows
            for w in self._waiting
            if w.payload.shape.rows <= self.options.solo_rows
        ]
        if joining is not None:
            rows.append(joining.rows)
        if not rows:
            return 1
        together = min(len(rows), self.max_batch_size)
        return max(1, round(sum(rows) / len(rows) * together))

    def _steps(self, options: DecodingOptions, worst: bool) -> int:
        """Decoding steps a request is expected to take (at most ``max_new_tokens``)."""
        if worst:
            return options.max_new_tokens
        expected = math.ceil(self.steps_share * options.max_new_tokens)
        return max(options.min_new_tokens, min(options.max_new_tokens, max(1, expected)))

    def _work_s(
        self,
        shape: RequestShape,
        options: DecodingOptions,
        batch_rows: int,
        steps_done: int,
        worst: bool = False,
        prefilled_share: float = 0.0,
    ) -> float:
        """Estimated engine seconds of a request of ``shape`` that decodes in a batch of
        ``batch_rows`` rows: its prefill (what is left of it), its share of the steps of its
        batch (what is left of them), RAG-Sequence thorough's scoring."""
        speed = self.speed
        rows = shape.rows
        tokens_left = shape.input_tokens * (1.0 - prefilled_share)
        chunks = max(1, math.ceil(tokens_left / max(1, self.options.chunk_tokens)))
        prefill = chunks * speed.prefill_s(tokens_left / chunks) if tokens_left > 0 else 0.0
        batch_rows = max(rows, batch_rows)
        steps = max(1, self._steps(options, worst) - steps_done)
        decode = steps * speed.step_s(batch_rows) * rows / batch_rows
        scoring = 0.0
        if options.mode == "rag-sequence-thorough":  # every hypothesis under every passage
            scoring = speed.prefill_s(rows * shape.passages * self._steps(options, worst))
        return prefill + decode + scoring

    def _remaining_s(self, admitted: _Admitted, shared_rows: int) -> float:
        item: GenerateItem = admitted.waiting.payload
        running = admitted.running
        solo = admitted.batch is not None and admitted.batch.solo
        rows = item.shape.rows if solo else max(shared_rows, item.shape.rows)
        if running is None:
            return self._work_s(item.shape, item.options, rows, 0)
        prefilled = running.prefilled / max(1, len(running.passages))
        return self._work_s(
            item.shape, item.options, rows, running.steps, prefilled_share=prefilled
        )

    # ------------------------------------------------------------------ streaming

    def stream(
        self,
        item: GenerateItem,
        timeout_s: float | None = None,
        on_cancel: Callable[[Callable[[], None]], object] | None = None,
    ) -> Iterator[TokenEvent | Generated]:
        """Generate ``item``, yielding its tokens as they are decided
        (:mod:`openbook.rag.streaming`: greedy decoding only) and then its result; raises its
        error, as :meth:`submit` does. Closing the iterator early (the caller went away) gives
        the request up: it leaves the line, or its rows the batch before the next step."""
        timeout_s = bounded_timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        events: queue.SimpleQueue[object] = queue.SimpleQueue()
        waiting = self._enqueue(replace(item, on_token=events.put), timeout_s, on_cancel)
        waiting.future.add_done_callback(lambda _: events.put(_RESOLVED))
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = events.get(timeout=left)
                except queue.Empty:
                    self._give_up(waiting)
                    raise DeadlineExceeded(f"no result within {timeout_s:.1f}s") from None
                if event is _RESOLVED:
                    break
                assert isinstance(event, TokenEvent)
                yield event
            yield self._outcome(waiting, None)  # resolved: returns at once
        finally:
            self._give_up(waiting)  # a no-op once it is resolved

    # ------------------------------------------------------------------ calibration

    def calibrate(self, generator: RagGenerator) -> None:
        """Measure ``generator``'s speed (:meth:`EngineSpeed.calibrate`): after a warm-up
        request, prefills of 1, 4 and 8 passages and decoding steps of 1, 8 and 32 rows, each
        twice, on an engine of its own (the median of each size: a busy machine's outliers must
        not set the shape). It runs on the decoding thread, between two pieces of work, so
        that it measures the thread (and its compute threads) that will do the work; this
        waits for it."""
        done: Future[None] = Future()

        def job() -> None:
            try:
                self._calibrate(generator)
                done.set_result(None)
            except Exception as exc:  # noqa: BLE001 - raised in the caller
                done.set_exception(exc)

        with self._cond:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._jobs.append(job)
            self._cond.notify_all()
        done.result()

    def _calibrate(self, generator: RagGenerator) -> None:
        self._resize_within(generator)
        prefills: dict[float, list[float]] = {}
        steps: dict[float, list[float]] = {}
        question = "What is measured when the generator starts?"
        sizes = [(2, 1, False)] + [(1, 1, True), (4, 2, True), (8, 4, True)] * 2
        with torch.inference_mode():
            for k, beams, measured in sizes:
                passages = _calibration_passages(k)
                options = DecodingOptions(num_beams=beams, max_new_tokens=5, min_new_tokens=5)
                shape = generator.request_shape(question, passages, options)
                engine = generator.engine()
                started = time.perf_counter()
                engine.add(question, passages, options)
                prefill_s = time.perf_counter() - started
                while len(engine):
                    rows = engine.rows
                    engine.step()
                    if measured and engine.last_step_s > 0:
                        steps.setdefault(rows, []).append(engine.last_step_s)
                if measured:
                    prefills.setdefault(shape.input_tokens, []).append(prefill_s)
        cache = getattr(generator.backend, "passage_cache", None)
        if cache is not None:
            cache.clear()  # the calibration's passages are nobody's
        with self._cond:
            self.speed.calibrate(_medians(prefills), _medians(steps))
            self.lateness = Lateness()
        log.info("generator speed at start: %s", self.speed.describe())

    # ------------------------------------------------------------------ the decoding thread

    def _take(self) -> tuple[list[_Admitted], float | None] | None:
        """Waiting requests that may start now, and when the thread stopped idling if it had
        nothing to do (None once closed and drained). Blocks while nothing runs and nothing
        waits; when idle, waits ``max_wait_s`` after the first arrival so that requests
        arriving together start together."""
        woke = None
        with self._cond:
            while not self._waiting and not self._running and not self._jobs:
                if self._closed:
                    return None
                self._cond.wait()
                if self._waiting and self.max_wait_s > 0:
                    self._cond.wait_for(
                        lambda: len(self._waiting) >= self.max_batch_size or self._closed,
                        timeout=self.max_wait_s,
                    )
                woke = time.perf_counter()
            self._shed_hopeless()
            taken: list[_Admitted] = []
            joining: dict[int, int] = {}  # id(batch) -> rows taken into it now
            shapes = [a.waiting.payload.shape for a in self._running.values()]
            while self._waiting and len(self._running) < self.max_batch_size:
                if self._expired_head():
                    continue
                head = self._waiting[0]
                item: GenerateItem = head.payload
                if (self._running or taken) and not self._fits([*shapes, item.shape]):
                    break  # it starts when enough running requests have finished
                batch = self._batch_for(item, joining)
                if batch is None:
                    break  # the shared batch is full of rows: it joins when some leave
                joining[id(batch)] = joining.get(id(batch), 0) + item.shape.rows
                self._waiting.popleft()
                if item.times is not None:
                    item.times.started_ns = time.time_ns()
                self._arrivals += 1
                admitted = _Admitted(head, self._arrivals, batch)
                taken.append(admitted)
                shapes.append(item.shape)
                self._running[id(head)] = admitted
            return taken, woke

    def _shed_hopeless(self) -> None:
        """Refuse (:class:`Overloaded`, the gateway's 429) every waiting request that can no
        longer finish before its deadline at the speed measured now: the engine slowed down
        after it was admitted (a neighbour took the CPU, a crowd arrived). It is told at once,
        with the time the work ahead of it takes as its retry-after, instead of starting work
        that runs into its deadline (a 504). Same model as :meth:`admission`: the work of the
        running requests and of those ahead of it in the line, then its own, one after the
        other, scaled by the lateness, with a margin of :data:`SHED_MARGIN_SHARE` of its time.
        Under ``_cond``."""
        if not self._waiting or not self.speed.known:
            return
        now = time.monotonic()
        lateness = self.lateness.factor
        shared = self._shared_batch_rows(None)
        ahead = lateness * sum(self._remaining_s(a, shared) for a in self._running.values())
        for waiting in list(self._waiting):
            item: GenerateItem = waiting.payload
            mine = lateness * self._waiting_work_s(item, shared)
            if waiting.deadline is None:
                ahead += mine
                continue
            margin = SHED_MARGIN_SHARE * (waiting.deadline - item.admitted_at)
            if now + ahead + mine <= waiting.deadline - margin:
                ahead += mine
                continue
            self._waiting.remove(waiting)
            resolve(
                waiting.future,
                Overloaded(
                    f"the generator slowed down after this request was admitted "
                    f"({self.speed.describe()}): the work ahead of it would take about "
                    f"{ahead:.1f}s and it needs {mine:.1f}s more, past its deadline; "
                    f"retry in {math.ceil(ahead)}s",
                    retry_after_s=ahead,
                ),
            )
            self._dropped()

    def _batch_for(self, item: GenerateItem, joining: dict[int, int]) -> _Batch | None:
        """The batch ``item`` decodes in: a new one of its own when it is large, or when the
        model family joins no running batch; else the current model's shared batch, if its
        rows leave room (``joining``: rows taken into batches since they last ran). Under
        ``_cond``."""
        generator = self._current()
        rows = item.shape.rows
        if rows <= self.options.solo_rows:
            for batch in self._batches:
                if batch.generator is generator and not batch.solo:
                    fits = batch.engine.accepts(rows, joining.get(id(batch), 0))
                    return batch if fits else None
        self._resize_within(generator)
        batch = _Batch(generator, generator.engine(), solo=rows > self.options.solo_rows)
        if not batch.solo and not generator.backend.joins_running:
            batch.solo = True  # nothing can join it: it is this request's alone
        self._batches.append(batch)
        return batch

    def _resize_within(self, generator: RagGenerator) -> None:
        """Let the compute threads be resized between the layers of ``generator``'s forward
        passes too, not only between pieces of work: a piece that a neighbour stalls may take
        many seconds (a team of two on one core), and the first chance to give up the lost
        core must not wait for its end. A forward pre-hook on every layer of the model's layer
        lists calls ``maybe_resize`` (a clock read unless a second has passed) when it runs on
        the decoding thread. Called by the decoding thread for each model it runs."""
        model = generator.model
        if self._compute is None or model in self._resizing:
            return
        compute, thread = self._compute, self._thread

        def between_layers(module: torch.nn.Module, args: object) -> None:
            if threading.current_thread() is thread:
                compute.maybe_resize()

        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_pre_hook(between_layers)
        self._resizing.add(model)

    def _run(self) -> None:
        # The whole turn of the thread is timed, not only the model's forward pass: taking and
        # admitting requests, choosing work, answering, and the request threads holding the
        # interpreter meanwhile are work too, and a throttled process is slow at all of it
        # (what admission must plan with). Only waiting idle for requests is not.
        if self._compute is not None:
            self._compute.apply()  # before calibration: it measures the size work runs at
        turn = time.perf_counter()
        while True:
            took = self._take()
            if took is None:
                return
            taken, woke = took
            if woke is not None:
                turn = woke
            if self._compute is not None:
                # a neighbour may have taken a core (or given it back) since the last reading;
                # the speed model sees the change in the next pieces' times (speed.py)
                self._compute.maybe_resize()
            with self._cond:
                jobs, self._jobs = self._jobs, []
            for job in jobs:
                job()
                turn = time.perf_counter()  # calibration measures itself
            with torch.inference_mode():
                for admitted in taken:
                    self._admit(admitted)
                work = self._next()
                done = None if work is None else self._do(*work)
                self._forget_idle_batches()
            if done is not None:
                kind, size = done
                now = time.perf_counter()
                with self._cond:
                    if kind == "step":
                        self.speed.observe_step(size, now - turn)
                    else:
                        self.speed.observe_prefill(size, now - turn)
                turn = now

    def _admit(self, admitted: _Admitted) -> None:
        """Add a taken request to its batch's engine (nothing encoded yet)."""
        waiting = admitted.waiting
        item: GenerateItem = waiting.payload
        batch = admitted.batch
        assert batch is not None
        chunk = max(1, self.options.chunk_tokens // max(1, item.shape.prompt_tokens))
        if self._on_admit is not None:
            self._on_admit(item.shape)  # every admitted request reaches _finish: on_finish
        try:
            running = batch.engine.add(
                item.question,
                item.passages,
                item.options,
                tag=(waiting, batch.generator.model_version),
                gave_up=waiting.gave_up,
                on_token=item.on_token,
                chunk_passages=chunk,
            )
        except Exception as exc:  # noqa: BLE001 - fails this request only
            log.exception("admitting a request failed")
            self._finish(waiting, exc)
            return
        with self._cond:
            admitted.running = running

    def _next(self) -> tuple[_Batch, Running | None] | None:
        """The next piece of work: (batch, request) for a prefill chunk of that request,
        (batch, None) for a decoding step of that batch. Least attained service first; an
        urgent request (module docstring) every other time, or always once it is critical."""
        now = time.monotonic()
        candidates: list[tuple[tuple, tuple[_Batch, Running | None]]] = []
        with self._cond:
            shared = self._shared_batch_rows(None)
            by_running = {id(a.running): a for a in self._running.values() if a.running is not None}
            for batch in self._batches:
                engine = batch.engine
                for running in engine.prefilling:
                    admitted = by_running.get(id(running))
                    if admitted is not None:
                        key = self._priority(admitted, running, now, shared)
                        candidates.append((key, (batch, running)))
                if engine.pending():
                    keys = [
                        self._priority(by_running[id(r)], r, now, shared)
                        for r in engine.requests
                        if r.enc is not None and id(r) in by_running
                    ]
                    candidates.append((min(keys, default=(0, 0.0, 0.0, 0)), (batch, None)))
        if not candidates:
            return None
        candidates.sort(key=lambda c: c[0])
        urgent = [c for c in candidates if c[0][0] < 2]
        if urgent and (urgent[0][0][0] == 0 or self._urgent_turn):
            self._urgent_turn = False
            return urgent[0][1]
        self._urgent_turn = bool(urgent)
        # least attained service among all (urgent ones included, by their service)
        return min(candidates, key=lambda c: (c[0][2], c[0][3]))[1]

    def _priority(
        self, admitted: _Admitted, running: Running, now: float, shared: int
    ) -> tuple[int, float, float, int]:
        """(urgency, deadline, attained service, arrival): urgency 0 when the remaining work
        fills the time left (critical), 1 when it fills half of it, 2 otherwise."""
        deadline = admitted.waiting.deadline
        urgency = 2
        if deadline is not None and self.speed.known:
            left = (deadline - now) * DEADLINE_SHARE
            remaining = self.lateness.factor * self._remaining_s(admitted, shared)
            if remaining >= left:
                urgency = 0
            elif 2 * remaining >= left:
                urgency = 1
        return (urgency, deadline or math.inf, running.cost_s, admitted.seq)

    def _do(self, batch: _Batch, running: Running | None) -> tuple[str, float] | None:
        """Run one piece of work; what it was, for the speed model: ("step", rows) or
        ("prefill", tokens); None if it failed or decoded nothing."""
        engine = batch.engine
        if running is not None:
            return self._prefill(batch, running)
        if self._on_step is not None:
            self._on_step(len(engine), self.depth())
        rows = engine.rows
        try:
            outcomes = engine.step()
        except Exception as exc:  # noqa: BLE001 - the batch's state is lost: fail its requests
            log.exception("decoding step failed; failing the %d requests of its batch", len(engine))
            self._batches.remove(batch)
            for waiting, _version in engine.abort():
                self._finish(waiting, exc)
            return None
        self._resolve(outcomes)
        if engine.last_step_s <= 0:
            return None  # nothing decoded: answers returned, abandoned requests dropped
        return ("step", rows)

    def _prefill(self, batch: _Batch, running: Running) -> tuple[str, float] | None:
        waiting, _version = running.tag
        item: GenerateItem = waiting.payload
        before = running.prefilled
        try:
            batch.engine.prefill(running)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            log.exception("prefilling a request failed")
            batch.engine.abort_request(running)
            self._finish(waiting, exc)
            return None
        passages = max(1, len(item.passages))
        return ("prefill", item.shape.input_tokens * (running.prefilled - before) / passages)

    def _resolve(self, outcomes) -> None:
        for (waiting, version), outcome in outcomes:
            if isinstance(outcome, Abandoned):
                if self._on_running_drop is not None:
                    self._on_running_drop("running", 1)
                self._finish(waiting, DeadlineExceeded("the caller gave up; generation stopped"))
            else:
                self._finish(waiting, (outcome, version))

    def _forget_idle_batches(self) -> None:
        """Batches with nothing left go, except the current model's shared one."""
        current = self._current()
        with self._cond:
            self._batches = [
                b for b in self._batches if len(b.engine) or (b.generator is current and not b.solo)
            ]

    def _finish(self, waiting: Waiting, result: object) -> None:
        with self._cond:
            admitted = self._running.pop(id(waiting), None)
            running = None if admitted is None else admitted.running
            if running is not None and not isinstance(result, Exception):
                used = running.steps / max(1, running.options.max_new_tokens)
                self.steps_share += STEPS_WEIGHT * (min(1.0, used) - self.steps_share)
                item: GenerateItem = waiting.payload
                if waiting.deadline is not None:
                    self.lateness.observe(
                        item.planned_s,
                        time.monotonic() - item.admitted_at,
                        waiting.deadline - item.admitted_at,
                    )
        times = waiting.payload.times
        if times is not None:
            times.finished_ns = time.time_ns()
        resolve(waiting.future, result)
        if self._on_finish is not None:
            del admitted, running  # its caches: what on_finish may give back
            with self._cond:
                idle = not self._running and not self._waiting
            self._on_finish(waiting.payload.shape, idle)


class Lateness:
    """How much longer than planned admitted requests take to finish: a high quantile
    (:data:`LATENESS_QUANTILE`) of taken / planned over the last :data:`LATENESS_SAMPLES`
    requests whose plan was tight (it filled :data:`LATENESS_TIGHT_SHARE` of their time left or
    more). Admission scales every plan by it.

    It covers what the speed model does not see: the request threads' own work on a starved
    CPU, a stopped process's quantum, the spread of answer lengths. A quantile, not a mean: a
    crowd admitted up to its deadlines fails on the requests that run late, not on the average
    one. Only tight plans count: a plan far inside its deadline cannot miss it, and its ratio is
    mostly quantization (one scheduler period added to a plan of a few milliseconds). Never below
    1: requests finishing early must not make admission promise more. With fewer than ten
    samples the quantile is their maximum."""

    def __init__(self) -> None:
        self.ratios: deque[float] = deque(maxlen=LATENESS_SAMPLES)

    @property
    def factor(self) -> float:
        if not self.ratios:
            return 1.0
        ordered = sorted(self.ratios)
        at = min(len(ordered) - 1, math.ceil(LATENESS_QUANTILE * len(ordered)) - 1)
        return max(1.0, ordered[at])

    def observe(self, planned_s: float, taken_s: float, time_left_s: float) -> None:
        """A request planned to take ``planned_s`` (before scaling) of the ``time_left_s`` it
        had took ``taken_s``."""
        if planned_s > 0 and planned_s >= LATENESS_TIGHT_SHARE * time_left_s:
            self.ratios.append(taken_s / planned_s)


def _medians(samples: dict[float, list[float]]) -> list[tuple[float, float]]:
    return [(size, statistics.median(times)) for size, times in samples.items()]


def _deadline(waiting: Waiting) -> float:
    return math.inf if waiting.deadline is None else waiting.deadline


# Words of the calibration passages (any text of ordinary words would do).
_CALIBRATION_TEXT = (
    "the council met in the old hall to measure the river and the bridge that the city "
    "had built after the long winter when the harbour froze and the ships waited for "
    "spring while merchants counted grain and the library kept records of every"
)


def _calibration_passages(k: int) -> list[Passage]:
    """``k`` passages of 100 words (the paper's passage length), each different."""
    words = _CALIBRATION_TEXT.split()
    return [
        Passage(
            id=f"calibration-{i}",
            title=f"Record {i}",
            text=" ".join(words[(i + j) % len(words)] for j in range(100)),
            score=0.0,
        )
        for i in range(k)
    ]
