"""The OpenAI-compatible API through the official ``openai`` client, over a real uvicorn,
retriever, generator (a tiny random Llama) and Redis: whole and streamed completions, models,
citations and usage, API keys, and OpenAI-style errors that name the parameter."""

from __future__ import annotations

import httpx
import openai
import pytest

from openbook_testkit.approx import assert_same_up_to_float_noise
from openbook_testkit.rag import make_tiny_causal_lm
from openbook_testkit.stack import running_backends, serving_gateway

KEY = "sk-test-key"
ASK = [{"role": "user", "content": "Who wrote Hamlet?"}]


@pytest.fixture(scope="module")
def url(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("openai")
    model = make_tiny_causal_lm(tmp / "llama", arch="llama")
    with running_backends(tmp, redis_server.url, generator_model=model) as backends:
        settings = backends.gateway_settings(redis_server.url, api_keys=f"other-key,{KEY}")
        with serving_gateway(settings) as base:
            yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _answer(url: str, **body) -> dict:
    reply = httpx.post(f"{url}/answer", json={"use_cache": False, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_models_list_the_active_index_and_every_index(client):
    ids = [m.id for m in client.models.list()]
    assert ids == ["openbook", "openbook/facts-a", "openbook/facts-b"]
    assert client.models.retrieve("openbook/facts-b").id == "openbook/facts-b"


def test_a_completion_is_the_answer_with_citations_and_usage(client, url):
    reply = client.chat.completions.create(
        model="openbook",
        messages=[{"role": "system", "content": "Be brief."}, *ASK],
        max_tokens=8,
        extra_body={"k": 3, "use_cache": False},
    )
    answer = _answer(url, question="Who wrote Hamlet?", k=3, max_new_tokens=8)
    (choice,) = reply.choices
    assert choice.message.role == "assistant"
    assert choice.message.content.startswith(answer["answer"])
    markers = choice.message.content[len(answer["answer"]) :]
    assert markers.startswith(" [") and markers.endswith("]")
    citations = reply.model_extra["citations"]
    assert [c["id"] for c in citations] == [p["id"] for p in answer["passages"]]
    assert [c["index"] for c in citations] == [1, 2, 3]
    assert choice.finish_reason == answer["hypotheses"][0]["finish_reason"]
    assert reply.usage.completion_tokens == answer["hypotheses"][0]["num_tokens"]
    assert reply.usage.prompt_tokens == answer["prompt_tokens"] > 0
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == "openbook" and reply.id.startswith("chatcmpl-")
    assert reply.model_extra["openbook"]["index"] == "facts-a"


def test_usage_counts_the_prompt_tokens_the_generators_passage_cache_held(client):
    """The generator keeps passage prompts' keys/values (its passage cache, on by default):
    asked again over the same passages, their tokens are reported as cached, the question's
    own are not."""

    def ask():
        return client.chat.completions.create(
            model="openbook", messages=ASK, max_tokens=4, extra_body={"k": 3, "use_cache": False}
        )

    ask()
    again = ask()
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < again.usage.prompt_tokens


def test_a_streamed_completion_adds_up_to_the_whole_one(client):
    request = dict(
        model="openbook/facts-b",
        messages=ASK,
        max_tokens=12,
        extra_body={"k": 2, "use_cache": False},
    )
    whole = client.chat.completions.create(**request)
    chunks = list(
        client.chat.completions.create(
            **request, stream=True, stream_options={"include_usage": True}
        )
    )
    contents = [c.choices[0].delta.content for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(1 for text in contents if text) > 2  # the answer came token by token
    assert "".join(text or "" for text in contents) == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason and not any(finishes[:-1])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.total_tokens == whole.usage.total_tokens
    # asked a second time: the generator's passage cache may hold what the first one read
    assert usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens
    cited = [c for c in chunks if c.model_extra.get("citations")]
    assert len(cited) == 1
    assert_same_up_to_float_noise(cited[0].model_extra["citations"], whole.model_extra["citations"])
    assert whole.model_extra["openbook"]["index"] == "facts-b"


def test_n_answers_are_the_best_beams(client, url):
    reply = client.chat.completions.create(
        model="openbook",
        messages=ASK,
        n=2,
        max_tokens=6,
        extra_body={"k": 2, "use_cache": False, "citation_markers": False},
    )
    answer = _answer(
        url,
        question="Who wrote Hamlet?",
        k=2,
        num_beams=2,
        num_return_sequences=2,
        max_new_tokens=6,
    )
    assert [c.message.content for c in reply.choices] == [h["text"] for h in answer["hypotheses"]]
    streamed = client.chat.completions.create(
        model="openbook",
        messages=ASK,
        n=2,
        max_tokens=6,
        stream=True,
        extra_body={"k": 2, "use_cache": False, "citation_markers": False},
    )
    texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert [texts[0], texts[1]] == [c.message.content for c in reply.choices]


def test_stop_cuts_the_answer(client):
    request = dict(
        model="openbook",
        messages=ASK,
        max_tokens=12,
        extra_body={"k": 2, "citation_markers": False},
    )
    text = client.chat.completions.create(**request).choices[0].message.content
    assert len(text) > 3
    stop = text[2:4]
    cut = client.chat.completions.create(**request, stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(**request, stop=stop, stream=True)
    pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
    assert "".join(pieces) == text[: text.find(stop)]


def test_a_wrong_or_missing_key_is_401(url):
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=f"{url}/v1", api_key=key or "x", max_retries=0)
        headers = {} if key else {"Authorization": ""}
        with pytest.raises(openai.AuthenticationError) as caught:
            bad.chat.completions.create(model="openbook", messages=ASK, extra_headers=headers)
        assert caught.value.code == "invalid_api_key"
    # the admin API is not opened by an API key: it is a key with the "ask" scope only (403)
    assert (
        httpx.get(f"{url}/admin/replicas", headers={"Authorization": f"Bearer {KEY}"}).status_code
        == 403
    )


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"model": "gpt-4o"}, "model"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "You are helpful."}]}, "messages"),
        ({"messages": [{"role": "user", "content": "   "}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x" * 5000}]}, "messages[0].content"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": ASK * 300}, "messages"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": 0.7, "top_p": 0}, "top_p"),
        ({"temperature": 0.7, "top_p": 1.2}, "top_p"),
        ({"temperature": 0.7, "extra_body": {"top_k": -1}}, "top_k"),
        ({"temperature": 0.7, "extra_body": {"num_beams": 2}}, "num_beams"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"n": 3, "extra_body": {"num_beams": 2}}, "n"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"extra_body": {"k": 1000}}, "k"),
        ({"extra_body": {"decoding": "rag-magic"}}, "decoding"),
        ({"extra_body": {"index": "facts-b"}, "model": "openbook/facts-a"}, "index"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ],
)
def test_bad_input_is_an_openai_error_naming_the_parameter(client, changes, param):
    request = {"model": "openbook", "messages": ASK, **changes}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    error = caught.value
    assert error.status_code == (404 if param == "model" else 400), error.body
    assert error.param == param, error.body
    assert error.type == "invalid_request_error"
    if param == "model":
        assert error.code == "model_not_found"


def test_temperature_zero_is_greedy_and_accepted(client):
    reply = client.chat.completions.create(
        model="openbook", messages=ASK, temperature=0, top_p=1, seed=7, max_tokens=4
    )
    assert reply.choices[0].message.content is not None


@pytest.mark.parametrize("temperature", [1.0, 0.1, 0.7])  # OpenAI, llama-index, LangChain (<0.3)
def test_client_default_temperatures_sample(client, temperature):
    request = dict(
        model="openbook",
        messages=ASK,
        temperature=temperature,
        max_tokens=6,
        extra_body={"k": 2, "use_cache": False},
    )
    reply = client.chat.completions.create(**request, seed=42)
    again = client.chat.completions.create(**request, seed=42)
    assert reply.choices[0].message.content == again.choices[0].message.content
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_n_samples_are_independent_and_a_seed_repeats_them(client):
    request = dict(
        model="openbook",
        messages=ASK,
        n=4,
        temperature=2.0,
        seed=7,
        max_tokens=6,
        extra_body={"k": 2, "citation_markers": False},
    )
    reply = client.chat.completions.create(**request)
    texts = [c.message.content for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    assert len(set(texts)) > 1  # four draws, not one answer four times
    again = client.chat.completions.create(
        **{**request, "extra_body": {"k": 2, "citation_markers": False, "use_cache": False}}
    )
    assert [c.message.content for c in again.choices] == texts


def test_a_sampled_stream_adds_up_to_the_whole_seeded_answer(client):
    request = dict(
        model="openbook",
        messages=ASK,
        temperature=1.0,
        top_p=0.9,
        seed=3,
        max_tokens=8,
        extra_body={"k": 2, "use_cache": False},
    )
    whole = client.chat.completions.create(**request)
    chunks = list(client.chat.completions.create(**request, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content


def test_a_body_over_the_limit_is_an_openai_413(url):
    huge = {"model": "openbook", "messages": [{"role": "user", "content": "x" * 100_000}]}
    reply = httpx.post(
        f"{url}/v1/chat/completions", json=huge, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == "invalid_request_error"
