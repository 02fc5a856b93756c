"""Passage-drafted speculative decoding (openbook/rag/drafting.py): greedy RAG-Token answers,
token log-probs and passage posteriors are those of the undrafted decode, alone and among
other requests of a continuously batched engine, whether drafts are accepted or rejected; a
rejected draft token never stays in the output or the cache."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from transformers.cache_utils import DynamicLayer

from openbook.rag import DecodingOptions
from openbook.rag.backends.base import FedLogProbs
from openbook.rag.cache import GrowingLayer, drop_trailing, growing
from openbook.rag.drafting import PassageDrafter
from openbook.rag.rag_sequence import PassageRows
from openbook.rag.rag_token import RagTokenRows
from openbook.types import Passage
from openbook_testkit.rag import QUESTION, make_passages

KINDS = ("llama", "gemma3", "bart")
QUESTIONS = (QUESTION, "Who wrote Hamlet?", "Where is the tower?", "How high is Everest?")
DRAFT = 6


def _model(dirs, kind):
    """A tiny model of ``kind``: a causal architecture, or BART (its own decoding path)."""
    return dirs.bart(0) if kind == "bart" else dirs.causal(kind)


def _decode(gen, requests, draft_tokens, steps=None):
    """Results (tag order) of ``requests`` [(arrives at step, question, passages, options)]
    decoded by one engine; ``steps`` collects (engine, state) after every step."""
    gen.set_draft_tokens(draft_tokens)
    try:
        results = {}
        with torch.inference_mode():
            engine = gen.engine()
            step = 0
            while len(results) < len(requests):
                for i, (arrives, q, ps, o) in enumerate(requests):
                    if arrives == step:
                        engine.add(q, ps, o, tag=i)
                for tag, outcome in engine.step():
                    results[tag] = outcome
                if steps is not None:
                    steps.append(engine)
                step += 1
        return [results[i] for i in range(len(requests))], engine
    finally:
        gen.set_draft_tokens(0)


def _assert_same(got, want):
    assert got.doc_prior == pytest.approx(want.doc_prior, abs=1e-6)
    assert [h.token_ids for h in got.hypotheses] == [h.token_ids for h in want.hypotheses]
    for a, b in zip(got.hypotheses, want.hypotheses, strict=True):
        assert a.text == b.text
        assert a.finish_reason == b.finish_reason
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
        if b.token_log_probs is not None:
            assert a.token_log_probs == pytest.approx(b.token_log_probs, abs=1e-4)
        if b.token_doc_posteriors is not None:
            for x, y in zip(a.token_doc_posteriors, b.token_doc_posteriors, strict=True):
                assert x == pytest.approx(y, abs=1e-4)


def _copying(gen, monkeypatch, continuations):
    """Drafts are looked up in each passage's prompt followed by ``continuations`` (the tiny
    random model's own answers, whole or corrupted): the tokens it would copy from a passage
    that holds its answer, whatever the tokenizer makes of text."""
    backend = gen.backend
    own = type(backend).draft_sources

    def sources(question, passages):
        return [
            ids + [t for c in continuations for t in c] for ids in own(backend, question, passages)
        ]

    monkeypatch.setattr(backend, "draft_sources", sources)


def _drafted_as_undrafted(gen, monkeypatch, request, want, variants) -> tuple[int, int]:
    """Decode ``request`` drafting from each of ``variants`` in turn (the continuations
    :func:`_copying` puts after the passages: none, the answer, corrupted, cut short); every
    result is the undrafted ``want``. The draft tokens proposed and accepted, summed."""
    drafted = accepted = 0
    for continuations in variants:
        with monkeypatch.context() as patch:
            _copying(gen, patch, continuations)
            (got,), engine = _decode(gen, request, DRAFT)
        _assert_same(got, want)
        drafted += engine.drafted_tokens
        accepted += engine.accepted_tokens
    return drafted, accepted


def _corrupted(ids, rnd):
    out = list(ids)
    for _ in range(max(1, len(out) // 6)):
        i = rnd.randrange(len(out))
        out[i] = (out[i] + 1 + rnd.randrange(50)) % 250 + 3
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_drafted_greedy_rag_token_is_the_undrafted_decode(dirs, load, kind, monkeypatch):
    gen = load(_model(dirs, kind))
    rnd = random.Random(kind)
    drafted = accepted = 0
    for seed in range(8):
        k = rnd.choice((1, 2, 3, 5))
        passages = make_passages(k, seed=seed)
        options = DecodingOptions(max_new_tokens=rnd.choice((5, 12, 20)))
        request = [(0, rnd.choice(QUESTIONS), passages, options)]
        (want,), _ = _decode(gen, request, 0)
        answer = want.hypotheses[0].token_ids
        variants = ([], [answer], [_corrupted(answer, rnd)], [answer[: len(answer) // 2]])
        d, a = _drafted_as_undrafted(gen, monkeypatch, request, want, variants)
        drafted, accepted = drafted + d, accepted + a
    # drafts were both accepted and rejected
    assert 0 < accepted < drafted


@pytest.mark.parametrize("mode", ("rag-sequence-fast", "rag-sequence-thorough"))
@pytest.mark.parametrize("kind", KINDS)
def test_drafted_greedy_rag_sequence_is_the_undrafted_decode(dirs, load, kind, mode, monkeypatch):
    """Each passage drafts from its own text for its own hypothesis: the ranked answers, their
    log-probs and passage posteriors are those of the undrafted decode."""
    gen = load(_model(dirs, kind))
    rnd = random.Random(f"{kind}{mode}")
    drafted = accepted = 0
    for seed in range(5):
        k = rnd.choice((1, 2, 3, 4))
        passages = make_passages(k, seed=seed)
        options = DecodingOptions(mode=mode, max_new_tokens=rnd.choice((6, 12, 18)))
        question = rnd.choice(QUESTIONS)
        request = [(0, question, passages, options)]
        (want,), _ = _decode(gen, request, 0)
        # each passage's own greedy answer: its search decodes under it alone
        own = [_decode(gen, [(0, question, [p], options)], 0)[0][0] for p in passages]
        answers = [r.hypotheses[0].token_ids for r in own]
        variants = (
            [],
            answers,
            [_corrupted(a, rnd) for a in answers],
            [a[: len(a) // 2] for a in answers],
        )
        d, a = _drafted_as_undrafted(gen, monkeypatch, request, want, variants)
        drafted, accepted = drafted + d, accepted + a
    assert 0 < accepted < drafted


@pytest.mark.parametrize("kind", KINDS)
def test_passages_holding_the_answer_text_decode_as_undrafted(dirs, load, kind):
    """Through the real draft sources (the passages' prompts): a passage that holds the answer
    the model gives without it."""
    gen = load(_model(dirs, kind))
    options = DecodingOptions(max_new_tokens=16)
    for seed in range(4):
        passages = make_passages(3, seed=seed)
        (first,), _ = _decode(gen, [(0, QUESTION, passages, options)], 0)
        text = gen.tokenizer.decode(first.hypotheses[0].token_ids, skip_special_tokens=True)
        holding = [Passage(p.id, p.title, f"{p.text} {text} {p.text}", p.score) for p in passages]
        request = [(0, QUESTION, holding, options)]
        (want,), _ = _decode(gen, request, 0)
        (got,), _ = _decode(gen, request, DRAFT)
        _assert_same(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_drafting_requests_in_a_continuous_batch_decode_as_alone(dirs, load, kind, monkeypatch):
    """Drafting requests (greedy RAG-Token and RAG-Sequence) and undrafted ones (beam search,
    sampling) join one running batch at different steps; rows of different requests keep
    different numbers of tokens."""
    gen = load(_model(dirs, kind))
    greedy = DecodingOptions(max_new_tokens=14)
    arrivals = [
        (0, QUESTION, 3, greedy),
        (0, "Who wrote Hamlet?", 2, DecodingOptions(num_beams=2, max_new_tokens=6)),
        (1, "Where is the tower?", 4, greedy),
        (2, QUESTION, 2, DecodingOptions(mode="rag-sequence-thorough", max_new_tokens=5)),
        (2, QUESTION, 2, DecodingOptions(temperature=1.3, seed=4, max_new_tokens=7)),
        (3, "How high is Everest?", 1, DecodingOptions(max_new_tokens=20, min_new_tokens=20)),
        (5, "Who wrote Hamlet?", 5, greedy),
    ]
    requests = [(t, q, make_passages(k, seed), o) for seed, (t, q, k, o) in enumerate(arrivals)]
    alone = [_decode(gen, [(0, q, ps, o)], 0)[0][0] for _, q, ps, o in requests]
    answers = [r.hypotheses[0].token_ids for r in alone]
    rnd = random.Random(1)
    _copying(gen, monkeypatch, [answers[0], _corrupted(answers[2], rnd), answers[5][:9]])
    got, engine = _decode(gen, requests, DRAFT)
    for a, b in zip(got, alone, strict=True):
        _assert_same(a, b)
    assert 0 < engine.accepted_tokens < engine.drafted_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_a_rejected_draft_leaves_neither_output_nor_cache(dirs, load, kind, monkeypatch):
    """After every step, the drafting engine's cache holds exactly the keys/values of the
    tokens decided and fed so far: the undrafted engine's at the same point, slot for slot
    (and, for BART, whose positions are per row, the same next positions)."""
    gen = load(_model(dirs, kind))
    real_slots = _real_bart_slots if kind == "bart" else _real_slots
    options = DecodingOptions(max_new_tokens=18, min_new_tokens=18)
    passages = make_passages(3, seed=2)
    request = [(0, QUESTION, passages, options)]
    plain_states = {}

    def record(gen_, draft):
        gen_.set_draft_tokens(draft)
        out = []
        try:
            with torch.inference_mode():
                engine = gen_.engine()
                engine.add(QUESTION, passages, options)
                while engine.pending():
                    engine.step()
                    if engine._state is None:
                        break
                    ((_, group),) = engine._groups
                    decided = int(group.search.seq.shape[1])
                    out.append((decided, *real_slots(engine._state)))
        finally:
            gen_.set_draft_tokens(0)
        return out, engine

    plain, _ = record(gen, 0)
    for decided, positions, keys in plain:
        plain_states[decided] = (positions, keys)
    (want,), _ = _decode(gen, request, 0)
    answer = want.hypotheses[0].token_ids
    rnd = random.Random(3)
    _copying(gen, monkeypatch, [_corrupted(answer, rnd), _corrupted(answer, rnd)])
    drafted, engine = record(gen, DRAFT)
    assert engine.drafted_tokens > engine.accepted_tokens > 0  # rejections happened
    for decided, positions, keys in drafted:
        want_pos, want_keys = plain_states[decided]
        # as many real slots, at the same positions, as the undrafted decode: the decided
        # tokens but the last (not fed yet) after the prompt
        assert positions == want_pos
        for got_layer, want_layer in zip(keys, want_keys, strict=True):
            for g, w in zip(got_layer, want_layer, strict=True):
                torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
    (got,), _ = _decode(gen, request, DRAFT)
    _assert_same(got, want)


@pytest.mark.parametrize("kind", KINDS)
def test_the_lm_head_runs_only_for_the_positions_read(dirs, load, kind, monkeypatch):
    """A drafted step feeds the decided token and up to DRAFT drafted ones to every row, but
    the LM head runs over a position only once the search accepted every drafted token before
    it: over a whole decode, once per row and decided token, as without drafting."""
    gen = load(_model(dirs, kind))
    if kind != "bart":
        assert gen.backend._own_head  # else the model's forward computes every position's logits
    options = DecodingOptions(max_new_tokens=18, min_new_tokens=18)
    passages = make_passages(3, seed=2)
    request = [(0, QUESTION, passages, options)]
    (want,), _ = _decode(gen, request, 0)
    answer = want.hypotheses[0].token_ids
    _copying(gen, monkeypatch, [_corrupted(answer, random.Random(3))])
    head_rows: list[int] = []
    own_init = FedLogProbs.__init__

    def counting_init(self, hidden, head):
        if getattr(head, "counted", False):  # FedLogProbs.cat keeps its parts' head
            own_init(self, hidden, head)
            return

        def counted(h):
            head_rows.append(h.shape[0])
            return head(h)

        counted.counted = True  # type: ignore[attr-defined]
        own_init(self, hidden, counted)

    monkeypatch.setattr(FedLogProbs, "__init__", counting_init)
    (got,), engine = _decode(gen, request, DRAFT)
    _assert_same(got, want)
    assert engine.drafted_tokens > engine.accepted_tokens > 0  # drafts accepted and rejected
    # every token from one position's head: the first from the prompt's last position (a
    # causal model's prefill runs the same deferred head; BART's encoder computes it apart)
    heads = len(answer) - 1 if kind == "bart" else len(answer)
    assert sum(head_rows) == len(passages) * heads


def _real_slots(state):
    """A causal state's rows' real (non-padding, non-hole) slots: their positions, and per
    layer, per row, their keys."""
    assert all(layer.keys.shape[-2] == state.kv_pos.shape[1] for layer in state.cache.layers), (
        "the cache and kv_pos disagree on the slots"
    )
    real = state.kv_pos >= 0
    positions = [row[row >= 0].tolist() for row in state.kv_pos]
    keys = [
        [layer.keys[r][:, real[r]].clone() for r in range(real.shape[0])]
        for layer in state.cache.layers
    ]
    return positions, keys


def _real_bart_slots(state):
    """A BART state's rows' next positions and real (unmasked) slots' keys per layer, per row."""
    width = state.cache[0][0].shape[2]
    mask = state.self_mask
    if mask is None:
        mask = torch.ones(state.positions.shape[0], width, dtype=torch.bool)
    assert mask.shape[1] == width, "the cache and self_mask disagree on the slots"
    keys = [[k[r][:, mask[r]].clone() for r in range(mask.shape[0])] for k, _ in state.cache]
    return state.positions.tolist(), keys


@pytest.mark.parametrize("kind", KINDS)
def test_a_drafted_stream_is_the_final_hypothesis(dirs, load, kind, monkeypatch):
    gen = load(_model(dirs, kind))
    options = DecodingOptions(max_new_tokens=16)
    passages = make_passages(4, seed=3)
    want = gen.generate(QUESTION, passages, options)
    _copying(gen, monkeypatch, [want.hypotheses[0].token_ids])
    events = []
    gen.set_draft_tokens(DRAFT)
    try:
        got = gen.generate(QUESTION, passages, options, on_token=events.append)
    finally:
        gen.set_draft_tokens(0)
    _assert_same(got, want)
    best = got.hypotheses[0]
    assert [e.token_id for e in events] == best.token_ids
    for event, posterior in zip(events, best.token_doc_posteriors, strict=True):
        assert event.doc_posterior == pytest.approx(posterior, abs=1e-5)


def test_only_greedy_searches_draft(dirs, load):
    gen = load(dirs.causal("llama"))
    gen.set_draft_tokens(DRAFT)
    try:
        engine = gen.engine()
        passages = make_passages(2)
        with torch.inference_mode():
            for mode in ("rag-token", "rag-sequence-fast", "rag-sequence-thorough"):
                for options, drafts in (
                    (DecodingOptions(mode=mode), True),
                    (DecodingOptions(mode=mode, num_beams=2), False),
                    (DecodingOptions(mode=mode, temperature=0.7, seed=1), False),
                ):
                    running = engine.add(QUESTION, passages, options)
                    kind = RagTokenRows if mode == "rag-token" else PassageRows
                    assert all(isinstance(g, kind) for g in running.groups)
                    assert all((g.drafter is not None) == drafts for g in running.groups)
    finally:
        gen.set_draft_tokens(0)


def test_bart_drafts_on_its_own_decoding_path(dirs, load):
    gen = load(dirs.bart(0))
    gen.set_draft_tokens(DRAFT)
    try:
        assert gen.draft_tokens == DRAFT and gen.engine().draft_tokens == DRAFT
    finally:
        gen.set_draft_tokens(0)


def test_drafts_follow_the_longest_match_then_the_posterior():
    drafter = PassageDrafter([[5, 6, 7, 8, 9], [1, 6, 7, 2, 3], [7, 4, 4]])
    # "6 7" in passages 0 and 1: the more probable one drafts
    assert drafter.propose([6, 7], 2, [0.0, -1.0, 0.0]) == [8, 9]
    assert drafter.propose([6, 7], 2, [-1.0, 0.0, 0.0]) == [2, 3]
    # the longer match wins over the posterior; "7" alone matches passage 2's start too
    assert drafter.propose([5, 6, 7], 4, [-9.0, 0.0, 0.0]) == [8, 9]
    assert drafter.propose([0, 7], 3, [-9.0, -9.0, 0.0]) == [4, 4]
    assert drafter.propose([42], 3, [0.0, 0.0, 0.0]) == []
    assert drafter.propose([6, 7], 0, [0.0, 0.0, 0.0]) == []


def test_dropping_trailing_slots_rewinds_only_an_unshared_buffer():
    layer = DynamicLayer()
    layer.update(torch.zeros(1, 1, 3, 2), torch.zeros(1, 1, 3, 2))
    cache = type("C", (), {"layers": [layer]})()
    growing(cache)
    (grown,) = cache.layers
    assert isinstance(grown, GrowingLayer)
    grown.update(torch.ones(1, 1, 4, 2), torch.ones(1, 1, 4, 2))
    buffer = grown.keys.data_ptr()
    drop_trailing(cache, 3)
    assert grown.keys.shape[-2] == 4
    # appended in place, over the dropped slots: no copy
    grown.update(torch.full((1, 1, 1, 2), 2.0), torch.full((1, 1, 1, 2), 2.0))
    assert grown.keys.data_ptr() == buffer
    assert grown.keys[0, 0, :, 0].tolist() == [0, 0, 0, 1, 2]

    other = copy.copy(grown)  # holds a view of the buffer up to its end
    drop_trailing(cache, 2)
    grown.update(torch.full((1, 1, 2, 2), 3.0), torch.full((1, 1, 2, 2), 3.0))
    assert other.keys[0, 0, :, 0].tolist() == [0, 0, 0, 1, 2]  # never written under it
    assert grown.keys[0, 0, :, 0].tolist() == [0, 0, 0, 3, 3]
