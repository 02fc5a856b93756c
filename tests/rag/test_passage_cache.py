"""Passage prompts' keys/values reused across requests (openbook/rag/passage_cache.py): a passage
seen before costs only its question's tokens, with the same answers as a cold prefill."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from openbook.rag import DecodingOptions
from openbook.rag.backends.causal import _passage_head
from openbook.rag.passage_cache import PassageCache
from openbook.rag.prompting import PromptSpec
from openbook_testkit.rag import QUESTION, make_passages


def _prefilled_tokens(gen, fn) -> int:
    counted: list[int] = []
    hook = gen.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: counted.append(args[0].numel())
    )
    try:
        fn()
    finally:
        hook.remove()
    return sum(counted)


@pytest.fixture
def fresh(dirs, load):
    """A tiny Gemma-3 generator (sliding-window layers) with an empty passage cache."""
    gen = load(dirs.causal("gemma3"))
    gen.backend.set_passage_cache(64 * 2**20)
    yield gen
    gen.backend.set_passage_cache(64 * 2**20)


@torch.inference_mode()
def test_a_passage_seen_before_prefills_only_the_question(fresh):
    gen = fresh
    b = gen.backend
    passages = make_passages(3, 5)
    prompts = [b.prompt_ids(QUESTION, p) for p in passages]
    heads = [b.head_length(p, ids) for p, ids in zip(passages, prompts, strict=True)]
    assert all(0 < h < len(ids) for h, ids in zip(heads, prompts, strict=True))

    cold_enc = {}
    cold = _prefilled_tokens(
        gen, lambda: cold_enc.setdefault("e", b.encode([(QUESTION, passages)], 3))
    )
    assert len(b.passage_cache) == 3 and b.passage_cache.misses == 3
    assert cold_enc["e"].reused_tokens == 0  # every head prefilled
    other = "Which passage mentions a tower?"
    warm_enc = {}
    warm = _prefilled_tokens(
        gen, lambda: warm_enc.setdefault("e", b.encode([(other, passages)], 3))
    )
    assert b.passage_cache.hits == 3
    # the second question paid for its own tokens only, not the passages'
    tails = sum(len(b.prompt_ids(other, p)) - h for p, h in zip(passages, heads, strict=True))
    assert warm == tails
    assert cold >= sum(len(ids) for ids in prompts)
    # what the generator's speed model is told was not computed: the heads reused
    assert warm_enc["e"].reused_tokens == sum(heads)

    b.set_passage_cache(0)
    plain = b.encode([(other, passages)], 3)
    assert torch.allclose(warm_enc["e"].first_logprobs, plain.first_logprobs, atol=1e-5)


@pytest.mark.parametrize("mode", ["rag-token", "rag-sequence-thorough"])
def test_answers_from_cached_passages_equal_cold_ones(fresh, mode):
    gen = fresh
    options = DecodingOptions(mode=mode, num_beams=2, max_new_tokens=5)
    passages = make_passages(4, 6)
    gen.backend.set_passage_cache(0)
    cold = gen.generate(QUESTION, passages, options)
    gen.backend.set_passage_cache(64 * 2**20)
    gen.generate("another question about them?", passages, options)  # fills the cache
    warm = gen.generate(QUESTION, passages, options)
    assert gen.backend.passage_cache.hits >= 4
    assert [h.token_ids for h in warm.hypotheses] == [h.token_ids for h in cold.hypotheses]
    for a, c in zip(warm.hypotheses, cold.hypotheses, strict=True):
        assert a.log_prob == pytest.approx(c.log_prob, abs=1e-4)


@torch.inference_mode()
def test_a_template_with_the_question_first_reuses_nothing(fresh):
    b = fresh.backend
    spec = b.spec
    try:
        b.spec = dataclasses.replace(
            spec, passage_template="Question: {question}\nTitle: {title}\nPassage: {text}\nAnswer:"
        )
        b._head_template = _passage_head(b.spec.passage_template)
        assert b._head_template is None
        passages = make_passages(2, 7)
        assert all(b.head_length(p, b.prompt_ids(QUESTION, p)) == 0 for p in passages)
        b.encode([(QUESTION, passages)], 2)
        assert len(b.passage_cache) == 0
    finally:
        b.spec = spec
        b._head_template = _passage_head(spec.passage_template)


def test_the_cache_stays_within_its_byte_budget_least_recently_used_first():
    def kv(tokens: int):
        t = torch.zeros(1, 1, tokens, 4)  # 16 bytes per token, keys and values: 32
        return [(t.clone(), t.clone())]

    cache = PassageCache(100)
    cache.put((1,), kv(1))  # 32 bytes
    cache.put((2,), kv(1))
    assert cache.get((1,)) is not None  # (2,) is now the least recently used
    cache.put((3,), kv(1))
    cache.put((4,), kv(1))  # 128 > 100: evicts (2,)
    assert cache.get((2,)) is None
    assert {k for k in [(1,), (3,), (4,)] if cache.get(k) is not None} == {(1,), (3,), (4,)}
    assert cache.bytes == 96
    cache.put((5,), kv(4))  # larger than the whole budget: not kept, nothing evicted
    assert cache.get((5,)) is None and cache.bytes == 96
    cache.clear()
    assert len(cache) == 0 and cache.bytes == 0
    with pytest.raises(ValueError, match="passage cache"):
        PassageCache(-1)
    disabled = PassageCache(0)
    disabled.put((1,), kv(1))
    assert not disabled.enabled and len(disabled) == 0


@torch.inference_mode()
def test_new_weights_drop_the_cached_passages(fresh):
    b = fresh.backend
    b.encode([(QUESTION, make_passages(2, 8))], 2)
    assert len(b.passage_cache) == 2
    b.refresh()  # what training / a reload calls after the weights change
    assert len(b.passage_cache) == 0


def test_prompt_spec_default_template_puts_the_passage_before_the_question():
    template = PromptSpec().passage_template
    assert template.index("{text}") < template.index("{question}")


def test_the_head_stops_before_the_space_the_question_takes():
    """SentencePiece and byte-level BPE join a space to the word after it ("Question:" then
    " peru"): a head ending in that space is never a prefix of the prompt's tokens, and the
    default Gemma prompt reused nothing."""
    template = "Title: {title}\nPassage: {text}\nQuestion: {question}\nAnswer:"
    assert _passage_head(template) == "Title: {title}\nPassage: {text}\nQuestion:"


@torch.inference_mode()
def test_the_measuring_twin_sees_what_the_cache_holds(fresh):
    """Admission measures requests on the backend's measuring twin: it must see the live
    cache, also after the cache's budget was set (in place, not replaced), and looking must
    not count as a use."""
    b = fresh.backend
    twin = b.measuring_twin()
    b.set_passage_cache(32 * 2**20)
    assert twin.passage_cache is b.passage_cache and b.passage_cache.max_bytes == 32 * 2**20
    passages = make_passages(2, 9)
    assert twin.cached_input_tokens(QUESTION, passages) == 0
    b.encode([(QUESTION, passages)], 2)
    heads = [b.head_length(p, b.prompt_ids(QUESTION, p)) for p in passages]
    counts = (b.passage_cache.hits, b.passage_cache.misses)
    assert twin.cached_input_tokens("Another question?", passages) == sum(heads)
    assert (b.passage_cache.hits, b.passage_cache.misses) == counts
