"""Doc prior, RAG-Token per-token posteriors (paper Fig. 2) and RAG-Sequence posteriors."""

from __future__ import annotations

import math

import pytest
import torch

from openbook.rag import DecodingOptions
from openbook_testkit.rag import QUESTION, make_passages


def _doc_token_logprobs(gen, passages, tokens) -> torch.Tensor:
    """(k, T) log p(y_t | x, z, y_<t) by full BART forward passes, one per passage."""
    b = gen.backend
    out = []
    for p in passages:
        ids, mask = b._tokenize_inputs([(QUESTION, p)])
        dec = torch.tensor([[b.decoder_start_token_id, *tokens[:-1]]])
        with torch.no_grad():
            lp = gen.model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits[0]
        out.append(lp.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1))
    return torch.stack(out)


@pytest.mark.parametrize("num_beams", (1, 3))
def test_rag_token_provenance(dirs, load, num_beams):
    gen = load(dirs.bart(1))
    passages = make_passages(4, 2)
    res = gen.generate(
        QUESTION,
        passages,
        DecodingOptions(num_beams=num_beams, max_new_tokens=6, num_return_sequences=num_beams),
    )
    prior = torch.softmax(torch.tensor([p.score for p in passages]), 0)
    assert res.doc_prior == pytest.approx(prior.tolist(), abs=1e-6)
    for h in res.hypotheses:
        lp = _doc_token_logprobs(gen, passages, h.token_ids)
        # log p(y|x) = sum_i log sum_z p(z|x) p(y_i | x, z, y_<i)
        per_token = torch.logsumexp(lp + prior.log()[:, None], 0)
        assert h.log_prob == pytest.approx(float(per_token.sum()), abs=1e-4)
        # each token's own term of that sum, in order
        assert h.token_log_probs == pytest.approx(per_token.tolist(), abs=1e-4)
        assert h.tokens == [gen.tokenizer.decode([t]) for t in h.token_ids]
        assert len(h.token_doc_posteriors) == len(h.token_ids)
        # recursive normalisation: p(z|x,y_<=i) ∝ p(z|x,y_<i) p(y_i|x,z,y_<i)
        post = prior.clone()
        for i, row in enumerate(h.token_doc_posteriors):
            post = post * lp[:, i].exp()
            post = post / post.sum()
            assert row == pytest.approx(post.tolist(), abs=1e-5)
        assert h.doc_posterior is None


@pytest.mark.parametrize("mode", ("rag-sequence-thorough", "rag-sequence-fast"))
def test_rag_sequence_posterior(dirs, load, mode):
    gen = load(dirs.bart(2))
    passages = make_passages(3, 4)
    res = gen.generate(
        QUESTION,
        passages,
        DecodingOptions(mode=mode, num_beams=2, max_new_tokens=6, num_return_sequences=2),
    )
    prior = torch.softmax(torch.tensor([p.score for p in passages]), 0)
    for h in res.hypotheses:
        assert sum(h.doc_posterior) == pytest.approx(1.0, abs=1e-5)
        assert h.tokens is None and h.token_doc_posteriors is None
        assert h.token_log_probs is None  # a whole-answer marginal has no per-token terms
        if mode == "rag-sequence-thorough":
            joint = prior * _doc_token_logprobs(gen, passages, h.token_ids).sum(1).exp()
            assert h.doc_posterior == pytest.approx((joint / joint.sum()).tolist(), abs=1e-5)
            assert h.log_prob == pytest.approx(math.log(float(joint.sum())), abs=1e-4)
