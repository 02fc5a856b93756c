"""Fitting calibrations (openbook_trainer.calibration, scikit-learn): the isotonic fit's knots
and the logistic fit's weights, and what each refuses; the files they write are the ones
openbook.rag.confidence loads (tests/rag/test_confidence.py)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from openbook.rag.confidence import FEATURES, calibrate_row, load_calibration
from openbook_trainer.calibration import fit_calibration, fit_logistic_calibration


def test_pav_fit_is_monotone_in_the_unit_interval_and_matches_isotonic_regression():
    rng = np.random.default_rng(0)
    raw = rng.uniform(0, 1, 400)
    correct = rng.uniform(0, 1, 400) < raw**2  # right more often when more confident
    cal = fit_calibration(raw.tolist(), correct.tolist())
    cal.validate()
    assert cal.fitted_on == 400
    grid = np.linspace(0, 1, 201)
    mapped = np.array([cal(x) for x in grid])
    assert np.all(np.diff(mapped) >= 0)
    assert mapped.min() >= 0 and mapped.max() <= 1
    sklearn = pytest.importorskip("sklearn.isotonic")
    reference = sklearn.IsotonicRegression(out_of_bounds="clip", y_min=0, y_max=1)
    reference.fit(raw, correct.astype(float))
    assert mapped == pytest.approx(reference.predict(grid), abs=1e-9)


def test_pav_pools_violators_and_ties():
    cal = fit_calibration([0.1, 0.2, 0.2, 0.3, 0.4], [1, 0, 1, 0, 1])
    # 0.1 -> 1 and the (0.2: 1/2, 0.3: 0) pool down to (1 + 0.5*2 + 0) / 4 = 0.5
    assert cal(0.1) == cal(0.3) == pytest.approx(0.5)
    assert cal(0.4) == 1.0 and cal(0.0) == pytest.approx(0.5) and cal(1.0) == 1.0
    assert fit_calibration([0.5], [True])(0.2) == 1.0
    for raw, correct in (([], []), ([0.1], [1, 0]), ([1.5], [1]), ([0.5], [2]), ([math.nan], [1])):
        with pytest.raises(ValueError):
            fit_calibration(raw, correct)


def _synthetic(n: int, seed: int) -> tuple[list[dict[str, float]], np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = [
        {
            "log_prob": float(-rng.exponential(6)),
            "mean_log_prob": float(-rng.exponential(1)),
            "max_prior": float(rng.uniform()),
            "answer_in_top_passage": float(rng.uniform() < 0.5),
            "prior_with_answer": float(rng.uniform()),
            "cut_by_length": float(rng.uniform() < 0.1),
            "posterior_with_answer": float(rng.uniform()),
            "question_near_answer": float(rng.uniform()),
        }
        for _ in range(n)
    ]
    x = np.array([[r[f] for f in FEATURES] for r in rows])
    z = x @ np.array([0.05, 1.0, 1.5, 1.2, 2.0, -1.5, 1.0, 0.8]) - 1.0
    return rows, (rng.uniform(size=n) < 1 / (1 + np.exp(-z))).astype(float)


@pytest.mark.parametrize("l2", [1.0, 0.01, 30.0])
def test_the_logistic_fit_matches_scikit_learn(l2):
    linear_model = pytest.importorskip("sklearn.linear_model")
    rows, correct = _synthetic(600, seed=int(l2 * 100))
    cal = fit_logistic_calibration(rows, correct.tolist(), l2=l2)
    assert cal.features == FEATURES and cal.fitted_on == {"questions": 600}
    x = np.array([[r[f] for f in FEATURES] for r in rows])
    reference = linear_model.LogisticRegression(C=1 / l2, tol=1e-12, max_iter=100_000)
    reference.fit(x, correct)
    assert cal.weights == pytest.approx(reference.coef_[0].tolist(), abs=1e-3)
    assert cal.bias == pytest.approx(float(reference.intercept_[0]), abs=1e-3)
    probabilities = reference.predict_proba(x)[:, 1]
    assert [calibrate_row(cal, r) for r in rows] == pytest.approx(probabilities.tolist(), abs=1e-4)

    # a subset of the features, in the caller's order
    names = ("max_prior", "mean_log_prob")
    sub = fit_logistic_calibration(rows, correct.tolist(), features=names, l2=l2)
    reference.fit(x[:, [FEATURES.index(n) for n in names]], correct)
    assert sub.features == names
    assert sub.weights == pytest.approx(reference.coef_[0].tolist(), abs=1e-3)


def test_the_logistic_fit_survives_separable_and_constant_features_and_refuses_bad_input():
    rows, correct = _synthetic(80, seed=3)
    # a feature that separates the outcomes exactly: the penalty keeps its weight finite
    separated = [{**r, "answer_in_top_passage": c} for r, c in zip(rows, correct, strict=True)]
    cal = fit_logistic_calibration(separated, correct.tolist())
    assert all(math.isfinite(w) for w in cal.weights)
    assert cal.weights[FEATURES.index("answer_in_top_passage")] > 1
    # a feature constant over the rows (never cut by length) gets weight 0
    never_cut = [{**r, "cut_by_length": 0.0} for r in rows]
    cal = fit_logistic_calibration(never_cut, correct.tolist())
    assert cal.weights[FEATURES.index("cut_by_length")] == pytest.approx(0.0, abs=1e-9)
    assert fit_logistic_calibration(rows, correct.tolist(), fitted_on={"data": "x"}).fitted_on == {
        "data": "x"
    }
    bad = [
        ((rows, []), {}, "same length"),
        (([], []), {}, "same length"),
        ((rows, [1.0] * 80), {}, "both right and wrong"),
        ((rows, [2.0] * 80), {}, "in [0, 1]"),
        ((rows, correct.tolist()), {"features": ("entropy",)}, "unknown feature 'entropy'"),
        ((rows, correct.tolist()), {"l2": 0.0}, "l2"),
        (([{"max_prior": 1.0}] * 2, [0.0, 1.0]), {}, "no 'log_prob'"),
        (
            ([{**rows[0], "max_prior": math.nan}, rows[1]], [0.0, 1.0]),
            {},
            "finite",
        ),
    ]
    for args, kw, says in bad:
        with pytest.raises(ValueError, match=re.escape(says)):
            fit_logistic_calibration(*args, **kw)


def test_fitted_calibrations_are_the_files_the_core_loads(tmp_path):
    """Both kinds, written by the trainer, read back by the core as they were fitted."""
    piecewise = fit_calibration([0.1, 0.2, 0.3, 0.4], [0, 1, 0, 1])
    piecewise.save(tmp_path)
    assert load_calibration(tmp_path) == piecewise
    rows, correct = _synthetic(60, seed=5)
    logistic = fit_logistic_calibration(rows, correct.tolist())
    logistic.save(tmp_path)
    loaded = load_calibration(tmp_path)
    assert loaded == logistic
    assert [calibrate_row(loaded, r) for r in rows] == [calibrate_row(logistic, r) for r in rows]
