"""How fast the generator works now, measured as it works: the basis of honest admission.

The engine's work comes in three kinds, each timed as it runs (:mod:`openbook_generator.scheduler`):

* **prefill**: encoding prompt tokens (a chunk of a request's passages);
* **decoding steps**: one forward pass over every row of a batch;
* **scoring**: RAG-Sequence thorough's scoring of every finished hypothesis under every
  passage (:func:`openbook.rag.rag_sequence.scoring_tokens`), done by the step at which the
  request finishes. It is timed apart from that step: counted as part of it, the seconds of
  scoring thousands of tokens made one step look hundreds of times slower than its shape, and
  admission then refused most requests until the slowdown faded (docs/benchmarks.md).

The model of each is a *shape* times a *slowdown*::

    seconds = shape(size) x slowdown
    prefill shape: fixed + per_token x tokens    decoding shape: fixed + per_row x rows
    scoring shape: the prefill's, tokens scored (its own slowdown: scoring reads the
                   hypotheses' tokens against every passage's cache, not a prompt)

The shapes are measured once, when the model is loaded (:meth:`Scheduler.calibrate`: a few
prefills and steps of different sizes, fitted by least squares); they say how work grows with
its size, which the machine's load does not change much. The slowdown is what the load changes:
a neighbour taking a core, a CPU quota, fewer compute threads. Each kind has its own, the ratio
of the seconds its recent work took to the seconds its shape predicts for that work::

    slowdown = sum(measured seconds) / sum(shape-predicted seconds)   (recent work)

"Recent" decays with the wall time the work took (:data:`WINDOW_S`): a machine that became
twice as slow is seen within a couple of seconds of work, whatever size of work shows it. A
ratio of sums, not a mean of ratios, because slowness comes in stalls: under a CPU quota most
steps run at full speed and a few wait out the rest of a throttling period, and only the sums
give the rate at which work actually gets done. A millisecond of work moves the sums by a
millisecond: interpreter overhead and timer noise on tiny work barely count. Until some work
has been seen, the sums hold a prior of :data:`PRIOR_S` at the calibrated speed.

(Only the slowdowns adapt: letting the shapes adapt too would let the two drift against each
other, since only their product is observed.)

Thread-safety: observed by the decoding thread, read by admission in request threads; callers
hold the scheduler's lock around both.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

# Seconds of wall time over which measurements fade (e-fold), and the calibrated speed's weight
# in seconds before any work was measured.
WINDOW_S = 2.0
PRIOR_S = 0.5
# Seconds (e-fold) over which an engine that measures no work relaxes back to its calibrated
# speed: a slowdown seen once must not outlive the slowness when nothing runs to correct it.
IDLE_WINDOW_S = 10.0


@dataclass(frozen=True)
class Line:
    """seconds = fixed + per_unit x size."""

    fixed: float
    per_unit: float

    def at(self, size: float) -> float:
        return self.fixed + self.per_unit * size


def fit_line(points: Sequence[tuple[float, float]]) -> Line:
    """Least-squares line through (size, seconds) points, with both terms kept non-negative
    (a negative fixed cost would predict no time for small work)."""
    if not points:
        raise ValueError("fit_line: no points")
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((x - mean_x) ** 2 for x, _ in points)
    if var == 0:
        return Line(0.0, mean_y / max(mean_x, 1.0))
    slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in points) / var)
    fixed = mean_y - slope * mean_x
    if fixed < 0:  # through the origin instead
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        fixed = 0.0
    return Line(fixed, slope)


@dataclass
class Slowdown:
    """Recent measured seconds over shape-predicted seconds (module docstring).

    While no work is measured, the sums relax towards the prior (the calibrated speed) over
    :data:`IDLE_WINDOW_S` of wall time. Without that, one stalled step (a paused VM, a process
    stopped for a minute) made every request look too slow to admit, so none ran, nothing was
    measured, and the generator refused everything for good. Relaxing costs at most one request
    admitted on an old speed: its first piece of work measures the machine again."""

    measured: float = PRIOR_S
    predicted: float = PRIOR_S
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    last: float | None = None  # clock() at the last observation

    @property
    def factor(self) -> float:
        measured, predicted = self._relaxed_at(self.clock())
        return measured / predicted

    def observe(self, predicted: float, seconds: float) -> None:
        if not (seconds > 0 and predicted > 0 and math.isfinite(seconds)):
            return
        now = self.clock()
        # the idle time before this work relaxes the sums; the work's own seconds are measured
        measured_sum, predicted_sum = self._relaxed_at(now - seconds)
        fade = math.exp(-seconds / WINDOW_S)
        self.measured = measured_sum * fade + seconds
        self.predicted = predicted_sum * fade + predicted
        self.last = now

    def _relaxed_at(self, when: float) -> tuple[float, float]:
        """The sums as the idle time from the last observation to ``when`` left them."""
        if self.last is None:
            return self.measured, self.predicted
        keep = math.exp(-max(0.0, when - self.last) / IDLE_WINDOW_S)
        prior = PRIOR_S * (1 - keep)
        return self.measured * keep + prior, self.predicted * keep + prior


@dataclass
class EngineSpeed:
    """Measured speed of one generator's engine (module docstring). ``prefill``/``step`` are the
    shapes (None until measured)."""

    prefill: Line | None = None
    step: Line | None = None
    prefill_slowdown: Slowdown = field(default_factory=Slowdown)
    step_slowdown: Slowdown = field(default_factory=Slowdown)
    scoring_slowdown: Slowdown = field(default_factory=Slowdown)

    @property
    def known(self) -> bool:
        return self.prefill is not None and self.step is not None

    def calibrate(
        self, prefills: Sequence[tuple[float, float]], steps: Sequence[tuple[float, float]]
    ) -> None:
        """Set the shapes from (tokens, seconds) and (rows, seconds) measurements; the
        slowdowns start over (the machine as it is now)."""
        self.prefill = fit_line(prefills)
        self.step = fit_line(steps)
        self.prefill_slowdown, self.step_slowdown = Slowdown(), Slowdown()
        self.scoring_slowdown = Slowdown()

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` prompt tokens now (0 until measured)."""
        if tokens <= 0 or self.prefill is None:
            return 0.0
        return self.prefill.at(tokens) * self.prefill_slowdown.factor

    def step_s(self, rows: float) -> float:
        """Seconds of one decoding step of a batch of ``rows`` rows now (0 until measured)."""
        if self.step is None:
            return 0.0
        return self.step.at(max(1.0, rows)) * self.step_slowdown.factor

    def scoring_s(self, tokens: float) -> float:
        """Seconds to score ``tokens`` hypothesis tokens now (RAG-Sequence thorough; 0 until
        the prefill is measured): the prefill's shape, scoring's own slowdown."""
        if tokens <= 0 or self.prefill is None:
            return 0.0
        return self.prefill.at(tokens) * self.scoring_slowdown.factor

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        if self.prefill is None:
            self.prefill = Line(0.0, seconds / max(1.0, tokens))
        self.prefill_slowdown.observe(self.prefill.at(tokens), seconds)

    def observe_step(self, rows: float, seconds: float) -> None:
        if self.step is None:
            self.step = Line(0.0, seconds / max(1.0, rows))
        self.step_slowdown.observe(self.step.at(max(1.0, rows)), seconds)

    def observe_scoring(self, tokens: float, seconds: float) -> None:
        if self.prefill is None:
            return  # nothing to compare with yet: the prefill is measured first
        self.scoring_slowdown.observe(self.prefill.at(tokens), seconds)

    def describe(self) -> str:
        """The speed in words, for refusals and logs."""
        if not self.known:
            return "speed not measured yet"
        return (
            f"{1000 / self.prefill_s(1000):,.0f} prompt tokens/s, "
            f"{1 / self.step_s(8):,.1f} decoding steps/s at 8 rows"
        )
