"""How fast the generator works now, measured as it works: the basis of honest admission.

The engine's work comes in two kinds, each timed as it runs (:mod:`openbook_generator.scheduler`):

* **prefill**: encoding prompt tokens (a chunk of a request's passages);
* **decoding steps**: one forward pass over every row of a batch.

The model of each is a *shape* times a *level*::

    seconds = shape(size) x exp(level)
    prefill shape: fixed + per_token x tokens    decoding shape: fixed + per_row x rows

The shapes are measured once, when the model is loaded (:meth:`Scheduler.calibrate`: a few
prefills and steps of different sizes, fitted by least squares); they say how work grows with
its size, which the machine's load does not change much. The level is what the load changes:
a neighbour taking a core, a CPU quota, fewer compute threads. Each kind has its own level,
which moves with every piece of that kind of work by a fraction of log(measured / predicted),
so a machine that became twice as slow is seen within a few decoding steps (or prefills),
whatever size of work shows it. The fraction grows with the work's duration up to
:data:`FULL_WEIGHT_S`: a millisecond of work is mostly interpreter overhead and timer noise, and
must not move the prediction of a second of it. (Only the levels adapt: letting the shapes
adapt too would let the two drift against each other, since only their product is observed.)

Thread-safety: observed by the decoding thread, read by admission in request threads; callers
hold the scheduler's lock around both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

# Weight of a new measurement in its level (log scale), for work of FULL_WEIGHT_S or longer
# (shorter work weighs in proportion), and the most one measurement may move the prediction (a
# pause of the process must not make one step look like a new machine).
LEVEL_WEIGHT = 0.2
FULL_WEIGHT_S = 0.02
MAX_LOG_RATIO = math.log(4.0)


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
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / var
    slope = max(slope, 0.0)
    fixed = mean_y - slope * mean_x
    if fixed < 0:  # through the origin instead
        slope = sum(x * y for x, y in points) / sum(x * x for x, _ in points)
        fixed = 0.0
    return Line(fixed, slope)


@dataclass
class EngineSpeed:
    """Measured speed of one generator's engine (module docstring). ``prefill``/``step`` are the
    shapes (None until measured), ``prefill_level``/``step_level`` their levels."""

    prefill: Line | None = None
    step: Line | None = None
    prefill_level: float = 0.0
    step_level: float = 0.0

    @property
    def known(self) -> bool:
        return self.prefill is not None and self.step is not None

    def calibrate(
        self, prefills: Sequence[tuple[float, float]], steps: Sequence[tuple[float, float]]
    ) -> None:
        """Set the shapes from (tokens, seconds) and (rows, seconds) measurements; the levels
        start over at 0 (the machine as it is now)."""
        self.prefill = fit_line(prefills)
        self.step = fit_line(steps)
        self.prefill_level = self.step_level = 0.0

    def prefill_s(self, tokens: float) -> float:
        """Seconds to prefill ``tokens`` prompt tokens now (0 until measured)."""
        if tokens <= 0 or self.prefill is None:
            return 0.0
        return self.prefill.at(tokens) * math.exp(self.prefill_level)

    def step_s(self, rows: float) -> float:
        """Seconds of one decoding step of a batch of ``rows`` rows now (0 until measured)."""
        if self.step is None:
            return 0.0
        return self.step.at(max(1.0, rows)) * math.exp(self.step_level)

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        if self.prefill is None:
            self.prefill = Line(0.0, seconds / max(1.0, tokens))
        self.prefill_level += _move(self.prefill_s(tokens), seconds)

    def observe_step(self, rows: float, seconds: float) -> None:
        if self.step is None:
            self.step = Line(0.0, seconds / max(1.0, rows))
        self.step_level += _move(self.step_s(rows), seconds)

    def describe(self) -> str:
        """The speed in words, for refusals and logs."""
        if not self.known:
            return "speed not measured yet"
        return (
            f"{1000 / self.prefill_s(1000):,.0f} prompt tokens/s, "
            f"{1 / self.step_s(8):,.1f} decoding steps/s at 8 rows"
        )


def _move(predicted: float, seconds: float) -> float:
    """How far one measurement moves a level (module docstring)."""
    if not (seconds > 0 and predicted > 0 and math.isfinite(seconds)):
        return 0.0
    ratio = max(-MAX_LOG_RATIO, min(MAX_LOG_RATIO, math.log(seconds / predicted)))
    return LEVEL_WEIGHT * min(1.0, seconds / FULL_WEIGHT_S) * ratio
