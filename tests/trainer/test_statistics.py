"""Intervals and confidence measures of held-out evaluations (evaluation/statistics.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from openbook_trainer.evaluation.statistics import (
    auroc,
    bootstrap_ci,
    expected_calibration_error,
    measure_ci,
    paired_difference_ci,
    precision_at_coverage,
    reliability_bins,
    threshold_for_coverage,
)


def test_bootstrap_interval_contains_the_mean_and_shrinks_with_more_data() -> None:
    rng = np.random.default_rng(1)
    small = bootstrap_ci(rng.random(50) < 0.3)
    large = bootstrap_ci(rng.random(5000) < 0.3)
    for iv in (small, large):
        assert iv.low <= iv.mean <= iv.high
    assert (large.high - large.low) < (small.high - small.low) / 5
    assert large.low < 0.3 < large.high
    assert bootstrap_ci([1, 0, 1]) == bootstrap_ci([1, 0, 1])  # seeded: reproducible


def test_cluster_bootstrap_is_wider_when_groups_differ() -> None:
    # Two articles, one always right and one always wrong: the questions look independent
    # (tight interval) but the articles are what varies.
    values = [1.0] * 100 + [0.0] * 100
    groups = ["a"] * 100 + ["b"] * 100
    by_question = bootstrap_ci(values)
    by_article = bootstrap_ci(values, groups)
    assert by_article.high - by_article.low > 3 * (by_question.high - by_question.low)
    with pytest.raises(ValueError):
        bootstrap_ci(values, groups[:-1])


def test_paired_difference_sees_a_consistent_small_gain() -> None:
    rng = np.random.default_rng(0)
    a = (rng.random(400) < 0.5).astype(float)
    b = a.copy()
    b[:20] = 0.0  # b is a minus 20 answers, where a was right or not
    iv = paired_difference_ci(a, b)
    assert iv.mean == pytest.approx((a - b).mean())
    assert iv.low >= 0.0
    with pytest.raises(ValueError):
        paired_difference_ci(a, b[:-1])


def test_ece_zero_when_calibrated_and_large_when_overconfident() -> None:
    conf = [0.25] * 4 + [0.75] * 4
    correct = [1, 0, 0, 0] + [1, 1, 1, 0]
    assert expected_calibration_error(conf, correct) == pytest.approx(0.0)
    assert expected_calibration_error([0.95] * 10, [0] * 10) == pytest.approx(0.95)
    bins = reliability_bins(conf, correct, bins=4)
    assert [b.count for b in bins] == [0, 4, 0, 4]
    assert math.isnan(bins[0].accuracy)
    with pytest.raises(ValueError):
        reliability_bins([1.5], [1])
    assert reliability_bins([1.0], [1], bins=10)[-1].count == 1  # 1.0 falls in the last bin


def test_auroc_matches_pair_counting() -> None:
    assert auroc([0.9, 0.8, 0.2, 0.1], [1, 1, 0, 0]) == 1.0
    assert auroc([0.1, 0.2, 0.8, 0.9], [1, 1, 0, 0]) == 0.0
    assert auroc([0.5, 0.5], [1, 0]) == 0.5
    rng = np.random.default_rng(3)
    c, y = rng.random(60).round(1), rng.random(60) < 0.4
    pos, neg = c[y], c[~y]
    pairs = np.mean([(p > n) + 0.5 * (p == n) for p in pos for n in neg])
    assert auroc(c, y) == pytest.approx(pairs)
    assert math.isnan(auroc([0.3, 0.4], [1, 1]))


def test_precision_at_coverage_keeps_the_most_confident() -> None:
    conf = [0.9, 0.1, 0.8, 0.2]
    correct = [1, 0, 1, 1]
    assert precision_at_coverage(conf, correct, 1.0) == 0.75
    assert precision_at_coverage(conf, correct, 0.5) == 1.0
    assert threshold_for_coverage(conf, 0.5) == 0.8
    with pytest.raises(ValueError):
        precision_at_coverage(conf, correct, 0.0)


def test_measure_ci_bootstraps_any_measure_by_group() -> None:
    rng = np.random.default_rng(1)
    groups = [f"a{i % 8}" for i in range(400)]
    y = (rng.random(400) < 0.4).astype(float)
    c = np.clip(0.3 * y + rng.random(400) * 0.7, 0, 1)  # right answers a little more confident
    ci = measure_ci(auroc, c, y, groups)
    assert ci.mean == pytest.approx(auroc(c, y))
    assert ci.low < ci.mean < ci.high <= 1.0
    # resamples where the measure is undefined are left out, not propagated as nan
    one_right = [0.0] * 9 + [1.0]  # the most confident answer is the right one
    partial = measure_ci(auroc, np.linspace(0, 1, 10), one_right, [str(i) for i in range(10)])
    assert not math.isnan(partial.low) and partial.mean == 1.0
    assert math.isnan(measure_ci(auroc, [0.2, 0.3], [1, 1]).low)  # never defined
    with pytest.raises(ValueError):
        measure_ci(auroc, [0.2], [1, 0])
