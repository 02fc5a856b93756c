"""OPENBOOK_GENERATOR_DRAFT_TOKENS through the generator service: greedy RAG-Token and
RAG-Sequence replies (and their streams) are the undrafted library's, token for token, with
drafts accepted and rejected on the way; other decodings are unchanged."""

from __future__ import annotations

import pytest
from generator_kit import generate_request

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.engine import DecodingEngine
from openbook_testkit.rag import QUESTION, make_passages, make_tiny_causal_lm
from openbook_testkit.stack import generator_service


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_tiny_causal_lm(tmp_path_factory.mktemp("draft") / "gemma3")


@pytest.fixture(scope="module")
def service(model, tmp_path_factory, redis_server):
    with generator_service(
        model, tmp_path_factory.mktemp("draft_svc"), redis_server.url, draft_tokens=8
    ) as (settings, servicer, stub):
        yield settings, servicer, stub


def _counting(monkeypatch) -> dict[str, int]:
    """Tokens drafted and accepted by the engines' drafted steps from now on (counted there:
    the service's engine outlives a test)."""
    counts = {"drafted": 0, "accepted": 0}
    advance_drafted = DecodingEngine._advance_drafted

    def counting(self: DecodingEngine, drafts: list[list[int]]) -> None:
        drafted, accepted = self.drafted_tokens, self.accepted_tokens
        advance_drafted(self, drafts)
        counts["drafted"] += self.drafted_tokens - drafted
        counts["accepted"] += self.accepted_tokens - accepted

    monkeypatch.setattr(DecodingEngine, "_advance_drafted", counting)
    return counts


def _passages_followed_by(backend, monkeypatch, continuations: list[list[int]]) -> None:
    """Draft sources from now on: passage z's prompt followed by ``continuations[z]`` (token
    ids: the answer the passage holds, as the model's tokens, or a corrupted copy)."""
    own = type(backend).draft_sources

    def sources(question, passages):
        return [ids + continuations[z] for z, ids in enumerate(own(backend, question, passages))]

    monkeypatch.setattr(backend, "draft_sources", sources)


def test_drafted_replies_are_the_undrafted_answers(service, model, monkeypatch):
    settings, servicer, stub = service
    assert settings.draft_tokens == 8 and servicer.generator.draft_tokens == 8
    plain = RagGenerator.load(model, device="cpu")
    counts = _counting(monkeypatch)
    for seed in range(4):
        passages = make_passages(3, seed=seed)
        options = dict(max_new_tokens=12)
        want = plain.generate(QUESTION, passages, DecodingOptions(**options)).hypotheses[0]
        answer = list(want.token_ids)
        wrong = answer[:4] + [(t + 5) % 250 + 3 for t in answer[4:]]
        # the passages hold the answer (as the model's token ids), or a wrong one
        copied = answer if seed % 2 == 0 else wrong
        _passages_followed_by(servicer.generator.backend, monkeypatch, [copied] * len(passages))
        reply = stub.Generate(generate_request(passages, **options), timeout=60)
        got = reply.hypotheses[0]
        assert got.text == want.text
        assert got.num_tokens == len(answer)
        assert [t.token for t in got.tokens] == want.tokens
        assert got.log_prob == pytest.approx(want.log_prob, rel=1e-5, abs=1e-4)
        for token, posterior in zip(got.tokens, want.token_doc_posteriors, strict=True):
            assert list(token.doc_posterior) == pytest.approx(posterior, abs=1e-4)
        events = list(stub.GenerateStream(generate_request(passages, **options), timeout=60))
        streamed = [e.token.token_id for e in events if e.WhichOneof("event") == "token"]
        assert streamed == answer
    assert 0 < counts["accepted"] < counts["drafted"]


def test_beam_search_is_unchanged_with_drafting_on(service, model):
    _, _, stub = service
    plain = RagGenerator.load(model, device="cpu")
    passages = make_passages(2, seed=9)
    want = plain.generate(QUESTION, passages, DecodingOptions(num_beams=2, max_new_tokens=6))
    reply = stub.Generate(generate_request(passages, num_beams=2, max_new_tokens=6), timeout=60)
    assert [h.text for h in reply.hypotheses] == [h.text for h in want.hypotheses]


@pytest.mark.parametrize("mode", ("rag-sequence-fast", "rag-sequence-thorough"))
def test_drafted_rag_sequence_replies_and_streams_are_the_undrafted_ones(
    service, model, mode, monkeypatch
):
    """Each passage drafts from its own prompt (here followed by its own greedy answer's token
    ids, or a corrupted copy): replies and the per-passage streamed tokens are the undrafted
    ones."""
    _, servicer, stub = service
    plain = RagGenerator.load(model, device="cpu")
    counts = _counting(monkeypatch)
    for seed in range(4):
        passages = make_passages(3, seed=seed)
        options = dict(max_new_tokens=10, mode=mode)
        # each passage's hypothesis is decoded under it alone
        alone = [
            list(plain.generate(QUESTION, [p], DecodingOptions(**options)).hypotheses[0].token_ids)
            for p in passages
        ]
        copied = (
            alone if seed % 2 == 0 else [a[:3] + [(t + 5) % 250 + 3 for t in a[3:]] for a in alone]
        )
        _passages_followed_by(servicer.generator.backend, monkeypatch, copied)
        want = plain.generate(QUESTION, passages, DecodingOptions(**options))
        reply = stub.Generate(generate_request(passages, **options), timeout=60)
        assert [h.text for h in reply.hypotheses] == [h.text for h in want.hypotheses]
        for got, hyp in zip(reply.hypotheses, want.hypotheses, strict=True):
            assert got.log_prob == pytest.approx(hyp.log_prob, rel=1e-5, abs=1e-4)
            assert list(got.doc_posterior) == pytest.approx(hyp.doc_posterior, abs=1e-4)
        events = list(stub.GenerateStream(generate_request(passages, **options), timeout=60))
        tokens = [e.token for e in events if e.WhichOneof("event") == "token"]
        for z in range(len(passages)):
            assert [t.token_id for t in tokens if t.passage == z] == alone[z]
    assert 0 < counts["accepted"] < counts["drafted"]
