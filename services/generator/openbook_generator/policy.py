"""The generator's scheduling policy: what is refused, what starts, which piece of work runs next.

The engine of the generator is three parts (as vLLM v1's ``EngineCore.step()``: the scheduler's
``schedule()``, the model runner's ``execute_model()``, then ``update_from_output()``):

* **this policy**, pure: no model, no engine, no thread, no lock, no clock of its own (``now`` is
  given). It decides over typed requests (:class:`Request`) and what the loop tells it of each
  batch (:class:`BatchWork`), so it is tested alone (``tests/services/test_generator_policy.py``);
* the model runner (:mod:`openbook_generator.runner`), which executes the piece of work chosen;
* the loop (:mod:`openbook_generator.scheduler`), which owns the line, the decoding thread, the
  speed measurement and calibration, and joins the two.

**Pieces of work** (:class:`WorkKind`). Between any two the loop starts waiting requests (while
the running requests are fewer than ``max_batch_size`` and their estimated memory together stays
within the budget, ``fits``), then runs ONE piece:

* a **prefill chunk** of one started request: ``chunk_tokens`` prompt tokens at most, whole
  passages (:meth:`SchedulingPolicy.chunk_passages`), so a k=100 prompt is prefilled in many
  chunks, not in one pause of everything else;
* or one **decoding step** of one batch, which answers every request that finished at it.

**Solo batches.** Requests of up to ``solo_rows`` decoder rows (passages x beams) share one
batch per model (:meth:`SchedulingPolicy.joins_shared`), so that a short answer never waits for
a whole batch to end; a larger request decodes in a batch of its own, so that its rows do not
make every step of the small requests slow.

**Least attained service** (:meth:`SchedulingPolicy.choose`): the next piece is the work of the
request that has had the least engine time so far (a step counts for its batch's least-served
request). A request that just arrived goes first, so a default question is answered in about
the time it takes alone even while a k=100 request runs, and the large request runs in the gaps.
So that the large request still finishes in time, a request whose deadline comes near (its
estimated remaining work would take more than half of the time it has left) gets every other
piece of work, and all of them once its remaining work fills the time left.

**Fair share across callers** (:meth:`SchedulingPolicy.start_order`): a request names its
caller (``Request.caller``: the gateway's API key name; "" every anonymous caller, one class).
Waiting requests start in this order: the caller with the fewest requests running first;
among callers with as many, the one that started a request least recently (round robin), then
the one whose oldest waiting request came first; first come first served within a caller. So a
key that floods the line with 20 requests and a key with one: the one starts at the next free
place, not behind the 20 (issue 43: one key's flood does not take the service from the
others). A full line makes room for a caller holding fewer of its places
(:meth:`SchedulingPolicy.displaced`): the newest waiting request of the caller holding the most
is refused (the gateway's 429) instead of the newcomer. Admission counts, as work due before a
request, only the waiting requests that start before it in this order.

**Admission by measured speed** (:meth:`SchedulingPolicy.admission`): every request's remaining
work is estimated from the speed model (:mod:`openbook_generator.speed`: its prefill tokens, its
share of the steps of its batch for the tokens it is expected to decode). A request is refused
at once (:class:`~openbook.errors.Overloaded`, the gateway's 429) when the work due before its
deadline (that of every request with an earlier deadline, and its own) would not fit in the time
it has, or when it would push an admitted request past its deadline; its ``Retry-After`` is how
long that work takes to drain. One that could not finish in time even alone (at the worst case
of its ``max_new_tokens``) is refused with :class:`~openbook.errors.TooLarge` (the gateway's
413), saying what to lower. Every plan is scaled by :class:`Lateness` (the late tail of taken /
planned); a waiting request that can no longer make its deadline (the engine slowed down after
it was admitted) is refused instead of started (:meth:`SchedulingPolicy.hopeless`), and a
running one that can no longer make it even with its batch to itself is given up with the same
429 while its caller can still be told (:meth:`SchedulingPolicy.overdue`): its result would be a
504 anyway, and the rest of its work is taken from the requests that can still finish.

Invariants:

* every decision is a function of its arguments, the speed model, :class:`Lateness` and the
  policy's three pieces of state (the urgent turn, the share of ``max_new_tokens`` answers use,
  when each caller last started a request), which only :meth:`~SchedulingPolicy.choose`,
  :meth:`~SchedulingPolicy.finished` and :meth:`~SchedulingPolicy.started` change;
* nothing measured yet (``speed.known`` false): nothing is refused and nothing is urgent;
* a request alone always may start (:meth:`~SchedulingPolicy.fits_beside`): admission already
  refused what can never fit;
* the caller holds whatever lock guards the requests it passes (the loop's);
* one caller alone (every request the same ``caller``) is served exactly as without fair
  share: the start order is the line's order, nothing is displaced;
* no waiting request starves: its caller is passed over only by callers with fewer requests
  running, or as many and a less recent start; each start puts its caller behind the others
  in the round robin and running requests are at most ``max_batch_size``, so finitely many
  start before it; a request that does not fit yet holds its place (nothing behind it
  starts instead).
"""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from openbook.errors import Overloaded, TooLarge
from openbook.rag.memory import RequestShape
from openbook.rag.options import DecodingOptions
from openbook.rag.rag_sequence import scoring_tokens
from openbook_generator.speed import EngineSpeed

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
# Seconds (e-fold) over which the lateness relaxes back to 1 while no tight request finishes:
# a few of the longest plans that count (a quarter of the generator's 300 s deadline cap).
LATENESS_RELAX_S = 60.0
# Callers whose last start the round robin remembers (API keys; more only from a client of the
# generator's gRPC naming many): past it, the least recent is forgotten.
MAX_CALLERS_REMEMBERED = 4096


class WorkKind(StrEnum):
    """A piece of work of the decoding thread (a string too: the metrics' ``kind`` label)."""

    PREFILL = "prefill"  # one chunk of one request's prompt
    STEP = "step"  # one decoding step of one batch


@dataclass(frozen=True)
class SchedulingOptions:
    """How the decoding thread batches and orders work (the module docstring)."""

    max_batch_size: int = 8  # requests admitted at once, over all batches
    max_wait_ms: float = 5.0  # an idle engine waits this long for requests arriving together
    max_queue: int = 32
    solo_rows: int = 16  # requests with more decoder rows decode in a batch of their own
    chunk_tokens: int = 1024  # prompt tokens per prefill chunk (whole passages; one at least)


class Progress(Protocol):
    """What the engine tells of a started request (:class:`openbook.rag.engine.Running`)."""

    @property
    def cost_s(self) -> float:
        """Engine seconds it was charged so far: its attained service."""

    @property
    def steps(self) -> int:
        """Decoding steps its rows took part in."""

    @property
    def prefilled(self) -> int:
        """Passages of its prompt encoded so far."""


@dataclass(eq=False)
class Request:
    """A generate request as the policy sees it: waiting (``progress`` None, ``seq`` 0) or
    started (in a batch, ``solo`` or shared; ``progress`` once its batch's engine holds it)."""

    shape: RequestShape
    options: DecodingOptions
    deadline: float | None  # time.monotonic(); None: none
    admitted_at: float = 0.0  # when it entered the line
    planned_s: float = 0.0  # admission's plan for it, before lateness scaled it (0: none)
    seq: int = 0  # arrival order among started requests, the tie-break of equal service
    solo: bool = False  # decodes in a batch of its own
    progress: Progress | None = None
    caller: str = ""  # its fair-share class: an API key name; "": the anonymous callers


B = TypeVar("B")


@dataclass(frozen=True)
class BatchWork(Generic[B]):
    """What one batch (``batch``, opaque to the policy) has to do: its requests with prompt
    chunks left (first added first), those whose rows decode, and whether a decoding step has
    work (rows to decode, answers to return, a request given up to drop)."""

    batch: B
    prefilling: Sequence[Request]
    decoding: Sequence[Request]
    steppable: bool


@dataclass(frozen=True)
class Work(Generic[B]):
    """The piece of work chosen: a prefill chunk of ``request``, or a step of ``batch``."""

    kind: WorkKind
    batch: B
    request: Request | None = None


@dataclass(frozen=True)
class Refusal:
    """A waiting request that can no longer finish in time, and what to tell its caller."""

    request: Request
    error: Overloaded


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
    samples the quantile is their maximum.

    While no tight request finishes, what it says relaxes back to 1 (:meth:`at`, e-fold
    :data:`LATENESS_RELAX_S` from the last one). Without that, a late spell (a starved CPU, a
    crowd) could leave it high for good: a lateness L refuses every request planned to fill
    more than 0.8 / L of its time, so at L >= 3.2 no tight request is admitted, none finishes
    to teach otherwise, and the generator refuses those requests on an idle machine. Relaxing
    costs at most one tight request admitted on an older lateness: its finish measures again."""

    def __init__(self) -> None:
        self.ratios: deque[float] = deque(maxlen=LATENESS_SAMPLES)
        self.last: float | None = None  # ``now`` of the latest tight request's finish

    @property
    def factor(self) -> float:
        """The quantile of the kept ratios, unrelaxed (what :meth:`at` relaxes)."""
        if not self.ratios:
            return 1.0
        ordered = sorted(self.ratios)
        at = min(len(ordered) - 1, math.ceil(LATENESS_QUANTILE * len(ordered)) - 1)
        return max(1.0, ordered[at])

    def at(self, now: float) -> float:
        """The factor plans are scaled by at ``now``: :attr:`factor`, relaxed towards 1 by the
        time since the latest tight request finished."""
        factor = self.factor
        if self.last is None or factor == 1.0:
            return factor
        keep = math.exp(-max(0.0, now - self.last) / LATENESS_RELAX_S)
        return 1.0 + (factor - 1.0) * keep

    def observe(self, planned_s: float, taken_s: float, time_left_s: float, now: float) -> None:
        """A request planned to take ``planned_s`` (before scaling) of the ``time_left_s`` it
        had took ``taken_s``, finishing at ``now``."""
        if planned_s > 0 and planned_s >= LATENESS_TIGHT_SHARE * time_left_s:
            self.ratios.append(taken_s / planned_s)
            self.last = now


Priority = tuple[int, float, float, int]  # (urgency, deadline, attained service, arrival)


class SchedulingPolicy:
    """The decisions of the module docstring over :class:`Request` s.

    ``fits(shapes)`` says whether requests of those shapes may run together (the memory
    budget). ``speed`` is the engine's speed model, which the loop measures and calibrates;
    ``lateness`` scales every plan (the loop may replace it, e.g. after a calibration)."""

    def __init__(
        self,
        options: SchedulingOptions,
        fits: Callable[[list[RequestShape]], bool],
        speed: EngineSpeed | None = None,
    ) -> None:
        self.options = options
        self._fits = fits
        self.speed = speed if speed is not None else EngineSpeed()
        self.lateness = Lateness()
        # running estimate of the share of max_new_tokens answers use
        self.steps_share = INITIAL_STEPS_SHARE
        self._urgent_turn = False  # urgent requests get every other piece of work
        # caller -> the start (a count of starts) at which it last started a request: the
        # round robin among callers with as many requests running
        self._starts = 0
        self._last_started: dict[str, int] = {}

    # ------------------------------------------------------------------ admission

    def admission(
        self,
        shape: RequestShape,
        options: DecodingOptions,
        time_left_s: float | None,
        now: float,
        running: Sequence[Request],
        waiting: Sequence[Request],
        caller: str = "",
        budget_s: float | None = None,
    ) -> float:
        """Refuse a request of ``caller`` of ``shape`` whose deadline is ``time_left_s`` after
        ``now`` if it cannot finish in time beside ``running`` and ``waiting``:
        :class:`TooLarge` if not even alone in the whole time its caller gave it
        (``budget_s``, where the caller said; else the time left), :class:`Overloaded` (with
        ``retry_after_s``) if not in the time left now — alone, when the time went before the
        request got here, or behind the work already here (the running requests', and that of
        the waiting ones that start before it: :meth:`start_order`). Returns the seconds it is
        expected to take before :class:`Lateness` scales them (what its lateness is measured
        against; 0: not estimated)."""
        if time_left_s is None or not self.speed.known:
            return 0.0  # no deadline, or nothing measured yet: nothing to refuse on
        allowed = time_left_s * DEADLINE_SHARE
        whole_s = max(time_left_s, budget_s or 0.0)
        lateness = self.lateness.at(now)
        joins_shared = self.joins_shared(shape)
        alone = lateness * self.work_s(shape, options, shape.rows, 0, worst=True)
        if alone > whole_s * DEADLINE_SHARE:
            raise TooLarge(
                f"this request would take about {alone:.0f}s of generation at the speed "
                f"measured now ({self.speed.describe()}; {shape.passages} passages x "
                f"{shape.beams} beams, {shape.input_tokens} prompt tokens, up to "
                f"{shape.new_tokens} new tokens) and its deadline allows {whole_s:.0f}s: "
                "use fewer passages (k), beams or new tokens"
            )
        if alone > allowed:  # it fits its deadline, but the time went before it got here
            raise Overloaded(
                f"this request needs about {alone:.1f}s of generation at the speed measured "
                f"now ({self.speed.describe()}) and only {time_left_s:.1f}s of the "
                f"{whole_s:.0f}s its deadline allows were left when it reached the generator: "
                "retry",
                retry_after_s=1.0,
            )
        # the shared batch as it would be with this request in it
        shared = self.shared_batch_rows(running, waiting, shape if joins_shared else None)
        rows = shared if joins_shared else shape.rows
        mine = lateness * self.work_s(shape, options, rows, 0)
        deadline = now + time_left_s
        work = [(d, lateness * w) for d, w in self._work_ahead(running, waiting, shared)]
        # what starts before it: every running request, and the waiting ones of callers with
        # fewer started (a flood of another key, waiting behind it, is not due before it)
        newcomer = Request(shape, options, deadline, caller=caller)
        order = self.start_order(running, [*waiting, newcomer])
        before = set(order[: order.index(len(waiting))])
        ahead = work[: len(running)] + [work[len(running) + i] for i in sorted(before)]
        due = sum(w for d, w in ahead if d <= deadline) + mine
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

    def retry_after_s(self, running: Sequence[Request], waiting: Sequence[Request]) -> float:
        """How long until a place in the line frees: the shortest remaining work of a running
        request (when it ends, a waiting one moves in)."""
        shared = self.shared_batch_rows(running, waiting)
        return min((self.remaining_s(r, shared) for r in running), default=1.0)

    def hopeless(
        self, now: float, running: Sequence[Request], waiting: Sequence[Request]
    ) -> list[Refusal]:
        """The waiting requests (in line order) that can no longer finish before their deadline
        at the speed measured now: the engine slowed down after they were admitted (a neighbour
        took the CPU, a crowd arrived). Their callers are told at once (the gateway's 429),
        with the time the work ahead takes as the retry-after, instead of starting work that
        runs into the deadline (a 504). Same model as :meth:`admission`: the work of the
        running requests and of those that start before it (:meth:`start_order`), then its
        own, one after the other,
        scaled by the lateness, with a margin of :data:`SHED_MARGIN_SHARE` of its time; a
        refused request is no longer ahead of the next."""
        if not waiting or not self.speed.known:
            return []
        lateness = self.lateness.at(now)
        shared = self.shared_batch_rows(running, waiting)
        ahead = lateness * sum(self.remaining_s(r, shared) for r in running)
        refused = []
        for request in (waiting[i] for i in self.start_order(running, waiting)):
            mine = lateness * self.waiting_work_s(request, shared)
            if request.deadline is None:
                ahead += mine
                continue
            if now + ahead + mine <= _reply_by(request):
                ahead += mine
                continue
            error = Overloaded(
                f"the generator slowed down after this request was admitted "
                f"({self.speed.describe()}): the work ahead of it would take about "
                f"{ahead:.1f}s and it needs {mine:.1f}s more, past its deadline; "
                f"retry in {math.ceil(ahead)}s",
                retry_after_s=ahead,
            )
            refused.append(Refusal(request, error))
        return refused

    def overdue(self, now: float, running: Sequence[Request]) -> list[Refusal]:
        """The running requests that can no longer finish before their deadline: even if the
        engine ran nothing but its own rows from ``now`` on at the speed measured now, unscaled
        by :class:`Lateness` (a lower bound of when it ends: the other rows of its batch, other
        batches and prefill chunks only add to it), it would end later than
        :data:`SHED_MARGIN_SHARE` of its whole time before its deadline: the margin in which a
        reply still reaches its caller in time (the same margin as :meth:`hopeless`). Its result
        would come too late to be an answer (a 504); giving it up tells its caller at once (a
        429, retry after the other running work: :meth:`retry_after_s`) and gives the rest of
        its work to requests that can still finish."""
        if not running or not self.speed.known:
            return []
        late = []
        for request in running:
            if request.deadline is None or request.progress is None:
                continue
            alone = self.remaining_s(replace(request, solo=True), request.shape.rows)
            if now + alone > _reply_by(request):
                late.append(request)
        if not late:
            return []
        retry = self.retry_after_s([r for r in running if r not in late], [])
        message = (
            f"the generator slowed down while this request ran ({self.speed.describe()}): "
            f"it could not finish before its deadline and was stopped; retry in "
            f"{math.ceil(retry)}s"
        )
        return [Refusal(r, Overloaded(message, retry_after_s=retry)) for r in late]

    # ------------------------------------------------------------------ fair share

    def start_order(self, running: Sequence[Request], waiting: Sequence[Request]) -> list[int]:
        """The positions in ``waiting`` (the line, in arrival order) in the order they are to
        start, fair across callers (module docstring): each next one is the oldest waiting
        request of the caller with the fewest requests running, counting those placed before
        it in this order; ties go to the caller that started one least recently (those placed
        count as started), then to the caller whose oldest waiting request came first. One
        caller alone: the line's order."""
        started = Counter(r.caller for r in running)
        last = dict(self._last_started)
        starts = self._starts
        lines: dict[str, deque[int]] = {}
        for at, request in enumerate(waiting):
            lines.setdefault(request.caller, deque()).append(at)
        order: list[int] = []
        while lines:
            caller = min(lines, key=lambda c: (started[c], last.get(c, -1), lines[c][0]))
            line = lines[caller]
            order.append(line.popleft())
            started[caller] += 1
            starts += 1
            last[caller] = starts
            if not line:
                del lines[caller]
        return order

    def last_started(self, caller: str) -> int | None:
        """When ``caller`` last started a request, counted in starts (None: never, or no
        longer remembered): its place in the round robin."""
        return self._last_started.get(caller)

    def started(self, request: Request) -> None:
        """``request`` started: its caller goes to the end of the round robin."""
        self._starts += 1
        self._last_started.pop(request.caller, None)  # kept in order of last start
        self._last_started[request.caller] = self._starts
        if len(self._last_started) > MAX_CALLERS_REMEMBERED:
            # the caller that started least recently is forgotten: it goes first again,
            # as a caller never seen does
            del self._last_started[next(iter(self._last_started))]

    def displaced(self, waiting: Sequence[Request], caller: str) -> int | None:
        """When the line is full and a request of ``caller`` comes: the position in
        ``waiting`` of the request refused to make room for it, the newest of the caller
        holding the most places, if that caller holds at least two more than ``caller`` (so
        that the two never trade places back and forth); None: the newcomer is refused, as
        when one caller fills the line."""
        held = Counter(r.caller for r in waiting)
        if not held:
            return None
        most, count = max(held.items(), key=lambda item: item[1])
        if most == caller or count < held[caller] + 2:
            return None
        return max(at for at, r in enumerate(waiting) if r.caller == most)

    # ------------------------------------------------------------------ starting requests

    def room(self, started: int) -> bool:
        """Whether one more request may start when ``started`` run (``max_batch_size``)."""
        return started < self.options.max_batch_size

    def fits_beside(self, started: Sequence[RequestShape], shape: RequestShape) -> bool:
        """Whether a request of ``shape`` may start beside the ``started`` ones (the memory
        budget); alone it always may."""
        return not started or self._fits([*started, shape])

    def joins_shared(self, shape: RequestShape) -> bool:
        """Whether a request of ``shape`` decodes in its model's shared batch (at most
        ``solo_rows`` rows) rather than in a batch of its own."""
        return shape.rows <= self.options.solo_rows

    def chunk_passages(self, shape: RequestShape) -> int:
        """Passages per prefill chunk of a request of ``shape``: ``chunk_tokens`` of its
        longest passage input, one at least (chunked prefill)."""
        return max(1, self.options.chunk_tokens // max(1, shape.prompt_tokens))

    # ------------------------------------------------------------------ ordering

    def choose(
        self,
        batches: Sequence[BatchWork[B]],
        now: float,
        running: Sequence[Request],
        waiting: Sequence[Request],
    ) -> Work[B] | None:
        """The next piece of work: a prefill chunk of a request or a decoding step of a batch,
        least attained service first; an urgent request (module docstring) every other time,
        or always once it is critical. None: nothing to do."""
        shared = self.shared_batch_rows(running, waiting)
        candidates: list[tuple[Priority, Work[B]]] = []
        for b in batches:
            for request in b.prefilling:
                key = self.priority(request, now, shared)
                candidates.append((key, Work(WorkKind.PREFILL, b.batch, request)))
            if b.steppable:
                keys = [self.priority(r, now, shared) for r in b.decoding]
                candidates.append(
                    (min(keys, default=(0, 0.0, 0.0, 0)), Work(WorkKind.STEP, b.batch))
                )
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

    def priority(self, request: Request, now: float, shared: int) -> Priority:
        """(urgency, deadline, attained service, arrival): urgency 0 when the remaining work
        fills the time left (critical), 1 when it fills half of it, 2 otherwise."""
        deadline = request.deadline
        urgency = 2
        if deadline is not None and self.speed.known:
            left = (deadline - now) * DEADLINE_SHARE
            remaining = self.lateness.at(now) * self.remaining_s(request, shared)
            if remaining >= left:
                urgency = 0
            elif 2 * remaining >= left:
                urgency = 1
        service = 0.0 if request.progress is None else request.progress.cost_s
        return (urgency, deadline or math.inf, service, request.seq)

    # ------------------------------------------------------------------ learning

    def finished(self, request: Request, now: float) -> None:
        """``request`` was answered at ``now``: learn the share of ``max_new_tokens`` answers
        use, and how late it was against its plan (a failed request teaches nothing)."""
        if request.progress is None:
            return
        used = request.progress.steps / max(1, request.options.max_new_tokens)
        self.steps_share += STEPS_WEIGHT * (min(1.0, used) - self.steps_share)
        if request.deadline is not None:
            self.lateness.observe(
                request.planned_s,
                now - request.admitted_at,
                request.deadline - request.admitted_at,
                now,
            )

    # ------------------------------------------------------------------ estimates

    def shared_batch_rows(
        self,
        running: Sequence[Request],
        waiting: Sequence[Request],
        joining: RequestShape | None = None,
    ) -> int:
        """Rows the shared batch is expected to decode while the work here (and ``joining``)
        is done: as many of its requests at once as ``max_batch_size`` lets run, of their mean
        rows."""
        rows = [r.shape.rows for r in running if not r.solo]
        rows += [w.shape.rows for w in waiting if self.joins_shared(w.shape)]
        if joining is not None:
            rows.append(joining.rows)
        if not rows:
            return 1
        together = min(len(rows), self.options.max_batch_size)
        return max(1, round(sum(rows) / len(rows) * together))

    def _work_ahead(
        self, running: Sequence[Request], waiting: Sequence[Request], shared: int
    ) -> list[tuple[float, float]]:
        """(deadline, estimated remaining seconds) of every request running or waiting, when
        the shared batch decodes ``shared`` rows; a request with no deadline counts as due at
        the end of time."""
        out = [(_deadline(r), self.remaining_s(r, shared)) for r in running]
        out += [(_deadline(w), self.waiting_work_s(w, shared)) for w in waiting]
        return out

    def waiting_work_s(self, request: Request, shared: int) -> float:
        """Estimated engine seconds of a waiting request once started: in a batch of its own
        if it is large, else in the shared batch of ``shared`` rows."""
        rows = shared if self.joins_shared(request.shape) else request.shape.rows
        return self.work_s(request.shape, request.options, rows, 0)

    def remaining_s(self, request: Request, shared: int) -> float:
        """Estimated engine seconds left of a started request (of all of it before its batch's
        engine holds it), its batch decoding ``shared`` rows unless it is solo."""
        shape = request.shape
        rows = shape.rows if request.solo else max(shared, shape.rows)
        progress = request.progress
        if progress is None:
            return self.work_s(shape, request.options, rows, 0)
        prefilled = progress.prefilled / max(1, shape.passages)
        return self.work_s(shape, request.options, rows, progress.steps, prefilled_share=prefilled)

    def expected_steps(self, options: DecodingOptions, worst: bool) -> int:
        """Decoding steps a request is expected to take (at most ``max_new_tokens``)."""
        if worst:
            return options.max_new_tokens
        expected = math.ceil(self.steps_share * options.max_new_tokens)
        return max(options.min_new_tokens, min(options.max_new_tokens, max(1, expected)))

    def work_s(
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
        # chunks by the prompt tokens (passages are chunked by them), each priced by the
        # tokens it computes: those a passage cache holds are not (what the speed model is
        # told of a prefill too: runner.py)
        left = 1.0 - prefilled_share
        tokens_left = shape.input_tokens * left
        computed_left = max(0, shape.input_tokens - shape.cached_tokens) * left
        chunks = max(1, math.ceil(tokens_left / max(1, self.options.chunk_tokens)))
        prefill = chunks * speed.prefill_s(computed_left / chunks) if tokens_left > 0 else 0.0
        batch_rows = max(rows, batch_rows)
        steps = max(1, self.expected_steps(options, worst) - steps_done)
        decode = steps * speed.step_s(batch_rows) * rows / batch_rows
        scoring = 0.0
        if options.mode == "rag-sequence-thorough":  # every hypothesis under every passage
            # padded to the longest hypothesis, which one long beam makes max_new_tokens: at
            # the expected answer length the scoring, one piece at the request's end that
            # nothing can interrupt, was planned short and ran a crowd past its deadline
            longest = options.max_new_tokens
            scoring = speed.scoring_s(scoring_tokens(rows, shape.passages, longest))
        return prefill + decode + scoring


def _reply_by(request: Request) -> float:
    """When a request's result must be ready for its reply to reach the caller in time: its
    deadline less :data:`SHED_MARGIN_SHARE` of its whole time (admission to deadline)."""
    assert request.deadline is not None
    return request.deadline - SHED_MARGIN_SHARE * (request.deadline - request.admitted_at)


def _deadline(request: Request) -> float:
    return math.inf if request.deadline is None else request.deadline
