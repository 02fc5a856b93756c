"""Fitting confidence calibrations: the trainer's half of :mod:`openbook.rag.confidence`.

The core library keeps what a serving model needs: the features of an answer, the two kinds of
calibration file and how to apply them. Fitting them is an offline job (``openbook eval
--fit-calibration``, ``openbook experiments trust``), done here with scikit-learn, which only
the trainer installs:

* :func:`fit_calibration`: a piecewise-linear (``"piecewise-linear"``) calibration of raw
  confidence, by isotonic regression (``sklearn.isotonic.IsotonicRegression``): the
  non-decreasing step function closest to the outcomes in squared error. Its knots are the
  first and last raw value of each constant block, so the map is flat within a block and linear
  between blocks.
* :func:`fit_logistic_calibration`: a ``"logistic"`` calibration over named features, by
  L2-penalised logistic regression (``sklearn.linear_model.LogisticRegression(C=1/l2)``,
  the bias unpenalised). Outcomes may be scores in [0, 1]: each row is then fitted as a right
  answer of weight ``y`` and a wrong one of weight ``1 - y``, the same loss.

The files they write are those :func:`openbook.rag.confidence.load_calibration` reads.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.isotonic import IsotonicRegression
from sklearn.linear_model import LogisticRegression

from openbook.rag.confidence import DEFAULT_FEATURES, FEATURES, Calibration, LogisticCalibration


def fit_calibration(raw: Sequence[float], correct: Sequence[bool | float]) -> Calibration:
    """Isotonic regression of ``correct`` (1/0, or a score in [0, 1]) on ``raw`` confidence
    (module docstring); equal raw values are pooled into one point.

    Raises ``ValueError`` for empty or mismatched inputs or values outside [0, 1]."""
    xs = np.asarray(raw, dtype=np.float64)
    ys = np.asarray(correct, dtype=np.float64)
    if xs.ndim != 1 or xs.shape != ys.shape or xs.size == 0:
        raise ValueError("raw and correct must be non-empty sequences of the same length")
    for name, values in (("raw", xs), ("correct", ys)):
        if not np.all(np.isfinite(values)) or values.min() < 0 or values.max() > 1:
            raise ValueError(f"{name} must hold numbers in [0, 1]")
    fitted = IsotonicRegression(y_min=0.0, y_max=1.0, out_of_bounds="clip").fit(xs, ys)
    # The thresholds keep only the ends of each constant block: exactly the knots.
    kx = tuple(float(x) for x in fitted.X_thresholds_)
    ky = tuple(min(1.0, max(0.0, float(y))) for y in fitted.y_thresholds_)
    calibration = Calibration(kx, ky, int(xs.size))
    calibration.validate()
    return calibration


def fit_logistic_calibration(
    feature_rows: Sequence[Mapping[str, float]],
    correct: Sequence[bool | float],
    features: Sequence[str] = DEFAULT_FEATURES,
    l2: float = 1.0,
    fitted_on: Mapping[str, Any] | None = None,
) -> LogisticCalibration:
    """The logistic calibration over the named ``features`` of each row (:data:`FEATURES`),
    fitted by :func:`fit_logistic` to ``correct`` (1/0, or a score in [0, 1]). ``fitted_on``:
    provenance stored with it (default: the number of rows).

    Raises ``ValueError`` for an unknown feature, a row without a feature, and whatever
    :func:`fit_logistic` refuses."""
    names = tuple(features)
    for name in names:
        if name not in FEATURES:
            raise ValueError(f"unknown feature {name!r}: one of {', '.join(FEATURES)}")
    if len(feature_rows) != len(correct):
        raise ValueError("feature_rows and correct must be non-empty and of the same length")
    try:
        x = np.array([[float(row[n]) for n in names] for row in feature_rows], dtype=np.float64)
    except KeyError as e:
        raise ValueError(f"a feature row has no {e.args[0]!r}") from None
    bias, weights = fit_logistic(x.reshape(len(feature_rows), len(names)), correct, l2)
    provenance = dict(fitted_on) if fitted_on is not None else {"questions": len(correct)}
    calibration = LogisticCalibration(names, tuple(weights), bias, provenance)
    calibration.validate()
    return calibration


def fit_logistic(
    x: np.ndarray, correct: Sequence[bool | float], l2: float = 1.0
) -> tuple[float, list[float]]:
    """(bias, weights) of the L2-penalised logistic regression of ``correct`` (1/0, or a score
    in [0, 1]) on the columns of ``x`` (n, d): minimises ``sum_i logloss_i + l2/2 * |w|^2``
    (the bias is not penalised), scikit-learn's ``LogisticRegression(C=1/l2)``.

    Raises ``ValueError`` for empty or mismatched inputs, values out of range, or outcomes
    that are all right or all wrong (the bias would be infinite)."""
    if not l2 > 0 or not math.isfinite(l2):
        raise ValueError(f"l2 must be a positive number, got {l2!r}")
    y = np.asarray(correct, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    if y.ndim != 1 or y.size == 0 or x.ndim != 2 or x.shape[0] != y.size:
        raise ValueError("feature_rows and correct must be non-empty and of the same length")
    if not np.all(np.isfinite(y)) or y.min() < 0 or y.max() > 1:
        raise ValueError("correct must hold numbers in [0, 1]")
    if not 0 < y.mean() < 1:
        raise ValueError("correct must hold both right and wrong answers")
    if not np.all(np.isfinite(x)):
        raise ValueError("feature values must be finite")
    # A score y in [0, 1] is a right answer of weight y and a wrong one of weight 1 - y: the
    # same log loss; rows of weight 0 are left out.
    rows = np.concatenate([x, x])
    labels = np.concatenate([np.ones(y.size), np.zeros(y.size)])
    weights = np.concatenate([y, 1.0 - y])
    kept = weights > 0
    model = LogisticRegression(C=1.0 / l2, solver="newton-cholesky", tol=1e-10, max_iter=1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        try:
            model.fit(rows[kept], labels[kept], sample_weight=weights[kept])
        except ConvergenceWarning:
            raise ValueError("the logistic fit did not converge") from None
    bias, coef = float(model.intercept_[0]), [float(w) for w in model.coef_[0]]
    if not math.isfinite(bias) or not all(math.isfinite(w) for w in coef):
        raise ValueError("the logistic fit did not converge")
    return bias, coef
