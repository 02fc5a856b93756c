"""generate_batch over mixed passage counts and options equals one-by-one generation."""

from __future__ import annotations

import pytest

from openbook.rag import DecodingOptions
from openbook_testkit.rag import QUESTION, make_passages


@pytest.mark.parametrize("kind", ("bart", "causal"))
def test_mixed_batch_equals_individual(dirs, load, kind):
    gen = load(dirs.bart(0) if kind == "bart" else dirs.causal("llama"))
    token = DecodingOptions(num_beams=2, max_new_tokens=6, num_return_sequences=2)
    greedy = DecodingOptions(max_new_tokens=5)
    thorough = DecodingOptions(mode="rag-sequence-thorough", num_beams=2, max_new_tokens=5)
    fast = DecodingOptions(
        mode="rag-sequence-fast", num_beams=3, max_new_tokens=5, num_return_sequences=2
    )
    requests = [
        (QUESTION, make_passages(1, 0), token),
        ("Who wrote Hamlet?", make_passages(5, 1), token),
        (QUESTION, make_passages(3, 2), greedy),
        ("Where is the tower?", make_passages(4, 3), thorough),
        (QUESTION, make_passages(2, 4), thorough),
        (QUESTION, make_passages(3, 5), greedy),
        ("Who wrote Hamlet?", make_passages(2, 6), fast),
        (QUESTION, make_passages(5, 7), fast),
    ]
    batched = gen.generate_batch(requests)
    assert len(batched) == len(requests)
    for (q, ps, opts), got in zip(requests, batched, strict=True):
        alone = gen.generate(q, ps, opts)
        assert got.doc_prior == pytest.approx(alone.doc_prior, abs=1e-6)
        assert [h.token_ids for h in got.hypotheses] == [h.token_ids for h in alone.hypotheses]
        for a, b in zip(got.hypotheses, alone.hypotheses, strict=True):
            assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
            assert a.text == b.text
