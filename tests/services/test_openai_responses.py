"""The Responses API, embeddings and the /v1 routes openbook does not serve, through the
official ``openai`` client (and ``langchain-openai``'s Responses mode) over a real uvicorn,
retriever, generator (a tiny random Llama) and Redis.

A response must say what the chat completion of the same question says (same text, same
passages), with each ``[i]`` marker's citation as an annotation at the marker's span; an
embedding must be the vector the retriever searches with (its inner product with a passage's
stored vector is that passage's dense score)."""

from __future__ import annotations

import asyncio
import json

import grpc
import httpx
import numpy as np
import openai
import pytest

from openbook.v1 import retriever_pb2, retriever_pb2_grpc
from openbook_gateway.answering import AnswerOut, TokenOut
from openbook_gateway.openai_format import Completion
from openbook_gateway.openai_schemas import ChatCompletionRequest
from openbook_testkit.approx import assert_same_up_to_float_noise
from openbook_testkit.rag import make_tiny_causal_lm
from openbook_testkit.stack import running_backends, serving_gateway

KEY = "sk-test-key"
QUESTION = "Who wrote Hamlet?"
ASK = [{"role": "user", "content": QUESTION}]
EXTRA = {"k": 3, "use_cache": False}


@pytest.fixture(scope="module")
def backends(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("responses")
    model = make_tiny_causal_lm(tmp / "llama", arch="llama")
    with running_backends(tmp, redis_server.url, generator_model=model) as backends:
        yield backends


@pytest.fixture(scope="module")
def url(backends, redis_server):
    settings = backends.gateway_settings(redis_server.url, api_keys=KEY)
    with serving_gateway(settings) as base:
        yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat(client, **changes):
    request = {"model": "openbook", "messages": ASK, "max_tokens": 10, "extra_body": EXTRA}
    return client.chat.completions.create(**{**request, **changes})


def _check_annotations(text: str, annotations: list, citations: list[dict]) -> None:
    """One annotation per [i] marker, at its span, naming the i-th passage cited."""
    assert annotations, text
    for note in annotations:
        note = note if isinstance(note, dict) else note.model_dump()
        number = note["citation"]
        assert text[note["start_index"] : note["end_index"]] == f"[{number}]"
        cited = citations[number - 1]
        assert note["type"] == "url_citation"
        assert note["passage_id"] == cited["id"] and note["title"] == cited["title"]
        assert note["posterior"] == cited["posterior"] and note["prior"] == cited["prior"]
        assert note["url"].startswith("openbook://facts-a/passages/")
    spans = [a["start_index"] if isinstance(a, dict) else a.start_index for a in annotations]
    assert spans == sorted(spans)


def test_a_sampled_response_is_the_seeded_chat_completion(client):
    """Sampling reaches a response through the chat completion's shared fields: the same seed,
    the same answer on both APIs."""
    sampling = {"temperature": 1.0, "top_p": 0.9}
    chat = _chat(client, **sampling, seed=21, extra_body={**EXTRA, "top_k": 40})
    reply = client.responses.create(
        model="openbook",
        input=QUESTION,
        max_output_tokens=10,
        **sampling,
        extra_body={**EXTRA, "top_k": 40, "seed": 21},
    )
    assert reply.output_text == chat.choices[0].message.content


def test_a_response_says_what_the_chat_completion_says(client):
    chat = _chat(client)
    reply = client.responses.create(
        model="openbook",
        input=QUESTION,
        instructions="Answer from the passages.",
        max_output_tokens=10,
        extra_body=EXTRA,
    )
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status in ("completed", "incomplete") and reply.model == "openbook"
    (item,) = reply.output
    (part,) = item.content
    assert item.role == "assistant" and part.type == "output_text"
    assert reply.output_text == part.text == chat.choices[0].message.content
    assert_same_up_to_float_noise(reply.model_extra["citations"], chat.model_extra["citations"])
    _check_annotations(part.text, part.annotations, reply.model_extra["citations"])
    assert reply.usage.input_tokens == chat.usage.prompt_tokens > 0
    # the passages were read just before (the chat completion): their prompts were cached
    cached = reply.usage.input_tokens_details.cached_tokens
    assert 0 < cached < reply.usage.input_tokens
    assert reply.usage.output_tokens == chat.usage.completion_tokens
    assert reply.usage.total_tokens == chat.usage.total_tokens
    assert reply.model_extra["openbook"]["index"] == "facts-a"
    # the message-list form of input: the last user message is the question
    listed = client.responses.create(
        model="openbook",
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
        ],
        max_output_tokens=10,
        extra_body=EXTRA,
    )
    assert listed.output_text == reply.output_text


def test_a_streamed_response_sends_the_named_events_in_order(client):
    request = {"model": "openbook", "input": QUESTION, "max_output_tokens": 12}
    whole = client.responses.create(**request, extra_body=EXTRA)
    events = list(client.responses.create(**request, stream=True, extra_body=EXTRA))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    notes = [e for e in events if e.type == "response.output_text.annotation.added"]
    final = "response.completed" if whole.status == "completed" else "response.incomplete"
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        *["response.output_text.annotation.added"] * len(notes),
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        final,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert len(deltas) > 2  # the text came token by token
    text = whole.output_text
    assert "".join(deltas) == text == events[-4].text
    whole_notes = whole.output[0].content[0].annotations
    assert [n.annotation.model_dump() for n in notes] == [n.model_dump() for n in whole_notes]
    assert [n.annotation_index for n in notes] == list(range(len(notes)))
    done = events[-1].response
    assert done.output_text == text and done.usage == whole.usage
    assert_same_up_to_float_noise(done.model_extra["citations"], whole.model_extra["citations"])


def test_an_abstaining_response_cites_nothing(client):
    request = {"model": "openbook", "input": QUESTION, "max_output_tokens": 6}
    extra = {**EXTRA, "min_confidence": 1.0}
    reply = client.responses.create(**request, extra_body=extra)
    assert reply.output_text.startswith("I am not confident enough to answer")
    assert reply.output[0].content[0].annotations == []
    assert reply.model_extra["openbook"]["abstained"] is True
    events = list(client.responses.create(**request, stream=True, extra_body=extra))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == reply.output_text  # held back, then sent whole
    assert not [e for e in events if e.type == "response.output_text.annotation.added"]


def test_langchain_responses_mode_gets_the_citations(url):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model="openbook",
        base_url=f"{url}/v1",
        api_key=KEY,
        use_responses_api=True,
        max_retries=0,
        max_tokens=10,
        extra_body=EXTRA,
    )
    message = llm.invoke(QUESTION)
    (block,) = [b for b in message.content if b.get("type") in ("text", "output_text")]
    annotations = block["annotations"]
    assert annotations and all(a["passage_id"] for a in annotations)
    for note in annotations:
        span = block["text"][note["start_index"] : note["end_index"]]
        assert span == f"[{note['citation']}]"
    streamed = list(llm.stream(QUESTION))
    text = "".join(
        b.get("text", "") for chunk in streamed for b in chunk.content if isinstance(b, dict)
    )
    assert text == block["text"]


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"model": "gpt-4o"}, "model"),
        ({"input": "   "}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "system", "content": "Be brief."}]}, "input"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "user", "content": "x" * 5000}]}, "input[0].content"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"text": {"format": {"type": "json_object"}}}, "text.format"),
        ({"extra_body": {"k": 1000}}, "k"),
        ({"extra_body": {"frobnicate": True}}, "frobnicate"),
    ],
)
def test_bad_input_to_responses_names_the_parameter(client, changes, param):
    request = {"model": "openbook", "input": QUESTION, **changes}
    with pytest.raises(openai.APIStatusError) as caught:
        client.responses.create(**request)
    error = caught.value
    assert error.status_code == (404 if param == "model" else 400), error.body
    assert error.param == param, error.body
    assert error.type == "invalid_request_error"


def test_an_unsupported_v1_route_is_an_openai_404(client, url):
    with pytest.raises(openai.NotFoundError) as caught:
        client.completions.create(model="openbook", prompt="Who wrote Hamlet?")
    assert "not supported" in caught.value.message
    assert caught.value.code == "unsupported_endpoint"
    reply = httpx.get(f"{url}/v1/images/generations", headers={"Authorization": f"Bearer {KEY}"})
    assert reply.status_code == 404
    assert "not supported" in reply.json()["error"]["message"]


def _dense_hits(backends, question: str, index: str) -> tuple[list, float]:
    """The top passages of ``question`` by dense retrieval, with their stored vectors, and
    the index's ``score_scale`` (a dense score is the inner product times it)."""
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        request = retriever_pb2.RetrieveRequest(
            queries=[question], k=4, index=index, retrieval="dense", return_vectors=True
        )
        hits = list(stub.Retrieve(request).results[0].passages)
        listed = stub.ListIndexes(retriever_pb2.ListIndexesRequest()).indexes
        (info,) = [i for i in listed if i.name == index]
        return hits, info.score_scale


@pytest.mark.parametrize("model", ["openbook", "openbook/facts-b"])
def test_an_embedding_is_the_vector_the_retriever_searches_with(client, backends, model):
    texts = [QUESTION, "What is the capital of France?"]
    reply = client.embeddings.create(model=model, input=texts)  # base64, as the client asks
    floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens > len(texts)
    index = "facts-b" if model.endswith("facts-b") else "facts-a"
    for text, data, exact in zip(texts, reply.data, floats.data, strict=True):
        vector = np.asarray(data.embedding, dtype=np.float32)
        np.testing.assert_array_equal(vector, np.asarray(exact.embedding, dtype=np.float32))
        hits, scale = _dense_hits(backends, text, index)
        scores = [scale * float(vector @ np.asarray(h.vector, dtype=np.float32)) for h in hits]
        np.testing.assert_allclose(scores, [h.score for h in hits], rtol=1e-4, atol=1e-4)
    single = client.embeddings.create(model=model, input=QUESTION, encoding_format="float")
    np.testing.assert_allclose(single.data[0].embedding, floats.data[0].embedding, atol=1e-5)


@pytest.mark.parametrize(
    ("changes", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ["x"] * 300}, "input"),
        ({"input": ["x" * 5000]}, "input"),
        ({"input": [[1, 2, 3]]}, "input"),
        ({"input": " "}, "input"),
        ({"input": ["q\x00"]}, "input"),  # refused by the retriever, named here
        ({"dimensions": 7}, "dimensions"),
        ({"model": "openbook/nope"}, "model"),
    ],
)
def test_bad_input_to_embeddings_names_the_parameter(client, changes, param):
    request = {"model": "openbook", "input": QUESTION, **changes}
    with pytest.raises(openai.APIStatusError) as caught:
        client.embeddings.create(**request)
    error = caught.value
    assert error.status_code == (404 if param == "model" else 400), error.body
    assert error.param == param, error.body


def test_embed_queries_checks_its_request_once_at_the_top(backends):
    with grpc.insecure_channel(f"127.0.0.1:{backends.retriever_port}") as channel:
        stub = retriever_pb2_grpc.RetrieverStub(channel)
        for request, field in [
            (retriever_pb2.EmbedQueriesRequest(), "queries"),
            (retriever_pb2.EmbedQueriesRequest(queries=["q"] * 300), "queries"),
            (retriever_pb2.EmbedQueriesRequest(queries=["q\x00"]), "queries[0]"),
            (retriever_pb2.EmbedQueriesRequest(queries=["q"], index="../x"), "index"),
        ]:
            with pytest.raises(grpc.RpcError) as err:
                stub.EmbedQueries(request, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert err.value.details().startswith(field)
        reply = stub.EmbedQueries(retriever_pb2.EmbedQueriesRequest(queries=[QUESTION]))
        assert reply.index == "facts-a" and len(reply.embeddings[0].vector) > 0


# The stop fix, on the reply format itself: the tiny random model's answers hold no words to
# stop at, so the answer here is written out (a RAG-Token answer whose tokens cite passage 1).
def _stopped(text: str) -> dict:
    return {
        "hypotheses": [
            {
                "text": text,
                "num_tokens": 3,
                "finish_reason": "length",
                "tokens": [{"posterior": [0.9, 0.1]}] * 3,
            }
        ],
        "passages": [{"id": "p1", "title": "Shakespeare"}, {"id": "p2", "title": "Marlowe"}],
        "index": "facts-a",
        "prompt_tokens": 10,
    }


def _completion(**fields):
    body = ChatCompletionRequest.model_validate({"model": "openbook", "messages": ASK, **fields})
    return Completion(body, "req-1")


def test_a_stop_after_a_space_leaves_one_space_before_the_markers():
    answer = _stopped("the world's greatest playwright")
    (choice,) = _completion(stop=["greatest"]).whole(answer)["choices"]
    assert choice["message"]["content"] == "the world's [1]"
    assert choice["finish_reason"] == "stop"
    bare = _completion(stop=["greatest"], citation_markers=False).whole(answer)
    assert bare["choices"][0]["message"]["content"] == "the world's "


def test_a_streamed_stop_after_a_space_adds_up_to_the_whole_answer():
    async def events():
        for piece in ("the", " world's", " greatest", " playwright"):
            yield TokenOut(piece, piece)
        yield AnswerOut(_stopped("the world's greatest playwright"))

    async def stream() -> str:
        produced = events()
        first = await anext(produced)
        text = ""
        async for chunk in _completion(stop="greatest", stream=True).chunks(first, produced):
            data = chunk.decode().removeprefix("data: ").strip()
            if data != "[DONE]":
                for choice in json.loads(data)["choices"]:
                    text += choice["delta"].get("content") or ""
        return text

    assert asyncio.run(stream()) == "the world's [1]"


def test_a_response_stream_that_fails_ends_with_error_and_response_failed():
    from fastapi import HTTPException

    from openbook_gateway.openai_responses import ResponsesRequest
    from openbook_gateway.responses_format import ResponseReply

    async def events():
        yield TokenOut("the", "the")
        raise HTTPException(503, "generator unavailable")

    async def stream() -> list[dict]:
        body = ResponsesRequest.model_validate({"model": "openbook", "input": QUESTION})
        reply = ResponseReply(body, body.to_chat_request(), "req-2")
        produced = events()
        first = await anext(produced)
        out = []
        async for chunk in reply.events(first, produced):
            head, data = chunk.decode().strip().split("\n")
            out.append(json.loads(data.removeprefix("data: ")))
            assert head == f"event: {out[-1]['type']}"
        return out

    sent = asyncio.run(stream())
    kinds = [e["type"] for e in sent]
    assert kinds[-3:] == ["response.output_text.delta", "error", "response.failed"]
    assert sent[-2]["message"] == "generator unavailable"
    assert sent[-1]["response"]["status"] == "failed"
    assert sent[-1]["response"]["error"]["code"] == "server_error"
