"""Intervals and confidence measures for held-out evaluations.

Every interval here is a percentile bootstrap (Efron & Tibshirani, 1993) with a fixed seed, so
a rerun on the same predictions prints the same numbers. Questions of one article are not
independent (the same passages, the same kind of answer), so :func:`bootstrap_ci` and
:func:`paired_difference_ci` take ``groups``: the bootstrap then resamples whole articles
(a cluster bootstrap), which gives the wider, honest interval when articles differ.

Confidence measures, for predictions with a confidence in [0, 1] and a 0/1 correctness:

* :func:`expected_calibration_error`: sum over equal-width bins of (bin share) x |accuracy of
  the bin - mean confidence of the bin| (Guo et al., 2017), with the bins for a reliability
  diagram;
* :func:`auroc`: the probability that a right answer gets a higher confidence than a wrong one
  (ties count a half; Mann-Whitney U / (n_right x n_wrong));
* :func:`precision_at_coverage`: the accuracy of the most confident ``coverage`` share of the
  answers, the rest abstained on;

and :func:`measure_ci` puts a bootstrap interval on any of them (:func:`paired_measure_ci` on
the difference of two confidences of the same answers).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0


@dataclass(frozen=True)
class Interval:
    """A mean and its 95% interval (same unit as the values averaged)."""

    mean: float
    low: float
    high: float

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high}

    def text(self, scale: float = 1.0, digits: int = 1) -> str:
        f = f"{{:.{digits}f}}"
        return (
            f"{f.format(self.mean * scale)} "
            f"[{f.format(self.low * scale)}, {f.format(self.high * scale)}]"
        )


def _resample_indices(
    n: int, groups: Sequence[str] | None, rng: np.random.Generator
) -> list[np.ndarray]:
    """``BOOTSTRAP_SAMPLES`` index arrays: questions drawn with replacement, or whole groups."""
    if groups is None:
        return [rng.integers(0, n, n) for _ in range(BOOTSTRAP_SAMPLES)]
    labels = sorted(set(groups))
    members = [np.flatnonzero(np.asarray(groups) == g) for g in labels]
    out = []
    for _ in range(BOOTSTRAP_SAMPLES):
        picked = rng.integers(0, len(members), len(members))
        out.append(np.concatenate([members[i] for i in picked]))
    return out


def bootstrap_ci(
    values: Sequence[float] | np.ndarray,
    groups: Sequence[str] | None = None,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """The mean of ``values`` with its 95% percentile-bootstrap interval (by ``groups`` if
    given: module docstring)."""
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        raise ValueError("no values")
    if groups is not None and len(groups) != x.size:
        raise ValueError("groups must label every value")
    rng = np.random.default_rng(seed)
    means = np.array([x[idx].mean() for idx in _resample_indices(x.size, groups, rng)])
    low, high = np.percentile(means, [2.5, 97.5])
    return Interval(float(x.mean()), float(low), float(high))


def paired_difference_ci(
    a: Sequence[float],
    b: Sequence[float],
    groups: Sequence[str] | None = None,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """mean(a - b) over the same questions, with its 95% interval: the paired comparison of
    two systems (much tighter than two separate intervals, since both see the same
    questions)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape:
        raise ValueError(f"paired values of different lengths: {x.size} and {y.size}")
    return bootstrap_ci(x - y, groups, seed)


def measure_ci(
    # called with two float arrays; typed loosely so that measures over sequences fit
    measure: Callable[[Any, Any], float],
    confidence: Sequence[float],
    correct: Sequence[float],
    groups: Sequence[str] | None = None,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """``measure(confidence, correct)`` (e.g. :func:`auroc`) on every answer, with its 95%
    percentile-bootstrap interval (by ``groups`` if given: module docstring). A resample where
    the measure is undefined (nan: all right or all wrong) is left out; the interval is nan
    when every one is."""
    c = np.asarray(confidence, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    if c.size == 0 or c.shape != y.shape:
        raise ValueError("confidence and correct must be non-empty and of the same length")
    if groups is not None and len(groups) != c.size:
        raise ValueError("groups must label every value")
    rng = np.random.default_rng(seed)
    values = np.array([measure(c[idx], y[idx]) for idx in _resample_indices(c.size, groups, rng)])
    values = values[~np.isnan(values)]
    low, high = np.percentile(values, [2.5, 97.5]) if values.size else (np.nan, np.nan)
    return Interval(float(measure(c, y)), float(low), float(high))


def paired_measure_ci(
    measure: Callable[[Any, Any], float],
    confidence_a: Sequence[float],
    confidence_b: Sequence[float],
    correct: Sequence[float],
    groups: Sequence[str] | None = None,
    seed: int = BOOTSTRAP_SEED,
) -> Interval:
    """``measure(a, correct) - measure(b, correct)``: two confidences of the same answers
    compared, with the 95% interval of the difference from one bootstrap of those answers
    (both measured on each resample, so what the answers share cancels out)."""
    a = np.asarray(confidence_a, dtype=np.float64)
    b = np.asarray(confidence_b, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    if a.size == 0 or a.shape != b.shape or a.shape != y.shape:
        raise ValueError("confidences and correct must be non-empty and of the same length")
    if groups is not None and len(groups) != a.size:
        raise ValueError("groups must label every value")
    rng = np.random.default_rng(seed)
    diffs = np.array(
        [
            measure(a[idx], y[idx]) - measure(b[idx], y[idx])
            for idx in _resample_indices(a.size, groups, rng)
        ]
    )
    diffs = diffs[~np.isnan(diffs)]
    low, high = np.percentile(diffs, [2.5, 97.5]) if diffs.size else (np.nan, np.nan)
    return Interval(float(measure(a, y) - measure(b, y)), float(low), float(high))


@dataclass(frozen=True)
class CalibrationBin:
    low: float
    high: float
    count: int
    confidence: float  # mean confidence in the bin (nan when empty)
    accuracy: float  # share correct in the bin (nan when empty)


def reliability_bins(
    confidence: Sequence[float], correct: Sequence[float], bins: int = 10
) -> list[CalibrationBin]:
    """Equal-width bins over [0, 1] (the last one closed), with each bin's mean confidence and
    accuracy."""
    c = np.asarray(confidence, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    if c.shape != y.shape:
        raise ValueError("confidence and correct must have the same length")
    if c.size and (c.min() < 0 or c.max() > 1):
        raise ValueError("confidence must lie in [0, 1]")
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.searchsorted(edges, c, side="right") - 1, 0, bins - 1)
    out = []
    for b in range(bins):
        mask = which == b
        n = int(mask.sum())
        out.append(
            CalibrationBin(
                float(edges[b]),
                float(edges[b + 1]),
                n,
                float(c[mask].mean()) if n else float("nan"),
                float(y[mask].mean()) if n else float("nan"),
            )
        )
    return out


def expected_calibration_error(
    confidence: Sequence[float], correct: Sequence[float], bins: int = 10
) -> float:
    """ECE over ``bins`` equal-width bins (module docstring); 0 is perfectly calibrated."""
    n = len(confidence)
    if n == 0:
        raise ValueError("no predictions")
    return float(
        sum(
            b.count / n * abs(b.accuracy - b.confidence)
            for b in reliability_bins(confidence, correct, bins)
            if b.count
        )
    )


def auroc(confidence: Sequence[float], correct: Sequence[float]) -> float:
    """P(confidence of a right answer > that of a wrong one), ties a half; nan when all
    answers are right or all wrong."""
    c = np.asarray(confidence, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64) > 0.5
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(c, kind="mergesort")
    ranks = np.empty(c.size, dtype=np.float64)
    sorted_c = c[order]
    # average ranks over ties (1-based)
    i = 0
    while i < c.size:
        j = i
        while j + 1 < c.size and sorted_c[j + 1] == sorted_c[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def precision_at_coverage(
    confidence: Sequence[float], correct: Sequence[float], coverage: float
) -> float:
    """Mean correctness of the ``coverage`` share (0 < coverage <= 1) of answers with the
    highest confidence (ties broken by order, stable)."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    c = np.asarray(confidence, dtype=np.float64)
    y = np.asarray(correct, dtype=np.float64)
    if c.size == 0:
        raise ValueError("no predictions")
    keep = max(1, int(round(coverage * c.size)))
    order = np.argsort(-c, kind="mergesort")[:keep]
    return float(y[order].mean())


def threshold_for_coverage(confidence: Sequence[float], coverage: float) -> float:
    """The confidence threshold that keeps about ``coverage`` of these answers (a
    ``min_confidence`` to configure)."""
    c = np.sort(np.asarray(confidence, dtype=np.float64))[::-1]
    keep = max(1, int(round(coverage * c.size)))
    return float(c[keep - 1])
