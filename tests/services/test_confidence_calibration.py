"""A confidence calibration stored with the served model, through the stack: the generator
service loads it with the model and every answer's confidence is the calibrated raw one on
``/answer`` and ``/v1``, abstention following the calibrated value; a bad calibration stops
the generator's start with an error naming the file."""

from __future__ import annotations

import httpx
import pytest

from openbook.rag import ModelLoadError
from openbook.rag.confidence import CALIBRATION_FILE, Calibration
from openbook_generator.server import load_initial_generator
from openbook_generator.settings import GeneratorSettings
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import running_backends, serving_gateway

# raw confidences of the tiny random BART are small: this map lifts them into [0.3, 0.8]
CALIBRATION = Calibration((0.0, 0.05, 1.0), (0.3, 0.6, 0.8), fitted_on=3)
ASK = {"question": "Who wrote Hamlet?", "k": 3, "max_new_tokens": 8, "use_cache": False}


@pytest.fixture(scope="module")
def url(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("calibrated")
    model = make_tiny_bart(tmp / "models" / "calibrated-bart")
    CALIBRATION.save(model)
    with (
        running_backends(tmp, redis_server.url, generator_model=model) as backends,
        serving_gateway(backends.gateway_settings(redis_server.url)) as base,
    ):
        yield base


def test_the_served_models_calibration_gives_the_confidence(url):
    answer = httpx.post(f"{url}/answer", json=ASK, timeout=60).json()
    for h in answer["hypotheses"]:
        assert 0 < h["raw_confidence"] < 1
        assert h["confidence"] == pytest.approx(CALIBRATION(h["raw_confidence"]), abs=1e-6)
        assert 0.3 <= h["confidence"] <= 0.8
    assert answer["confidence"] == answer["hypotheses"][0]["confidence"]

    # the threshold holds the calibrated value, not the raw one
    below = answer["confidence"] - 0.01
    kept = httpx.post(f"{url}/answer", json={**ASK, "min_confidence": below}, timeout=60).json()
    assert kept["abstained"] is False and kept["answer"] == answer["answer"]
    assert answer["hypotheses"][0]["raw_confidence"] < below
    above = min(1.0, answer["confidence"] + 0.01)
    withheld = httpx.post(f"{url}/answer", json={**ASK, "min_confidence": above}, timeout=60)
    assert withheld.json()["abstained"] is True and withheld.json()["answer"] == ""

    chat = {
        "model": "openbook",
        "messages": [{"role": "user", "content": ASK["question"]}],
        "max_tokens": 8,
        "k": 3,
        "use_cache": False,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).json()
    assert reply["openbook"]["confidence"] == answer["confidence"]


def test_a_bad_calibration_stops_the_generators_start(tmp_path):
    model = tmp_path / "bart"
    make_tiny_bart(model)  # the model itself is fine: only its calibration is broken
    (model / CALIBRATION_FILE).write_text(
        '{"kind": "piecewise-linear", "x": [0.5, 0.2], "y": [0, 1]}'
    )
    settings = GeneratorSettings(model=model, load_latest_checkpoint=False)
    with pytest.raises(ModelLoadError, match="strictly increasing") as refused:
        load_initial_generator(settings)
    assert str(model / CALIBRATION_FILE) in str(refused.value)
