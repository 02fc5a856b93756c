"""Confidence and abstention through the stack users run: a real uvicorn gateway, retriever,
generator (a tiny random BART) and Redis.

Every answer carries its confidence (exp(log_prob / n), openbook/rag/confidence.py) on
``/answer``, its stream's final event and ``/v1/chat/completions`` (whole and streamed); a
request's ``min_confidence`` (or the server's default) turns an answer below it into an
abstention, applied after the cache; a bad threshold is a 422 (a 400 on /v1) naming the field.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from pydantic import ValidationError

from openbook_gateway.settings import GatewaySettings
from openbook_testkit.sse import read_events
from openbook_testkit.stack import running_backends, serving_gateway

ASK = {"question": "Who wrote Hamlet?", "k": 3, "max_new_tokens": 8}
CHAT = {"model": "openbook", "messages": [{"role": "user", "content": "Who wrote Hamlet?"}]}
TIMEOUT = 60


@pytest.fixture(scope="module")
def urls(tmp_path_factory, redis_server):
    """(a gateway with no default threshold, one whose default is 1.0: every answer abstains)."""
    tmp = tmp_path_factory.mktemp("confidence")
    with (
        running_backends(tmp, redis_server.url) as backends,
        serving_gateway(backends.gateway_settings(redis_server.url)) as plain,
        serving_gateway(backends.gateway_settings(redis_server.url, min_confidence=1.0)) as strict,
    ):
        yield plain, strict


def _post(url: str, body: dict, path: str = "/answer") -> dict:
    reply = httpx.post(f"{url}{path}", json=body, timeout=TIMEOUT)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _stream(url: str, body: dict, path: str = "/answer") -> list:
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        return list(read_events(r.iter_lines()))


def _assert_confident(answer: dict) -> None:
    """The answer's confidence is its best hypothesis', and every hypothesis' is
    exp(log_prob / n) (RAG-Token scores every generated token; no calibration here)."""
    assert answer["hypotheses"]
    for h in answer["hypotheses"]:
        expected = math.exp(h["log_prob"] / h["num_tokens"])
        assert h["raw_confidence"] == pytest.approx(expected, rel=1e-4)
        assert h["confidence"] == h["raw_confidence"]
        assert 0 < h["confidence"] < 1
    assert answer["confidence"] == answer["hypotheses"][0]["confidence"]


def _assert_abstained(answer: dict) -> None:
    assert answer["abstained"] is True
    assert answer["answer"] == ""
    assert answer["confidence"] < answer["min_confidence"]
    assert answer["passages"] and answer["hypotheses"]  # still returned
    assert answer["hypotheses"][0]["text"]  # what the model would have said


def test_every_answer_carries_its_confidence(urls):
    plain, _ = urls
    answer = _post(plain, {**ASK, "use_cache": False})
    _assert_confident(answer)
    assert answer["abstained"] is False and answer["min_confidence"] is None
    assert answer["answer"] == answer["hypotheses"][0]["text"]
    beams = _post(plain, {**ASK, "num_beams": 2, "num_return_sequences": 2, "use_cache": False})
    assert len(beams["hypotheses"]) == 2
    _assert_confident(beams)


def test_the_streams_final_event_carries_the_confidence(urls):
    plain, _ = urls
    body = {**ASK, "use_cache": False}
    final = _stream(plain, body)[-1]
    assert final.event == "answer"
    whole = _post(plain, body)
    assert final.json()["confidence"] == whole["confidence"]
    assert final.json()["abstained"] is False
    _assert_confident(final.json())


def test_a_threshold_of_one_abstains_and_of_zero_never(urls):
    plain, _ = urls
    body = {**ASK, "use_cache": False}
    answered = _post(plain, body)
    withheld = _post(plain, {**body, "min_confidence": 1.0})
    _assert_abstained(withheld)
    assert withheld["min_confidence"] == 1.0
    # Two computations of one answer agree to float32 precision, not always to the last bit
    # (the query encoder's sums may be split between threads differently from call to call).
    assert withheld["confidence"] == pytest.approx(answered["confidence"], rel=1e-4)
    assert [p["id"] for p in withheld["passages"]] == [p["id"] for p in answered["passages"]]
    assert [h["text"] for h in withheld["hypotheses"]] == [
        h["text"] for h in answered["hypotheses"]
    ]
    zero = _post(plain, {**body, "min_confidence": 0})
    assert zero["abstained"] is False and zero["answer"] == answered["answer"]
    just_below = _post(plain, {**body, "min_confidence": answered["confidence"] * (1 - 1e-3)})
    assert just_below["abstained"] is False


def test_a_stream_abstains_in_its_final_event(urls):
    plain, _ = urls
    events = _stream(plain, {**ASK, "use_cache": False, "min_confidence": 1.0})
    assert [e.event for e in events[:-1]] and {e.event for e in events[:-1]} == {"token"}
    written = "".join(e.json()["text"] for e in events[:-1] if e.json()["passage"] is None)
    final = events[-1].json()
    _assert_abstained(final)
    # the tokens streamed as they were generated: the final event is the one to trust
    assert written == final["hypotheses"][0]["text"]


def test_the_servers_default_applies_and_a_request_overrides_it(urls):
    _, strict = urls
    body = {**ASK, "use_cache": False}
    defaulted = _post(strict, body)
    _assert_abstained(defaulted)
    assert defaulted["min_confidence"] == 1.0
    overridden = _post(strict, {**body, "min_confidence": 0.0})
    assert overridden["abstained"] is False and overridden["answer"]
    _assert_abstained(_stream(strict, body)[-1].json())


def test_a_cached_answer_is_held_to_each_requests_threshold(urls):
    plain, _ = urls
    body = {**ASK, "question": "Who discovered penicillin?"}
    first = _post(plain, body)
    assert first["cached"] is False and first["abstained"] is False
    higher = _post(plain, {**body, "min_confidence": 1.0})
    assert higher["cached"] is True
    _assert_abstained(higher)
    lower = _post(plain, {**body, "min_confidence": first["confidence"] / 2})
    assert lower["cached"] is True and lower["abstained"] is False
    assert lower["answer"] == first["answer"] and lower["confidence"] == first["confidence"]
    # the abstention was not stored: asked again without a threshold, it answers
    again = _post(plain, body)
    assert again["cached"] is True and again["answer"] == first["answer"]
    streamed = _stream(plain, {**body, "min_confidence": 1.0})[-1].json()
    assert streamed["cached"] is True
    _assert_abstained(streamed)


@pytest.mark.parametrize("value", ["-0.1", "1.5", '"0.5"', "NaN", "Infinity", "true"])
def test_a_bad_threshold_is_a_422_naming_the_field(urls, value):
    plain, _ = urls
    raw = '{"question": "Who wrote Hamlet?", "min_confidence": ' + value + "}"
    reply = httpx.post(
        f"{plain}/answer",
        content=raw,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 422, reply.text
    assert [e["loc"] for e in reply.json()["detail"]] == [["body", "min_confidence"]]
    chat = json.dumps(CHAT)[:-1] + ', "min_confidence": ' + value + "}"
    refused = httpx.post(
        f"{plain}/v1/chat/completions",
        content=chat,
        headers={"content-type": "application/json"},
        timeout=TIMEOUT,
    )
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "min_confidence"


def test_the_servers_default_is_checked_at_start(monkeypatch):
    for value in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValidationError, match="min_confidence"):
            GatewaySettings(min_confidence=value)
    monkeypatch.setenv("OPENBOOK_GATEWAY_MIN_CONFIDENCE", "2")
    with pytest.raises(ValidationError, match="min_confidence"):
        GatewaySettings()
    monkeypatch.setenv("OPENBOOK_GATEWAY_MIN_CONFIDENCE", "0.4")
    assert GatewaySettings().min_confidence == 0.4
    monkeypatch.delenv("OPENBOOK_GATEWAY_MIN_CONFIDENCE")
    assert GatewaySettings().min_confidence is None  # off by default


def test_a_chat_completion_carries_the_confidence_and_says_when_it_abstains(urls):
    plain, _ = urls
    chat = {**CHAT, "max_tokens": 8, "k": 3, "use_cache": False, "citation_markers": False}
    answer = _post(plain, {**ASK, "use_cache": False})
    reply = _post(plain, chat, "/v1/chat/completions")
    assert reply["choices"][0]["message"]["content"] == answer["answer"]
    assert reply["openbook"]["confidence"] == answer["confidence"]
    assert reply["openbook"]["abstained"] is False
    withheld = _post(plain, {**chat, "min_confidence": 0.9}, "/v1/chat/completions")
    content = withheld["choices"][0]["message"]["content"]
    assert content == (
        f"I am not confident enough to answer (confidence {answer['confidence']:.2f} < 0.90)."
    )
    assert withheld["openbook"]["abstained"] is True
    assert withheld["openbook"]["min_confidence"] == 0.9
    assert withheld["citations"]  # the passages are still cited


def test_a_streamed_chat_completion_abstains_in_its_content(urls):
    plain, strict = urls
    chat = {**CHAT, "max_tokens": 8, "k": 3, "use_cache": False, "citation_markers": False}

    def streamed(url: str, body: dict) -> tuple[str, dict]:
        chunks = [
            e.json() for e in _stream(url, body, "/v1/chat/completions") if e.data != "[DONE]"
        ]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        (extra,) = [c["openbook"] for c in chunks if "openbook" in c]
        return text, extra

    whole = _post(plain, chat, "/v1/chat/completions")
    text, extra = streamed(plain, chat)
    assert text == whole["choices"][0]["message"]["content"]
    assert extra["confidence"] == whole["openbook"]["confidence"] and not extra["abstained"]
    # under a threshold (the request's, or the server's default) no answer text is sent
    # before the confidence is known: only the abstention
    for url, body in ((plain, {**chat, "min_confidence": 1.0}), (strict, chat)):
        text, extra = streamed(url, body)
        assert text.startswith("I am not confident enough to answer (confidence ")
        assert extra["abstained"] is True and extra["confidence"] == whole["openbook"]["confidence"]
    # a threshold it clears: the whole answer, at the end
    text, extra = streamed(plain, {**chat, "min_confidence": 0.0})
    assert text == whole["choices"][0]["message"]["content"] and not extra["abstained"]
