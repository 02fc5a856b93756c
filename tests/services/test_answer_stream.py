"""POST /answer with "stream": true over a real uvicorn, retriever, generator and Redis: token
events as the answer is written, then the same body the plain request gets; a cached answer
streams too; a client that goes away stops its generation; bad input is a plain HTTP error."""

from __future__ import annotations

import time

import httpx
import pytest

from openbook_testkit.approx import assert_same_up_to_float_noise
from openbook_testkit.rag import make_tiny_causal_lm
from openbook_testkit.sse import read_events
from openbook_testkit.stack import running_backends, serving_gateway

# what the generator's passage cache held depends on the requests before
PER_REQUEST = ("request_id", "timings_ms", "cached", "cached_prompt_tokens")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("answer-stream")
    model = make_tiny_causal_lm(tmp / "llama", arch="llama")
    with (
        running_backends(tmp, redis_server.url, generator_model=model) as backends,
        serving_gateway(backends.gateway_settings(redis_server.url)) as url,
    ):
        yield backends, url


def _stream(url: str, body: dict) -> list:
    with httpx.stream("POST", f"{url}/answer", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return list(read_events(r.iter_lines()))


def _same_answer(streamed: dict, plain: dict) -> None:
    assert_same_up_to_float_noise(
        {k: v for k, v in streamed.items() if k not in PER_REQUEST},
        {k: v for k, v in plain.items() if k not in PER_REQUEST},
    )


def test_tokens_arrive_then_the_answer(stack):
    _, url = stack
    body = {"question": "Who wrote Hamlet?", "k": 3, "max_new_tokens": 12, "use_cache": False}
    events = _stream(url, body)
    names = [e.event for e in events]
    assert names[-1] == "answer" and set(names[:-1]) == {"token"} and len(names) > 2
    answer = events[-1].json()
    plain = httpx.post(f"{url}/answer", json=body, timeout=60).json()
    _same_answer(answer, plain)
    tokens = [e.json() for e in events[:-1]]
    assert "".join(t["text"] for t in tokens if t["passage"] is None) == answer["answer"]
    decided = [t for t in tokens if t["token"] is not None]
    best = answer["hypotheses"][0]
    assert [t["token"] for t in decided] == [t["token"] for t in best["tokens"]]
    for got, final in zip(decided, best["tokens"], strict=True):
        assert got["posterior"] == pytest.approx(final["posterior"], abs=1e-5)
    assert best["num_tokens"] == len(decided)
    assert best["finish_reason"] in ("stop", "length")
    assert answer["prompt_tokens"] > 0


def test_a_cached_answer_streams_too(stack):
    _, url = stack
    body = {"question": "Who discovered penicillin?", "k": 2, "max_new_tokens": 8}
    first = _stream(url, body)
    again = _stream(url, body)
    assert (first[-1].json()["cached"], again[-1].json()["cached"]) == (False, True)
    _same_answer(again[-1].json(), first[-1].json())
    replayed = [e.json() for e in again[:-1]]
    assert "".join(t["text"] for t in replayed) == again[-1].json()["answer"]
    # replayed: the stored hypothesis' tokens and posteriors
    stored = first[-1].json()["hypotheses"][0]["tokens"]
    assert [t["token"] for t in replayed if t["token"] is not None] == [t["token"] for t in stored]


@pytest.mark.parametrize(
    "options",
    [{"decoding": "rag-sequence-thorough"}, {"num_beams": 2, "num_return_sequences": 2}],
)
def test_modes_that_decide_at_the_end_send_the_answer_text_last(stack, options):
    _, url = stack
    body = {"question": "Where is the tower?", "k": 2, "max_new_tokens": 6, "use_cache": False}
    events = _stream(url, {**body, **options})
    tokens = [e.json() for e in events if e.event == "token"]
    answer = events[-1].json()
    assert [t["text"] for t in tokens if t["passage"] is None] == (
        [answer["answer"]] if answer["answer"] else []
    )
    if options.get("decoding"):  # greedy RAG-Sequence: every passage's hypothesis streamed
        assert {t["passage"] for t in tokens if t["token"] is not None} == {0, 1}


def test_bad_input_is_a_plain_http_error(stack):
    _, url = stack
    reply = httpx.post(f"{url}/answer", json={"question": "", "stream": True}, timeout=30)
    assert reply.status_code == 422
    assert reply.json()["detail"][0]["loc"][-1] == "question"
    reply = httpx.post(f"{url}/answer", json={"question": "x", "stream": "yes"}, timeout=30)
    assert reply.status_code == 422


def test_a_client_that_goes_away_stops_its_generation(stack):
    backends, url = stack
    scheduler = backends.generator_servicer.scheduler
    drops: list[str] = []
    original = scheduler._on_running_drop
    scheduler._on_running_drop = lambda where, n: drops.append(where)
    body = {
        "question": "Who wrote Hamlet?",
        "k": 3,
        "max_new_tokens": 512,
        "min_new_tokens": 512,
        "use_cache": False,
        "stream": True,
    }
    try:
        with httpx.stream("POST", f"{url}/answer", json=body, timeout=60) as reply:
            lines = reply.iter_lines()
            first = next(read_events(lines))
            assert first.event == "token"
        # the connection is closed: the gateway cancels the call, the generator drops the rows
        deadline = time.monotonic() + 30
        while (scheduler.running() or not drops) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert scheduler.running() == 0 and drops == ["running"]
    finally:
        scheduler._on_running_drop = original
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'openbook_gateway_streams_total{api="answer",outcome="disconnected"} 1.0' in metrics


def test_a_failure_after_the_stream_began_ends_it_with_an_error_event(stack, redis_server):
    from fastapi import HTTPException
    from fastapi.testclient import TestClient

    from openbook.v1 import generator_pb2
    from openbook_gateway.app import create_app

    backends, _ = stack

    async def failing_stream(request, request_id):
        token = generator_pb2.TokenEvent(token_id=1, token="A", text="A")
        yield generator_pb2.GenerateEvent(token=token)
        raise HTTPException(503, "generator unavailable: it went away")

    body = {"question": "Who wrote Hamlet?", "k": 2, "use_cache": False, "stream": True}
    chat = {
        "model": "openbook",
        "messages": [{"role": "user", "content": "Who wrote Hamlet?"}],
        "stream": True,
        "use_cache": False,
    }
    with TestClient(create_app(backends.gateway_settings(redis_server.url))) as client:
        client.app.state.services.generator.generate_stream = failing_stream
        with client.stream("POST", "/answer", json=body) as reply:
            events = list(read_events(reply.iter_lines()))
        assert [e.event for e in events] == ["token", "error"]
        error = events[-1].json()
        assert error["status"] == 503 and "went away" in error["detail"]
        assert error["request_id"] == reply.headers["x-request-id"]
        with client.stream("POST", "/v1/chat/completions", json=chat) as reply:
            events = list(read_events(reply.iter_lines()))
        assert events[-1].json()["error"]["type"] == "server_error"
        assert "went away" in events[-1].json()["error"]["message"]
        assert all(e.data != "[DONE]" for e in events)
