"""Conversations, through the official ``openai`` client and ``/answer`` over a real uvicorn,
retriever (MiniLM over the test facts), generator (a tiny random Llama) and Redis.

A follow-up ("When was he born?") is retrieved and answered with the question expanded from
the turns before it, the same on every route (chat completions, responses with an input list
or a ``previous_response_id``, ``/answer``'s ``history``), and says so in ``question_used``.
However long the conversation, what is read of it is bounded; a conversation over the message
limit is a 4xx naming the field."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from openbook.state.redis_protocol import response_key
from openbook.validation.limits import (
    CONVERSATION_TURN_CHARS,
    MAX_CONVERSATION_MESSAGES,
    MAX_HISTORY_MESSAGE_CHARS,
    MAX_QUESTION_CHARS,
)
from openbook_gateway.conversation import Turn, contextual_question, plain, recent
from openbook_gateway.openai_format import abstention
from openbook_testkit.rag import make_tiny_causal_lm
from openbook_testkit.stack import running_backends, serving_gateway

KEY = "sk-test-key"
OTHER_KEY = "sk-other-key"
FIRST = "Who wrote Hamlet?"
ANSWERED = "William Shakespeare"
FOLLOW_UP = "When was he born?"
EXPANDED = f"{FOLLOW_UP} {FIRST} {ANSWERED}"
SHAKESPEARE = "p21"  # the test facts' passage that answers FIRST (openbook_testkit.index)
EXTRA = {"k": 3, "use_cache": False}
CONVERSATION = [
    {"role": "system", "content": "Answer from the passages."},
    {"role": "user", "content": FIRST},
    {"role": "assistant", "content": f"{ANSWERED} [1][2]"},
    {"role": "user", "content": FOLLOW_UP},
]


@pytest.fixture(scope="module")
def url(tmp_path_factory, redis_server):
    tmp = tmp_path_factory.mktemp("conversations")
    model = make_tiny_causal_lm(tmp / "llama", arch="llama")
    with running_backends(tmp, redis_server.url, generator_model=model) as backends:
        settings = backends.gateway_settings(redis_server.url, api_keys=f"{OTHER_KEY},{KEY}")
        with serving_gateway(settings) as base:
            yield base


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _answer(url: str, **body) -> dict:
    reply = httpx.post(f"{url}/answer", json={"use_cache": False, "k": 3, **body}, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()


def _ids(passages: list[dict]) -> list[str]:
    return [p["id"] for p in passages]


def test_a_follow_up_is_retrieved_with_the_turn_it_refers_to(client, url):
    reply = client.chat.completions.create(
        model="openbook", messages=CONVERSATION, max_tokens=8, extra_body=EXTRA
    )
    used = reply.model_extra["openbook"]["question_used"]
    # the question first, then the earlier question and the answer (its markers dropped)
    assert used == EXPANDED
    cited = _ids(reply.model_extra["citations"])
    assert SHAKESPEARE in cited
    # /answer with the same history asks the same question, and finds the same passages
    history = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION[1:3]]
    answer = _answer(url, question=FOLLOW_UP, history=history, max_new_tokens=8)
    assert answer["question_used"] == EXPANDED
    assert _ids(answer["passages"]) == cited
    assert reply.choices[0].message.content.startswith(answer["answer"])
    # that question asked outright: the same passages and answer (the conversation is spent
    # on the question, nothing else)
    outright = _answer(url, question=EXPANDED, max_new_tokens=8)
    # retrieved alike; generated from the text asked (the generator reads the follow-up as
    # the user wrote it), so never the conversation's cached answer
    assert _ids(outright["passages"]) == cited and outright["cached"] is False


def test_a_single_question_is_answered_as_before(client, url):
    """No earlier turns: the question as sent, on every route."""
    answer = _answer(url, question=FOLLOW_UP)
    assert answer["question_used"] == FOLLOW_UP
    reply = client.chat.completions.create(
        model="openbook",
        messages=[{"role": "system", "content": "Be brief."}, CONVERSATION[-1]],
        max_tokens=8,
        extra_body=EXTRA,
    )
    assert reply.model_extra["openbook"]["question_used"] == FOLLOW_UP
    assert _ids(reply.model_extra["citations"]) == _ids(answer["passages"])


def test_a_cached_follow_up_says_what_it_was_asked(url):
    history = [{"role": "user", "content": FIRST}, {"role": "assistant", "content": ANSWERED}]
    body = {"question": FOLLOW_UP, "history": history, "use_cache": True, "k": 3}
    first = httpx.post(f"{url}/answer", json=body, timeout=60).json()
    again = httpx.post(f"{url}/answer", json=body, timeout=60).json()
    assert again["cached"] and again["question_used"] == first["question_used"] == EXPANDED
    assert again["answer"] == first["answer"]


def test_a_streamed_follow_up_carries_the_question_used(client):
    chunks = list(
        client.chat.completions.create(
            model="openbook", messages=CONVERSATION, max_tokens=8, stream=True, extra_body=EXTRA
        )
    )
    extras = [c.model_extra["openbook"] for c in chunks if "openbook" in (c.model_extra or {})]
    assert [e["question_used"] for e in extras] == [EXPANDED]


def test_a_response_reads_the_conversation_in_its_input(client):
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": FIRST}]},
        {
            "type": "message",
            "role": "assistant",
            "content": [{"type": "output_text", "text": f"{ANSWERED} [1]", "annotations": []}],
        },
        {"role": "user", "content": FOLLOW_UP},
    ]
    reply = client.responses.create(
        model="openbook", input=items, max_output_tokens=8, extra_body=EXTRA
    )
    assert reply.model_extra["openbook"]["question_used"] == EXPANDED
    chat = client.chat.completions.create(
        model="openbook", messages=CONVERSATION, max_tokens=8, extra_body=EXTRA
    )
    assert reply.output_text == chat.choices[0].message.content


def test_a_response_continues_the_one_it_names(client, redis_server):
    first = client.responses.create(
        model="openbook", input=FIRST, max_output_tokens=8, extra_body=EXTRA
    )
    assert first.store is True and first.id.startswith("resp_")
    # the answer as a turn to search with (a tiny random model writes control characters)
    said = plain(first.model_extra["openbook"]["hypotheses"][0]["text"])
    second = client.responses.create(
        model="openbook",
        input=FOLLOW_UP,
        previous_response_id=first.id,
        max_output_tokens=8,
        extra_body=EXTRA,
    )
    assert second.previous_response_id == first.id
    used = second.model_extra["openbook"]["question_used"]
    assert used.startswith(f"{FOLLOW_UP} {FIRST}") and FIRST in used
    if said:  # a tiny random model may say nothing
        assert used == f"{FOLLOW_UP} {FIRST} {said}"
    # a chain: the third turn reads the two user turns before it
    third = client.responses.create(
        model="openbook",
        input="Where?",
        previous_response_id=second.id,
        max_output_tokens=8,
        stream=True,
        extra_body=EXTRA,
    )
    # the last event: response.completed, or .incomplete for a text max_output_tokens cut
    done = [e for e in third if e.type in ("response.completed", "response.incomplete")]
    (completed,) = done
    used = completed.response.model_extra["openbook"]["question_used"]
    assert used.startswith(f"Where? {FOLLOW_UP}") and FIRST in used
    assert completed.response.store is True
    # what is kept is the bounded state, sealed: nothing of the response itself
    stored = json.loads(redis_server.client().get(response_key(completed.response.id)))
    turns = json.loads(stored["v"])["turns"]
    assert [t["role"] for t in turns][-2:] == ["user", "assistant"]
    assert all(len(t["content"]) <= CONVERSATION_TURN_CHARS for t in turns)


def test_a_previous_response_that_is_not_there_is_a_400_naming_it(client, url, redis_server):
    kept = client.responses.create(
        model="openbook", input=FIRST, max_output_tokens=4, extra_body=EXTRA
    )
    unkept = client.responses.create(
        model="openbook", input=FIRST, max_output_tokens=4, store=False, extra_body=EXTRA
    )
    assert unkept.store is False
    # forged: a state for an id, written by someone with Redis's password but not the key
    forged = "resp_" + "0" * 32
    redis_server.client().set(response_key(forged), json.dumps({"owner": "", "turns": []}), ex=60)
    other = openai.OpenAI(base_url=f"{url}/v1", api_key=OTHER_KEY, max_retries=0, timeout=60)
    for caller, previous in (
        (client, "resp_nothing"),
        (client, unkept.id),
        (client, forged),
        (other, kept.id),  # another key's response: as if it did not exist
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            caller.responses.create(
                model="openbook", input=FOLLOW_UP, previous_response_id=previous
            )
        assert caught.value.param == "previous_response_id", caught.value.body
        assert caught.value.code == "previous_response_not_found"


def test_a_thousand_turn_conversation_is_refused_naming_the_field(client, url):
    """1,000 turns (short ones: the body stays under the gateway's 64 KiB limit): over the
    message limit, a 4xx naming the list, on every route."""
    turns = [{"role": ("user", "assistant")[i % 2], "content": "x"} for i in range(999)]
    turns.append({"role": "user", "content": FOLLOW_UP})
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="openbook", messages=turns, max_tokens=4)
    assert caught.value.param == "messages", caught.value.body
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model="openbook", input=turns, max_output_tokens=4)
    assert caught.value.param == "input", caught.value.body
    reply = httpx.post(
        f"{url}/answer", json={"question": FOLLOW_UP, "history": turns[:-1]}, timeout=60
    )
    assert reply.status_code == 422 and reply.json()["detail"][0]["loc"] == ["body", "history"]


def test_a_megabyte_conversation_is_a_413(client, url):
    turns = [{"role": "user", "content": "y" * 1000} for _ in range(1000)]
    turns.append({"role": "user", "content": FOLLOW_UP})
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(model="openbook", messages=turns, max_tokens=4)
    assert caught.value.status_code == 413, caught.value.body
    reply = httpx.post(
        f"{url}/answer", json={"question": FOLLOW_UP, "history": turns[:-1]}, timeout=60
    )
    assert reply.status_code == 413


def test_the_longest_conversation_is_answered_from_its_last_turns(client, url):
    """As many messages as allowed, each longer than what is read of it: answered, with a
    question bounded by a question's limit that holds only the last turns."""
    turns = [
        {"role": ("user", "assistant")[i % 2], "content": f"turn {i} " + "z" * 150}
        for i in range(MAX_CONVERSATION_MESSAGES - 1)
    ]
    turns.append({"role": "user", "content": FOLLOW_UP})
    reply = client.chat.completions.create(
        model="openbook", messages=turns, max_tokens=4, extra_body=EXTRA
    )
    used = reply.model_extra["openbook"]["question_used"]
    assert len(used) <= MAX_QUESTION_CHARS and used.startswith(FOLLOW_UP)
    last = MAX_CONVERSATION_MESSAGES - 2  # the last earlier turn (an user's: 254 is even)
    assert f"turn {last} " in used and f"turn {last - 1} " in used and f"turn {last - 2} " in used
    assert "turn 0 " not in used and f"turn {last - 3} " not in used
    # /answer: a history message over its limit is a 422 naming it
    long = [{"role": "user", "content": "w" * (MAX_HISTORY_MESSAGE_CHARS + 1)}]
    reply = httpx.post(f"{url}/answer", json={"question": FOLLOW_UP, "history": long}, timeout=60)
    assert reply.status_code == 422
    assert reply.json()["detail"][0]["loc"] == ["body", "history", 0, "content"]
    # a role other than user or assistant: 422 naming it
    bad = [{"role": "system", "content": "x"}]
    reply = httpx.post(f"{url}/answer", json={"question": FOLLOW_UP, "history": bad}, timeout=60)
    assert reply.status_code == 422
    assert reply.json()["detail"][0]["loc"] == ["body", "history", 0, "role"]


# --- the expansion itself -------------------------------------------------------------------


def test_no_history_leaves_the_question_as_sent():
    assert contextual_question("  who?\n", []) == "  who?\n"
    silent = [Turn("assistant", abstention(0.1, 0.5)), Turn("user", "")]
    assert contextual_question("who?", silent) == "who?"


def test_only_the_last_user_turns_and_the_last_answer_are_read():
    history = [
        Turn("user", "Who is the President of Peru?"),
        Turn("assistant", "Pedro Pablo Kuczynski [1]"),
        Turn("user", "Who was before him?"),
        Turn("assistant", "Ollanta Humala [2][3]"),
    ]
    used = contextual_question("When did he take office?", history)
    assert used == (
        "When did he take office? Who was before him? Ollanta Humala Who is the President of Peru?"
    )
    older = [Turn("user", "What is the capital of Kenya?"), *history]
    assert contextual_question("When did he take office?", older) == used
    assert [t.text for t in recent(older)] == [
        "Who is the President of Peru?",
        "Who was before him?",
        "Ollanta Humala",
    ]


def test_the_question_used_is_bounded_and_clean():
    history = [Turn("user", "a\x00b\tc " + "word " * 500), Turn("assistant", "x" * 5000)]
    used = contextual_question("q?", history)
    assert len(used) <= 2 + 1 + 2 * (CONVERSATION_TURN_CHARS + 1)
    assert "\x00" not in used and "\t" not in used and used.startswith("q? a b c word")
    full = "q" * MAX_QUESTION_CHARS
    assert contextual_question(full, history) == full
    near = "q" * (MAX_QUESTION_CHARS - 10)
    assert len(contextual_question(near, history)) <= MAX_QUESTION_CHARS
