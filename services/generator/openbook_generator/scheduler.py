"""The generator's engine loop: the line, the decoding thread, the speed measurement.

The generator's engine is three parts, as vLLM v1's (``EngineCore.step()`` runs the scheduler's
``schedule()``, the model runner's ``execute_model()``, then ``update_from_output()``):

* :mod:`openbook_generator.policy`: the scheduling policy, pure: admission by measured speed,
  least-attained-service ordering, chunked prefill, solo batches (its docstring says how each
  decides). It decides over typed requests and is tested without a model;
* :mod:`openbook_generator.runner`: the model runner, the batches of the loaded models
  (:class:`~openbook.rag.engine.DecodingEngine` s) and one piece of work executed on them;
* this module, the loop that joins them: :class:`Scheduler` holds a bounded waiting line and
  one decoding thread. Each turn of the thread (:meth:`Scheduler._run`) takes the waiting
  requests that may start (:meth:`~Scheduler._take`, asking the policy), adds them to their
  batches, asks the policy for the next piece of work (:meth:`~Scheduler._schedule`), has the
  runner execute it and answers the callers from its output
  (:meth:`~Scheduler._update_from_output`). It owns the speed model the policy plans with: it
  times every turn (:mod:`openbook_generator.speed`) and sets its shapes at load from what
  :mod:`openbook_generator.calibration` measures on the decoding thread
  (:meth:`~Scheduler.calibrate`).

A request is admitted as it enters the line, under the line's lock (the policy's
:meth:`~openbook_generator.policy.SchedulingPolicy.admission`: a crowd arriving together is
checked one by one), and a waiting request that can no longer make its deadline is refused
between two pieces of work instead of being started; a running one that can no longer make it
even alone is refused then too, and leaves its batch. Waiting requests start in the policy's
fair order across callers (:meth:`~openbook_generator.policy.SchedulingPolicy.start_order`),
and a full line makes room for a caller holding fewer of its places
(:meth:`~openbook_generator.policy.SchedulingPolicy.displaced`).

Invariants:
* the line never holds more than ``max_queue`` requests: ``submit`` fails at once (backpressure),
  unless another caller holds at least two more places than its own (its newest is refused
  then, with the same error);
* a request whose caller gave up (deadline passed, cancelled) leaves the line at once and is
  never run; once running, it leaves its batch before the next piece of work, as does a running
  request already refused (:meth:`Scheduler._shed_overdue`);
* no wait is unbounded: every caller waits at most its own timeout;
* a model reload never disturbs running requests: they finish on the engine of the model they
  started on, while new requests start on the new model;
* every request told to ``on_admit`` is told to ``on_finish`` once, after its result is set and
  its engine state dropped (what the allocator's ``MemoryReleaser``,
  :mod:`openbook.serving.allocator`, gives back);
* the policy and the runner are only touched by the decoding thread, or under the line's lock.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from openbook.errors import DeadlineExceeded, Overloaded
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.rag.engine import Outcome, Running
from openbook.rag.errors import Abandoned
from openbook.rag.memory import RequestShape
from openbook.rag.streaming import OnToken, TokenEvent
from openbook.runtime.compute_threads import ComputeThreads
from openbook.serving.batcher import Waiting, WaitingLine, bounded_timeout, resolve
from openbook.types import Passage
from openbook_generator import calibration
from openbook_generator.policy import (
    BatchWork,
    Lateness,
    Request,
    SchedulingOptions,
    SchedulingPolicy,
    Work,
    WorkKind,
)
from openbook_generator.runner import Batch, ModelRunner, RunOutput
from openbook_generator.speed import EngineSpeed

log = logging.getLogger(__name__)

# The policy's names that callers of the engine use (the servicer, the tests).
__all__ = [
    "GenerateItem",
    "Generated",
    "Lateness",
    "Scheduler",
    "SchedulingOptions",
    "StageTimes",
    "WorkKind",
]

Generated = tuple[GenerationResult, str]  # the result and the model version that produced it


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
    # who asks (GenerateRequest.caller): the policy shares the engine out fairly across callers
    caller: str = ""
    # the whole time its caller gave it (the budget header; None: not said): too large for that
    # is TooLarge, too late for what was left when it arrived only Overloaded
    budget_s: float | None = None


@dataclass(eq=False)
class _Admitted:
    """A request taken from the line: the policy's view of it, its batch, and its engine entry
    once added."""

    waiting: Waiting
    request: Request
    batch: Batch
    running: Running | None = None


# Put in a stream's queue once its request is resolved (answered, failed or dropped).
_RESOLVED = object()


class Scheduler(WaitingLine[GenerateItem, Generated]):
    """Continuous batching of generate requests with measured-speed admission: the loop of the
    module docstring.

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
        self.max_wait_s = options.max_wait_ms / 1000.0
        self.policy = SchedulingPolicy(options, fits)
        self.runner = ModelRunner(current, compute)
        self._on_step = on_step
        self._on_running_drop = on_drop
        self._on_admit = on_admit
        self._on_finish = on_finish
        # sized on the decoding thread (torch's OpenMP size is per thread), between two pieces
        # of work; None: the thread keeps torch's default
        self._compute = compute
        # id(waiting) -> the admitted request
        self._running: dict[int, _Admitted] = {}
        self._arrivals = 0
        # run by the decoding thread between two pieces of work (calibration)
        self._jobs: list[Callable[[], None]] = []
        self._start()

    @property
    def options(self) -> SchedulingOptions:
        return self.policy.options

    @property
    def max_batch_size(self) -> int:
        """Requests running at once, over all batches (the policy's; a test may lower it)."""
        return self.policy.options.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, n: int) -> None:
        self.policy.options = replace(self.policy.options, max_batch_size=n)

    @property
    def speed(self) -> EngineSpeed:
        """The engine's speed model, measured by this loop, planned with by the policy."""
        return self.policy.speed

    @property
    def lateness(self) -> Lateness:
        return self.policy.lateness

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def slowdown(self, kind: str) -> float:
        """The measured slowdown of ``kind`` of work (a :class:`WorkKind`, or "scoring":
        speed.py)."""
        with self._cond:
            speed = self.speed
            slowdowns = {
                WorkKind.PREFILL: speed.prefill_slowdown,
                WorkKind.STEP: speed.step_slowdown,
                "scoring": speed.scoring_slowdown,
            }
            return slowdowns[kind].factor

    # ------------------------------------------------------------------ the policy's view

    def _started(self) -> list[Request]:
        """The policy's view of the running requests. Under ``_cond``."""
        return [a.request for a in self._running.values()]

    def _waiting_requests(self) -> list[Request]:
        """The policy's view of the waiting line, in order. Under ``_cond``."""
        return [_request(w) for w in self._waiting]

    # ------------------------------------------------------------------ admission

    def admission(
        self,
        shape: RequestShape,
        options: DecodingOptions,
        time_left_s: float | None,
        caller: str = "",
        budget_s: float | None = None,
    ) -> float:
        """Refuse a request of ``shape`` whose deadline is ``time_left_s`` from now (of the
        ``budget_s`` its caller gave it) if it cannot finish in time
        (:meth:`SchedulingPolicy.admission`): :class:`TooLarge` if not even alone in its whole
        budget, :class:`Overloaded` (with ``retry_after_s``) if not in the time left.
        Returns the seconds it is expected to take before :class:`Lateness` scales them (what
        the lateness of this request is measured against; 0: not estimated)."""
        if time_left_s is None:
            return 0.0
        with self._cond:
            return self.policy.admission(
                shape,
                options,
                time_left_s,
                time.monotonic(),
                self._started(),
                self._waiting_requests(),
                caller,
                budget_s,
            )

    def retry_after_s(self) -> float:
        """How long until a place in the line frees: the shortest remaining work of a running
        request (when it ends, a waiting one moves in)."""
        with self._cond:
            return self.policy.retry_after_s(self._started(), self._waiting_requests())

    def _enqueue(self, payload, timeout_s, on_cancel):
        """Admit ``payload`` (:meth:`admission`, with ``timeout_s`` as its deadline) and put it
        in the line, under one hold of the lock: requests arriving together are each checked
        against the others, never all against the same state (which admitted a crowd that
        could not finish in time)."""
        try:
            with self._cond:
                planned = self.admission(
                    payload.shape, payload.options, timeout_s, payload.caller, payload.budget_s
                )
                admitted = replace(payload, admitted_at=time.monotonic(), planned_s=planned)
                if payload.times is not None:
                    payload.times.admitted_ns = time.time_ns()
                if len(self._waiting) >= self.max_queue:
                    self._make_room(payload.caller)
                return super()._enqueue(admitted, timeout_s, on_cancel)
        except Overloaded as exc:
            if exc.retry_after_s is None:
                exc.retry_after_s = self.retry_after_s()
            raise

    def _make_room(self, caller: str) -> None:
        """The line is full and ``caller`` asks: refuse the waiting request the policy
        displaces for it (another caller's newest, when that caller holds at least two more
        places), with the error a full line gives. Under ``_cond``."""
        lined = list(self._waiting)
        at = self.policy.displaced([_request(w) for w in lined], caller)
        if at is None:
            return  # the line refuses the newcomer
        displaced = lined[at]
        self._waiting.remove(displaced)
        error = Overloaded(
            f"queue full ({self.max_queue} requests waiting, most of them this caller's): "
            "its newest request made room for another caller's; retry later",
            retry_after_s=self.policy.retry_after_s(self._started(), self._waiting_requests()),
        )
        resolve(displaced.future, error)
        self._dropped()

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
        """Measure ``generator``'s speed (:func:`openbook_generator.calibration.measure`) and
        set the policy's shapes from it (:meth:`EngineSpeed.calibrate`). It runs on the
        decoding thread, between two pieces of work, so that it measures the thread (and its
        compute threads) that will do the work; this waits for it."""
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
        self.runner.resize_within(generator)
        measured = calibration.measure(generator)
        with self._cond:
            self.policy.speed.calibrate(measured.prefills, measured.steps)
            self.policy.lateness = Lateness()
        log.info("generator speed at start: %s", self.speed.describe())

    # ------------------------------------------------------------------ the decoding thread

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
                work = self._schedule()
                output = None if work is None else self._execute(work)
                if output is not None:
                    self._update_from_output(output)
                self.runner.forget_idle()
            if output is not None and output.measured:
                now = time.perf_counter()
                with self._cond:
                    if output.kind is WorkKind.STEP:
                        # thorough scoring is work of its own kind (speed.py), not the step's
                        if output.scored_tokens > 0:
                            self.speed.observe_scoring(output.scored_tokens, output.scoring_s)
                        self.speed.observe_step(output.size, now - turn - output.scoring_s)
                    else:
                        self.speed.observe_prefill(output.size, now - turn)
                turn = now

    def _take(self) -> tuple[list[_Admitted], float | None] | None:
        """Waiting requests that may start now, each placed in its batch, and when the thread
        stopped idling if it had nothing to do (None once closed and drained). Blocks while
        nothing runs and nothing waits; when idle, waits ``max_wait_s`` after the first arrival
        so that requests arriving together start together."""
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
            self._drop_given_up()
            self._shed_hopeless()
            self._shed_overdue()
            taken: list[_Admitted] = []
            joining: dict[int, int] = {}  # id(batch) -> rows taken into it now
            shapes = [a.request.shape for a in self._running.values()]
            lined = list(self._waiting)
            # fair across callers (the policy's start order); the order accounts for each
            # request started before the next, as taking them here does
            order = self.policy.start_order(self._started(), [_request(w) for w in lined])
            for at in order:
                if not self.policy.room(len(self._running)):
                    break
                head = lined[at]
                item: GenerateItem = head.payload
                if not self.policy.fits_beside(shapes, item.shape):
                    break  # it starts when enough running requests have finished
                shared = self.policy.joins_shared(item.shape)
                batch = self.runner.place(item.shape.rows, shared, joining)
                if batch is None:
                    break  # the shared batch is full of rows: it joins when some leave
                joining[id(batch)] = joining.get(id(batch), 0) + item.shape.rows
                self._waiting.remove(head)
                if item.times is not None:
                    item.times.started_ns = time.time_ns()
                self._arrivals += 1
                request = _request(head, seq=self._arrivals, solo=batch.solo)
                self.policy.started(request)
                admitted = _Admitted(head, request, batch)
                taken.append(admitted)
                shapes.append(item.shape)
                self._running[id(head)] = admitted
            return taken, woke

    def _drop_given_up(self) -> None:
        """Drop every waiting request whose caller gave up (deadline passed, cancelled): the
        fair order may start any of them next, not only the head. Under ``_cond``."""
        for waiting in [w for w in self._waiting if w.gave_up()]:
            self._waiting.remove(waiting)
            resolve(waiting.future, DeadlineExceeded("deadline passed while queued"))
            self._dropped()

    def _shed_hopeless(self) -> None:
        """Refuse (:class:`Overloaded`, the gateway's 429) every waiting request that can no
        longer finish before its deadline (:meth:`SchedulingPolicy.hopeless`). Under
        ``_cond``."""
        lined = list(self._waiting)
        views = [_request(w) for w in lined]
        by_view = {id(v): w for v, w in zip(views, lined, strict=True)}
        for refusal in self.policy.hopeless(time.monotonic(), self._started(), views):
            waiting = by_view[id(refusal.request)]
            self._waiting.remove(waiting)
            resolve(waiting.future, refusal.error)
            self._dropped()

    def _shed_overdue(self) -> None:
        """Refuse (:class:`Overloaded`, the gateway's 429) every running request that can no
        longer finish before its deadline (:meth:`SchedulingPolicy.overdue`): its caller is
        answered now, and its engine drops it before the next piece of work (its future is
        done: :meth:`Waiting.gave_up`). Under ``_cond``."""
        by_request = {id(a.request): a for a in self._running.values()}
        for refusal in self.policy.overdue(time.monotonic(), self._started()):
            resolve(by_request[id(refusal.request)].waiting.future, refusal.error)

    def _admit(self, admitted: _Admitted) -> None:
        """Add a taken request to its batch's engine (nothing encoded yet)."""
        waiting = admitted.waiting
        item: GenerateItem = waiting.payload
        batch = admitted.batch
        if self._on_admit is not None:
            self._on_admit(item.shape)  # every admitted request reaches _finish: on_finish
        try:
            running = self.runner.add(
                batch,
                item,
                tag=(waiting, batch.generator.model_version),
                gave_up=waiting.gave_up,
                chunk_passages=self.policy.chunk_passages(item.shape),
            )
        except Exception as exc:  # noqa: BLE001 - fails this request only
            log.exception("admitting a request failed")
            self._finish(waiting, exc)
            return
        with self._cond:
            admitted.running = running
            admitted.request.progress = running

    def _schedule(self) -> Work[Batch] | None:
        """The next piece of work, as the policy chooses it from what every batch has to do
        (its requests' engine entries mapped to the policy's requests)."""
        with self._cond:
            by_running = {id(a.running): a for a in self._running.values() if a.running is not None}
            batches = []
            for batch in self.runner.batches:
                engine = batch.engine
                prefilling = [
                    by_running[id(r)].request for r in engine.prefilling if id(r) in by_running
                ]
                decoding = [
                    by_running[id(r)].request
                    for r in engine.requests
                    if r.enc is not None and id(r) in by_running
                ]
                batches.append(BatchWork(batch, prefilling, decoding, engine.pending()))
            return self.policy.choose(
                batches, time.monotonic(), self._started(), self._waiting_requests()
            )

    def _execute(self, work: Work[Batch]) -> RunOutput:
        """Have the runner execute ``work`` (a decoding step is told to ``on_step`` first)."""
        running: Running | None = None
        if work.kind is WorkKind.STEP:
            if self._on_step is not None:
                self._on_step(len(work.batch.engine), self.depth())
        else:
            assert work.request is not None
            progress = work.request.progress  # the engine's entry of the request (_admit)
            assert isinstance(progress, Running)
            running = progress
        return self.runner.execute(work, running)

    def _update_from_output(self, output: RunOutput) -> None:
        """Answer the callers of the requests the piece of work ended: failed, finished, or
        given up by their caller (dropped from the batch)."""
        for waiting, _version in output.failed:
            assert output.error is not None
            self._finish(waiting, output.error)
        self._resolve(output.outcomes)

    def _resolve(self, outcomes: Sequence[Outcome]) -> None:
        for (waiting, version), outcome in outcomes:
            if isinstance(outcome, Abandoned):
                if self._on_running_drop is not None:
                    self._on_running_drop("running", 1)
                self._finish(waiting, DeadlineExceeded("the caller gave up; generation stopped"))
            else:
                self._finish(waiting, (outcome, version))

    def _finish(self, waiting: Waiting, result: object) -> None:
        with self._cond:
            admitted = self._running.pop(id(waiting), None)
            if admitted is not None and not isinstance(result, Exception):
                self.policy.finished(admitted.request, time.monotonic())
        times = waiting.payload.times
        if times is not None:
            times.finished_ns = time.time_ns()
        resolve(waiting.future, result)
        if self._on_finish is not None:
            del admitted  # its caches: what on_finish may give back
            with self._cond:
                idle = not self._running and not self._waiting
            self._on_finish(waiting.payload.shape, idle)


def _request(waiting: Waiting, seq: int = 0, solo: bool = False) -> Request:
    """The policy's view of a request of the line (``seq``, ``solo``: once it starts)."""
    item: GenerateItem = waiting.payload
    return Request(
        item.shape,
        item.options,
        waiting.deadline,
        admitted_at=item.admitted_at,
        planned_s=item.planned_s,
        seq=seq,
        solo=solo,
        caller=item.caller,
    )
