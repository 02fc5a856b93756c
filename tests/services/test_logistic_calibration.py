"""A logistic confidence calibration stored with the served model, through the stack: the
generator computes every answer's features from its passages and prior, and the confidence on
``/answer`` is sigmoid(bias + w . features), recomputed here from what the reply carries."""

from __future__ import annotations

import httpx
import pytest

from openbook.rag.confidence import CALIBRATION_FILE, FEATURES, LogisticCalibration
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import running_backends, serving_gateway
from openbook_trainer.evaluation.runner import features_of_answer

# every feature weighs in; the bias lifts the tiny random BART's unsure answers off 0
CALIBRATION = LogisticCalibration(
    FEATURES, (0.05, 0.9, 2.0, 1.5, 1.0, -0.7, 0.8, 0.6), 1.2, {"note": "hand-made for the test"}
)
ASK = {"question": "Who wrote Hamlet?", "k": 3, "max_new_tokens": 3, "use_cache": False}


@pytest.fixture(scope="module")
def url(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("logistic")
    model = make_tiny_bart(tmp / "models" / "logistic-bart")
    CALIBRATION.save(model)
    assert (model / CALIBRATION_FILE).exists()
    with (
        running_backends(tmp, redis_server.url, generator_model=model) as backends,
        serving_gateway(backends.gateway_settings(redis_server.url)) as base,
    ):
        yield base


@pytest.mark.parametrize("decoding", ["rag-token", "rag-sequence-thorough"])
def test_the_served_models_logistic_calibration_gives_the_confidence(url, decoding):
    body = {**ASK, "decoding": decoding, "num_beams": 2, "num_return_sequences": 2}
    answer = httpx.post(f"{url}/answer", json=body, timeout=60).json()
    assert len(answer["passages"]) == 3 and len(answer["hypotheses"]) == 2
    priors = [p["prior"] for p in answer["passages"]]
    for h in answer["hypotheses"]:
        features = features_of_answer(h, answer["passages"], ASK["question"])
        assert features is not None and features["max_prior"] == pytest.approx(max(priors))
        assert features["cut_by_length"] == (1.0 if h["finish_reason"] == "length" else 0.0)
        # the wire carries float32s: the recomputed value agrees to their precision
        assert h["confidence"] == pytest.approx(CALIBRATION(features), abs=1e-5)
        assert h["confidence"] != pytest.approx(h["raw_confidence"], abs=1e-3)
    assert answer["confidence"] == answer["hypotheses"][0]["confidence"]

    # the threshold holds the calibrated value
    above = min(1.0, answer["confidence"] + 0.01)
    withheld = httpx.post(f"{url}/answer", json={**body, "min_confidence": above}, timeout=60)
    assert withheld.json()["abstained"] is True and withheld.json()["answer"] == ""
