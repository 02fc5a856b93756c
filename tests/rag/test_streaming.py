"""Streaming (openbook/rag/streaming.py): the tokens a greedy request streams are the tokens of
its final hypothesis, with the same per-token passage posteriors, and their texts add up to its
answer; streaming changes nothing about the result, alone or among other requests."""

from __future__ import annotations

import pytest
import torch

from openbook.rag import DecodingOptions
from openbook.rag.streaming import TextStream
from openbook_testkit.rag import QUESTION, make_passages

KINDS = ("bart", "llama", "gemma3")
TOKEN_GREEDY = DecodingOptions(max_new_tokens=8)
SEQ_GREEDY = DecodingOptions(mode="rag-sequence-thorough", max_new_tokens=6)


def _generator(dirs, load, kind):
    return load(dirs.bart(0) if kind == "bart" else dirs.causal(kind))


@pytest.mark.parametrize("kind", KINDS)
def test_rag_token_stream_is_the_final_hypothesis(dirs, load, kind):
    gen = _generator(dirs, load, kind)
    passages = make_passages(4, seed=3)
    events = []
    streamed = gen.generate(QUESTION, passages, TOKEN_GREEDY, on_token=events.append)
    plain = gen.generate(QUESTION, passages, TOKEN_GREEDY)
    best = streamed.hypotheses[0]
    assert [h.token_ids for h in streamed.hypotheses] == [h.token_ids for h in plain.hypotheses]
    assert [e.token_id for e in events] == best.token_ids
    assert [e.token for e in events] == best.tokens
    assert all(e.passage is None for e in events)
    for event, posterior in zip(events, best.token_doc_posteriors, strict=True):
        assert event.doc_posterior == pytest.approx(posterior, abs=1e-5)
    # what is held back at the end (an incomplete character here) comes with the final answer
    assert best.text.startswith("".join(e.text for e in events))


@pytest.mark.parametrize("kind", KINDS)
def test_rag_sequence_streams_every_passage_hypothesis(dirs, load, kind):
    gen = _generator(dirs, load, kind)
    k = 3
    passages = make_passages(k, seed=5)
    events = []
    result = gen.generate(QUESTION, passages, SEQ_GREEDY, on_token=events.append)
    plain = gen.generate(QUESTION, passages, SEQ_GREEDY)
    assert [h.token_ids for h in result.hypotheses] == [h.token_ids for h in plain.hypotheses]
    per_passage = {z: [e.token_id for e in events if e.passage == z] for z in range(k)}
    assert all(e.doc_posterior is None for e in events)
    # the answer is one passage's greedy hypothesis: the one streamed for some passage
    best = result.hypotheses[0].token_ids
    assert any(tokens == best for tokens in per_passage.values())
    for z in range(k):
        alone = gen.generate(QUESTION, [passages[z]], SEQ_GREEDY)
        assert per_passage[z] == alone.hypotheses[0].token_ids


def test_beam_search_streams_nothing(dirs, load):
    gen = load(dirs.causal("llama"))
    events = []
    options = DecodingOptions(num_beams=2, max_new_tokens=5)
    gen.generate(QUESTION, make_passages(2), options, on_token=events.append)
    assert events == []


def test_streams_in_a_shared_batch_stay_apart(dirs, load):
    gen = load(dirs.causal("gemma3"))
    requests = [
        (QUESTION, make_passages(3, seed=1), TOKEN_GREEDY),
        ("Who wrote Hamlet?", make_passages(2, seed=2), SEQ_GREEDY),
        ("Where is the tower?", make_passages(4, seed=4), TOKEN_GREEDY),
    ]
    events: dict[int, list] = {i: [] for i in range(len(requests))}
    results = {}
    with torch.inference_mode():
        engine = gen.engine()
        for i, (question, passages, options) in enumerate(requests):
            engine.add(question, passages, options, tag=i, on_token=events[i].append)
            for tag, outcome in engine.step():  # the next request joins mid-decode
                results[tag] = outcome
        while len(engine):
            for tag, outcome in engine.step():
                results[tag] = outcome
    for i in (0, 2):
        alone = gen.generate(*requests[i])
        assert results[i].hypotheses[0].token_ids == alone.hypotheses[0].token_ids
        assert [e.token_id for e in events[i]] == alone.hypotheses[0].token_ids
    assert {e.passage for e in events[1]} == {0, 1}


def _spell(pieces: dict[int, str]):
    return lambda ids: "".join(pieces[i] for i in ids).strip()


def test_text_stream_holds_back_what_may_change():
    pieces = {1: "The", 2: " cap", 3: "ital", 4: " ", 5: "E", 6: "N", 7: "D", 8: "\ufffd"}
    stream = TextStream(_spell(pieces), stops=["END"])
    assert stream.push(1) == "The"
    assert stream.push(2) == " cap"
    assert stream.push(4) == ""  # trailing space: the final answer strips it
    assert stream.push(3) == " ital"
    assert stream.push(5) == ""  # may be the start of the stop string "END"
    assert stream.push(6) == ""
    assert stream.push(8) == ""  # an incomplete character


def test_text_stream_releases_a_false_alarm():
    pieces = {1: "A", 2: "E", 3: "x"}
    stream = TextStream(_spell(pieces), stops=["END"])
    assert stream.push(1) == "A"
    assert stream.push(2) == ""
    assert stream.push(3) == "Ex"


def test_text_stream_holds_an_incomplete_answer_prefix():
    pieces = {1: "Ans", 2: "wer:", 3: " Paris"}

    def decode(ids):
        return "".join(pieces[i] for i in ids).removeprefix("Answer:").strip()

    stream = TextStream(decode, lead="Answer:")
    assert stream.push(1) == ""  # "Ans" may become the prefix the decoding removes
    assert stream.push(2) == ""
    assert stream.push(3) == "Paris"
