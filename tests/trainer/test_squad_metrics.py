from __future__ import annotations

import pytest

from openbook_trainer.evaluation.metrics import exact_match, f1_score, normalize_answer


def test_normalize_answer() -> None:
    assert normalize_answer("  The Eiffel   Tower! ") == "eiffel tower"
    assert normalize_answer("an apple, a pear") == "apple pear"
    assert normalize_answer("Theory") == "theory"  # articles only as whole words


def test_exact_match_is_max_over_golds() -> None:
    assert exact_match("the Angara", ["Angara River", "angara"]) == 1.0
    assert exact_match("Angara River.", ["angara"]) == 0.0


def test_f1() -> None:
    assert f1_score("Barack Obama", ["Obama"]) == pytest.approx(2 / 3)
    assert f1_score("Joe Biden", ["Barack Obama", "Joe Biden"]) == 1.0
    assert f1_score("", ["x"]) == 0.0
    assert f1_score("the", ["a"]) == 1.0  # both normalise to empty
