from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from openbook_trainer.evaluation.metrics import (
    accuracy,
    answer_recall_at_k,
    bleu,
    exact_match,
    f1_score,
    has_answer,
    normalize_answer,
    qa_scores,
    recall_at_k,
    rouge_l,
)


def test_squad_normalisation_and_em():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("an Apple, a day") == "apple day"
    assert exact_match("the Paris.", ["paris"]) == 1.0
    assert exact_match("Lyon", ["Paris", "City of Light"]) == 0.0
    assert exact_match("city of light", ["Paris", "City of Light"]) == 1.0


def test_f1_is_max_over_golds():
    # pred tokens {neil, armstrong, walked}; gold 1 {neil, armstrong}: p=2/3 r=1 -> 0.8
    assert f1_score("Neil Armstrong walked", ["Neil Armstrong", "Buzz"]) == pytest.approx(0.8)
    assert f1_score("nothing", ["something"]) == 0.0
    assert f1_score("", [""]) == 1.0
    assert qa_scores(["paris", "x"], [["Paris"], ["y"]]) == {"em": 50.0, "f1": 50.0}


def test_bleu_and_rouge():
    assert bleu(["the cat sat on the mat"], [["the cat sat on the mat"]]) == pytest.approx(100.0)
    assert bleu(["completely different words here"], [["the cat sat on the mat"]]) < 10
    # uneven numbers of references are allowed
    assert bleu(["a b c d", "e f g h"], [["a b c d"], ["x", "e f g h"]]) == pytest.approx(100.0)
    # LCS "the cat sat" = 3 of 3 predicted, 3 of 5 reference tokens: F = 2*1*0.6/1.6 = 0.75
    assert rouge_l(["the cat sat"], [["the cat sat on mats", "dog"]]) == pytest.approx(75.0)


def test_accuracy_and_recall():
    assert accuracy(["SUPPORTS", "refutes"], ["supports", ["NOT ENOUGH INFO"]]) == 50.0
    ids = [["a", "b", "c"], ["x", "y", "z"]]
    assert recall_at_k(ids, [["b"], ["q"]], 1) == 0.0
    assert recall_at_k(ids, [["b"], ["q"]], 2) == 50.0
    assert has_answer("Neil Armstrong was first.", ["neil armstrong"])
    assert not has_answer("Armstrong-Neil", ["neil armstrong"])
    assert answer_recall_at_k([["no", "in 1889 it"]], [["1889"]], 1) == 0.0
    assert answer_recall_at_k([["no", "in 1889 it"]], [["1889"]], 2) == 100.0


def test_length_mismatch_is_an_error():
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        qa_scores(["a", "b"], [["a"]])


@given(
    st.lists(st.sampled_from(["a1", "b", "c", "dd"]), max_size=12),
    st.lists(st.lists(st.sampled_from(["a1", "b", "c", "dd"]), max_size=3), max_size=3),
)
def test_the_joined_token_test_is_dprs_token_run_test(tokens, answers):
    """``tokens_have_answer`` (a substring search on space-joined tokens) decides exactly as
    DPR's loop over token positions."""
    from openbook.rag.answers import tokens_have_answer

    def by_positions(t: list[str], golds: list[list[str]]) -> bool:
        return any(
            a and any(t[i : i + len(a)] == a for i in range(len(t) - len(a) + 1)) for a in golds
        )

    assert tokens_have_answer(tokens, answers) == by_positions(tokens, answers)
