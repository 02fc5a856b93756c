"""openbook.rag.confidence: the definition (exp(log_prob / n) over the tokens each decoding mode
scores), the isotonic (PAV) fit, and calibration files read and checked when a model loads."""

from __future__ import annotations

import json
import math
import re
import shutil

import numpy as np
import pytest

from openbook.rag import DecodingOptions, ModelLoadError, RagGenerator
from openbook.rag.confidence import (
    CALIBRATION_FILE,
    Calibration,
    fit_calibration,
    load_calibration,
    raw_confidence,
)
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
