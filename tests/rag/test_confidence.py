"""openbook.rag.confidence: the definition (exp(log_prob / n) over the tokens each decoding mode
scores), the logistic calibration over an answer's features, and calibration files of both
kinds read and checked when a model loads (the fits: tests/trainer/test_calibration_fit.py)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil

import numpy as np
import pytest

from openbook.rag import DecodingOptions, ModelLoadError, RagGenerator
from openbook.rag.confidence import (
    CALIBRATION_FILE,
    FEATURES,
    LOG_PROB_FLOOR,
    NEAR_ANSWER_WORDS,
    Calibration,
    LogisticCalibration,
    answer_features,
    calibrate_row,
    confidence_features,
    confidences,
    load_calibration,
    normalized_texts,
    question_near_answer,
    raw_confidence,
)
from openbook.rag.options import Hypothesis
from openbook.types import Passage
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_adapter

MODES = ("rag-token", "rag-sequence-thorough", "rag-sequence-fast")


def test_raw_confidence_is_the_geometric_mean_token_probability():
    assert raw_confidence(math.log(0.25) * 3, 3) == pytest.approx(0.25)
    assert raw_confidence(0.0, 4) == 1.0
    assert raw_confidence(-2.0, 0) == 0.0  # an empty answer
    assert raw_confidence(-math.inf, 3) == 0.0  # an impossible one
    assert raw_confidence(math.nan, 3) == 0.0
    assert raw_confidence(0.7, 2) == 1.0  # transformers' RAG-Sequence score can exceed 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("forced_bos", [False, True])
def test_every_hypothesis_is_normalised_by_the_tokens_its_log_prob_sums(
    dirs, load, mode, forced_bos
):
    """RAG-Token scores every token; RAG-Sequence leaves out a forced BOS (transformers'
    exclude_bos_score), so with one the answer has a token more than it scores."""
    generation = {"forced_bos_token_id": 0} if forced_bos else {}
    gen = load(dirs.bart(0, generation=generation))
    options = DecodingOptions(mode=mode, num_beams=2, num_return_sequences=2, max_new_tokens=6)
    result = gen.generate(QUESTION, make_passages(3), options)
    for hyp in result.hypotheses:
        unscored = 1 if forced_bos and mode != "rag-token" else 0
        if forced_bos:
            assert hyp.token_ids[0] == 0
        assert hyp.scored_tokens == len(hyp.token_ids) - unscored
        assert hyp.raw_confidence == pytest.approx(
            math.exp(hyp.log_prob / hyp.scored_tokens), rel=1e-6
        )
        assert 0 < hyp.raw_confidence < 1
        assert hyp.confidence == hyp.raw_confidence  # no calibration


def test_a_calibration_round_trips_through_its_file(tmp_path):
    cal = Calibration((0.1, 0.5, 0.9), (0.0, 0.4, 0.95), fitted_on=12)
    path = cal.save(tmp_path)
    assert path.name == CALIBRATION_FILE
    assert load_calibration(tmp_path) == cal
    assert load_calibration(tmp_path / "elsewhere") is None
    assert cal(0.3) == pytest.approx(0.2) and cal(0.0) == 0.0 and cal(1.0) == 0.95


BAD_FILES = [
    ("{", "Expecting"),
    ("[]", "expected a JSON object"),
    ('{"kind": "platt", "x": [0.5], "y": [0.5]}', "kind"),
    ('{"kind": "piecewise-linear", "x": [0.1, 0.2], "y": [0.5]}', "differ in length"),
    ('{"kind": "piecewise-linear", "x": [], "y": []}', "at least one knot"),
    ('{"kind": "piecewise-linear", "x": [0.2, 0.1], "y": [0.1, 0.2]}', "strictly increasing"),
    ('{"kind": "piecewise-linear", "x": [0.1, 0.2], "y": [0.3, 0.2]}', "non-decreasing"),
    ('{"kind": "piecewise-linear", "x": [0.1, 1.2], "y": [0.1, 0.2]}', "x[1]"),
    ('{"kind": "piecewise-linear", "x": [0.1], "y": ["0.2"]}', "y[0]"),
    ('{"kind": "piecewise-linear", "x": [NaN], "y": [0.2]}', "NaN"),
    ('{"kind": "piecewise-linear", "x": [0.1], "y": [0.2], "fitted_on": -1}', "fitted_on"),
    ('{"kind": "logistic", "features": ["log_prob"], "weights": [1.0]}', "bias is missing"),
    (
        '{"kind": "logistic", "features": ["log_prob", "entropy"], "weights": [1, 2], "bias": 0}',
        "features[1] must be one of",
    ),
    (
        '{"kind": "logistic", "features": ["log_prob", "max_prior"], "weights": [1], "bias": 0}',
        "differ in length (2 vs 1)",
    ),
    (
        '{"kind": "logistic", "features": ["max_prior", "max_prior"], "weights": [1, 1], '
        '"bias": 0}',
        "distinct",
    ),
    ('{"kind": "logistic", "features": ["max_prior"], "weights": [NaN], "bias": 0}', "NaN"),
    (
        '{"kind": "logistic", "features": ["max_prior"], "weights": [1e999], "bias": 0}',
        "weights[0]",
    ),
    ('{"kind": "logistic", "features": ["max_prior"], "weights": ["1"], "bias": 0}', "weights[0]"),
    ('{"kind": "logistic", "features": ["max_prior"], "weights": [1], "bias": true}', "bias"),
    ('{"kind": "logistic", "features": "max_prior", "weights": [1], "bias": 0}', "must be lists"),
    (
        '{"kind": "logistic", "features": [], "weights": [], "bias": 0, "fitted_on": 3}',
        "fitted_on must be a JSON object",
    ),
]


@pytest.mark.parametrize(("text", "says"), BAD_FILES)
def test_a_bad_calibration_stops_the_model_load_naming_the_file(dirs, tmp_path, text, says):
    model = tmp_path / "bart"
    shutil.copytree(dirs.bart(0), model)
    (model / CALIBRATION_FILE).write_text(text)
    with pytest.raises(ModelLoadError, match=re.escape(says)) as refused:
        RagGenerator.load(model, device="cpu")
    assert str(model / CALIBRATION_FILE) in str(refused.value)


def test_a_models_calibration_is_applied_and_an_adapters_replaces_it(dirs, tmp_path):
    model = tmp_path / "bart"
    shutil.copytree(dirs.bart(0), model)
    cal = Calibration((0.0, 1.0), (0.2, 0.6))
    cal.save(model)
    gen = RagGenerator.load(model, device="cpu")
    assert gen.calibration == cal
    options = DecodingOptions(num_beams=2, num_return_sequences=2, max_new_tokens=5)
    for hyp in gen.generate(QUESTION, make_passages(2), options).hypotheses:
        assert hyp.confidence == pytest.approx(0.2 + 0.4 * hyp.raw_confidence)

    adapter = make_tiny_adapter(dirs.bart(0), tmp_path / "adapter")
    adapted = Calibration((0.0, 1.0), (0.5, 0.5))
    adapted.save(adapter)
    gen.apply_adapter(adapter, dirs.bart(0))
    assert gen.calibration == adapted
    (hyp,) = gen.generate(QUESTION, make_passages(2), DecodingOptions()).hypotheses
    assert hyp.confidence == 0.5 and 0 < hyp.raw_confidence < 1

    (adapter / CALIBRATION_FILE).write_text(json.dumps({"kind": "piecewise-linear"}))
    fresh = RagGenerator.load(dirs.bart(0), device="cpu")
    with pytest.raises(ModelLoadError, match="x and y must be lists"):
        fresh.apply_adapter(adapter, dirs.bart(0))


# ---------------------------------------------------------------- the logistic calibration

PASSAGES = [
    Passage("a", "Hamlet", "Hamlet is a tragedy by William Shakespeare.", score=0.0),
    Passage("b", "Macbeth", "Macbeth, too, was written by Shakespeare!", score=0.0),
    Passage("c", "Faust", "Faust is a play by Goethe.", score=0.0),
]


def _hypothesis(text: str, log_prob: float, scored_tokens: int, finish: str = "stop"):
    return Hypothesis(
        text=text,
        token_ids=list(range(scored_tokens)),
        log_prob=log_prob,
        scored_tokens=scored_tokens,
        finish_reason=finish,
    )


def test_the_features_of_a_hand_made_hypothesis():
    prior = [0.2, 0.5, 0.3]  # the second passage is the top one
    hyp = _hypothesis("The  SHAKESPEARE.", -3.0, 4)  # normalised: "shakespeare"
    assert confidence_features(hyp, PASSAGES, prior) == {
        "log_prob": -3.0,
        "mean_log_prob": -0.75,
        "max_prior": 0.5,
        "answer_in_top_passage": 1.0,
        "prior_with_answer": pytest.approx(0.7),  # passages a and b hold it
        "cut_by_length": 0.0,
        # no posterior on the hypothesis: the prior stands in
        "posterior_with_answer": pytest.approx(0.7),
        "question_near_answer": 0.0,  # no question given
    }
    # the answer's passage posterior p(z|x,y): RAG-Sequence's, or RAG-Token's after its last
    # token (an earlier token's is not the answer's)
    hyp.doc_posterior = [0.1, 0.1, 0.8]
    assert confidence_features(hyp, PASSAGES, prior)["posterior_with_answer"] == pytest.approx(0.2)
    hyp.doc_posterior = None
    hyp.token_doc_posteriors = [[0.0, 0.0, 1.0], [0.6, 0.3, 0.1]]
    assert confidence_features(hyp, PASSAGES, prior)["posterior_with_answer"] == pytest.approx(0.9)
    with pytest.raises(ValueError, match="posterior and doc_prior differ"):
        answer_features(
            text="Goethe",
            log_prob=-1.0,
            mean_log_prob=-1.0,
            finish_reason="stop",
            normalized=normalized_texts(PASSAGES),
            doc_prior=prior,
            posterior=[1.0],
        )
    # an answer only the third passage holds; cut by max_new_tokens
    goethe = confidence_features(_hypothesis("Goethe", -1.0, 2, "length"), PASSAGES, prior)
    assert goethe["answer_in_top_passage"] == 0.0 and goethe["prior_with_answer"] == 0.3
    assert goethe["cut_by_length"] == 1.0 and goethe["mean_log_prob"] == -0.5
    # a substring of the normalised text, as specified (not only whole words)
    assert confidence_features(_hypothesis("speare", -1.0, 1), PASSAGES, prior)[
        "prior_with_answer"
    ] == pytest.approx(0.7)
    # ties: the first passage of the highest prior is the top one
    tied = confidence_features(_hypothesis("Goethe", -1.0, 1), PASSAGES, [0.4, 0.2, 0.4])
    assert tied["answer_in_top_passage"] == 0.0 and tied["max_prior"] == 0.4


def test_features_of_empty_impossible_and_extreme_answers():
    prior = [0.2, 0.5, 0.3]
    empty = confidence_features(_hypothesis(" the . ", -2.0, 0), PASSAGES, prior)
    assert empty["mean_log_prob"] == LOG_PROB_FLOOR  # no token scored
    assert empty["answer_in_top_passage"] == 0.0 and empty["prior_with_answer"] == 0.0
    impossible = confidence_features(_hypothesis("Goethe", -math.inf, 3), PASSAGES, prior)
    assert impossible["log_prob"] == impossible["mean_log_prob"] == LOG_PROB_FLOOR
    nan = confidence_features(_hypothesis("Goethe", math.nan, 3), PASSAGES, prior)
    assert nan["log_prob"] == nan["mean_log_prob"] == LOG_PROB_FLOOR
    far = confidence_features(_hypothesis("Goethe", -400.0, 4), PASSAGES, prior)
    assert far["log_prob"] == LOG_PROB_FLOOR and far["mean_log_prob"] == -50.0
    above = confidence_features(_hypothesis("Goethe", 0.3, 2), PASSAGES, prior)
    assert above["log_prob"] == above["mean_log_prob"] == 0.0
    # exp(mean_log_prob) is raw confidence: what a client recovers it from
    hyp = _hypothesis("Goethe", -2.2, 3)
    assert math.exp(confidence_features(hyp, PASSAGES, prior)["mean_log_prob"]) == pytest.approx(
        raw_confidence(-2.2, 3)
    )
    no_passages = confidence_features(hyp, [], [])
    assert no_passages["max_prior"] == no_passages["answer_in_top_passage"] == 0.0
    with pytest.raises(ValueError, match="differ in length"):
        confidence_features(hyp, PASSAGES, [1.0])
    # plain texts work as passages; precomputed normalised texts give the same row
    texts = [p.text for p in PASSAGES]
    assert confidence_features(hyp, texts, prior) == confidence_features(
        hyp, [], prior, normalized=normalized_texts(PASSAGES)
    )
    assert answer_features(
        text="Goethe",
        log_prob=-2.2,
        mean_log_prob=math.log(raw_confidence(-2.2, 3)),
        finish_reason="stop",
        normalized=normalized_texts(texts),
        doc_prior=prior,
    ) == pytest.approx(confidence_features(hyp, PASSAGES, prior))


LOGISTIC = LogisticCalibration(
    ("mean_log_prob", "max_prior", "answer_in_top_passage", "cut_by_length"),
    (1.5, 2.0, 1.0, -3.0),
    -0.5,
    {"questions": 40, "data": "train.jsonl"},
)


def test_a_logistic_calibration_is_the_sigmoid_of_its_weighted_features():
    row = {"mean_log_prob": -0.75, "max_prior": 0.5, "answer_in_top_passage": 1.0}
    row |= {"cut_by_length": 0.0, "log_prob": -3.0, "prior_with_answer": 0.7}
    z = -0.5 + 1.5 * -0.75 + 2.0 * 0.5 + 1.0
    assert LOGISTIC(row) == pytest.approx(1 / (1 + math.exp(-z)), abs=1e-15)
    assert calibrate_row(LOGISTIC, row) == LOGISTIC(row)
    assert confidences(-3.0, 4, LOGISTIC, row) == (pytest.approx(math.exp(-0.75)), LOGISTIC(row))
    with pytest.raises(ValueError, match="needs the answer's features"):
        confidences(-3.0, 4, LOGISTIC)
    with pytest.raises(KeyError):
        LOGISTIC({"mean_log_prob": -1.0})
    # numerically safe far out on either side
    huge = LogisticCalibration(("log_prob",), (100.0,), 0.0)
    assert huge({"log_prob": -50.0}) == pytest.approx(0.0, abs=1e-300)
    assert LogisticCalibration(("log_prob",), (-100.0,), 0.0)({"log_prob": -50.0}) == 1.0
    # a piecewise-linear calibration applied to a row reads exp(mean_log_prob)
    pwl = Calibration((0.0, 1.0), (0.2, 0.6))
    assert calibrate_row(pwl, row) == pytest.approx(0.2 + 0.4 * math.exp(-0.75))
    assert calibrate_row(pwl, {**row, "mean_log_prob": LOG_PROB_FLOOR}) == 0.2


def test_a_logistic_calibration_round_trips_through_its_file(tmp_path):
    path = LOGISTIC.save(tmp_path)
    data = json.loads(path.read_text())
    assert data == {
        "kind": "logistic",
        "features": list(LOGISTIC.features),
        "weights": list(LOGISTIC.weights),
        "bias": -0.5,
        "fitted_on": {"questions": 40, "data": "train.jsonl"},
    }
    loaded = load_calibration(tmp_path)
    assert isinstance(loaded, LogisticCalibration)
    assert loaded == LOGISTIC and loaded.fitted_on == LOGISTIC.fitted_on
    # integers in the file are read as floats; fitted_on may be left out
    (tmp_path / CALIBRATION_FILE).write_text(
        '{"kind": "logistic", "features": ["max_prior"], "weights": [2], "bias": 1}'
    )
    plain = load_calibration(tmp_path)
    assert plain == LogisticCalibration(("max_prior",), (2.0,), 1.0)
    assert isinstance(plain.weights[0], float) and plain.fitted_on == {}


@pytest.mark.parametrize("mode", MODES)
def test_a_models_logistic_calibration_gives_every_hypothesis_its_sigmoid(dirs, tmp_path, mode):
    model = tmp_path / "bart"
    shutil.copytree(dirs.bart(0), model)
    cal = LogisticCalibration(FEATURES, (0.02, 0.8, 1.5, 2.0, 1.0, -1.0, 0.9, 1.1), 0.3)
    cal.save(model)
    gen = RagGenerator.load(model, device="cpu")
    assert gen.calibration == cal
    options = DecodingOptions(mode=mode, num_beams=2, num_return_sequences=2, max_new_tokens=3)
    # Write the best answer into the top passage until the model answers with what that
    # passage says (the tiny random model settles in a few rounds), so that the
    # answer-in-passage features the engine computes are not all 0.
    passages = make_passages(3)
    for _ in range(6):
        result = gen.generate(QUESTION, passages, options)
        best = result.hypotheses[0]
        if confidence_features(best, passages, result.doc_prior, question=QUESTION)[
            "answer_in_top_passage"
        ]:
            break
        top = int(np.argmax(result.doc_prior))
        passages[top] = dataclasses.replace(passages[top], text=f"{passages[top].text} {best.text}")
    else:
        pytest.fail("the model never answered with its top passage's words")
    assert len(result.hypotheses) == 2
    for hyp in result.hypotheses:
        features = confidence_features(hyp, passages, result.doc_prior, question=QUESTION)
        assert features["max_prior"] == pytest.approx(max(result.doc_prior))
        assert features["cut_by_length"] == (1.0 if hyp.finish_reason == "length" else 0.0)
        assert hyp.confidence == pytest.approx(cal(features), abs=1e-12)
        assert hyp.raw_confidence == pytest.approx(math.exp(features["mean_log_prob"]))
    best_features = confidence_features(
        result.hypotheses[0], passages, result.doc_prior, question=QUESTION
    )
    assert best_features["prior_with_answer"] >= best_features["max_prior"] > 0


def test_question_near_answer_counts_the_questions_words_beside_the_answer():
    normalized = normalized_texts(PASSAGES)
    # "who wrote hamlet": content words {wrote, hamlet}; "hamlet" is beside Shakespeare in
    # passage a, "wrote" nowhere
    assert question_near_answer("Who wrote Hamlet?", "Shakespeare", normalized) == 0.5
    tragedy = question_near_answer("Who wrote the tragedy Hamlet?", "W. Shakespeare", normalized)
    assert tragedy == 0.0  # "w shakespeare" is in no passage: the whole answer must be there
    two_of_three = question_near_answer("Who wrote the tragedy Hamlet?", "Shakespeare", normalized)
    assert two_of_three == pytest.approx(2 / 3)
    # the best passage counts, not the sum: "macbeth" and "written" are only in passage b
    assert question_near_answer("Macbeth was written by whom?", "Shakespeare", normalized) == 1.0
    # nothing holds the answer, or nothing is asked: 0
    assert question_near_answer("Who wrote Hamlet?", "Marlowe", normalized) == 0.0
    assert question_near_answer("Who is it?", "Shakespeare", normalized) == 0.0
    assert question_near_answer("Who wrote Hamlet?", " the ", normalized) == 0.0
    # the window: a word farther than NEAR_ANSWER_WORDS from the answer does not count
    far = normalized_texts(["alpha " + "filler " * (NEAR_ANSWER_WORDS + 1) + "omega"])
    assert question_near_answer("alpha?", "omega", far) == 0.0
    near = normalized_texts(["alpha " + "filler " * (NEAR_ANSWER_WORDS - 1) + "omega"])
    assert question_near_answer("alpha?", "omega", near) == 1.0
    # through the features: the engine passes the request's question
    hyp = _hypothesis("Shakespeare", -1.0, 2)
    features = confidence_features(hyp, PASSAGES, [0.2, 0.5, 0.3], question="Who wrote Hamlet?")
    assert features["question_near_answer"] == 0.5
