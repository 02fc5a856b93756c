"""The OpenAI-compatible API of the stack `openbook up` starts (docker-compose.yml), used through
the official ``openai`` package as any client would: whole and streamed completions, and a
client that leaves mid-stream, whose generation stops (the generator's metrics show it)."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from openbook_testkit.rag import make_tiny_causal_lm
from openbook_testkit.stack import LocalStack, build_fact_indexes

pytestmark = pytest.mark.e2e

KEY = "sk-e2e"
ASK = [{"role": "user", "content": "Who wrote Hamlet?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    var = tmp_path_factory.mktemp("var")
    build_fact_indexes(var / "indexes")
    make_tiny_causal_lm(var / "models" / "tiny-llama", arch="llama")
    stack = LocalStack(var, generator="tiny-llama", extra_env={"OPENBOOK_GATEWAY_API_KEYS": KEY})
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def client(stack):
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _generator_metric(stack: LocalStack, name: str, labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.ports['gmetrics']}/metrics", timeout=10).text
    match = re.search(rf"^{name}{{{labels}}} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_whole_and_streamed_completions(client):
    request = dict(model="openbook", messages=ASK, max_tokens=10, extra_body={"k": 3})
    whole = client.chat.completions.create(**request)
    assert whole.choices[0].message.content
    assert len(whole.model_extra["citations"]) == 3
    assert whole.usage.total_tokens > whole.usage.prompt_tokens > 0
    stream = client.chat.completions.create(**request, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == whole.choices[0].message.content


def test_a_client_leaving_mid_stream_stops_its_generation(client, stack):
    labels = 'service="generator",where="running"'
    before = _generator_metric(stack, "openbook_dropped_total", labels)
    stream = client.chat.completions.create(
        model="openbook",
        messages=ASK,
        max_tokens=512,
        stream=True,
        extra_body={"k": 3, "min_new_tokens": 512, "use_cache": False},
    )
    received = 0
    for chunk in stream:
        received += bool(chunk.choices and chunk.choices[0].delta.content)
        if received == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while _generator_metric(stack, "openbook_dropped_total", labels) <= before:
        assert time.monotonic() < deadline, "the generator never dropped the abandoned stream"
        time.sleep(0.2)
    gateway = httpx.get(f"{stack.url}/metrics", timeout=10).text
    assert 'openbook_gateway_streams_total{api="openai",outcome="disconnected"} 1.0' in gateway
    # and the stack answers the next client
    assert client.chat.completions.create(model="openbook", messages=ASK, max_tokens=3).choices


def test_the_key_is_required(stack):
    anonymous = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.models.list()


def test_responses_and_embeddings(client):
    """The Responses API (citations as annotations at the markers) and embeddings by the
    retriever process's query encoder, through the stack `openbook up` starts."""
    request = {"model": "openbook", "input": "Who wrote Hamlet?", "max_output_tokens": 8}
    reply = client.responses.create(**request, extra_body={"k": 3})
    (note, *_) = reply.output[0].content[0].annotations
    span = reply.output_text[note.start_index : note.end_index]
    assert span == f"[{note.model_extra['citation']}]" and note.model_extra["passage_id"]
    assert reply.usage.input_tokens > 0
    events = [e.type for e in client.responses.create(**request, stream=True)]
    assert events[0] == "response.created"
    assert events[-1] in ("response.completed", "response.incomplete")
    vectors = client.embeddings.create(model="openbook/facts-b", input=["Who wrote Hamlet?"])
    assert len(vectors.data[0].embedding) == vectors.model_extra["openbook"]["dim"] > 0
