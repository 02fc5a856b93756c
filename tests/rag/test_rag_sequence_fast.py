"""RAG-Sequence fast decoding against brute-force enumeration of every answer (tiny vocabulary)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from openbook.rag import DecodingOptions
from openbook_testkit.rag import QUESTION, make_passages

WORDS = ["paris", "france", "capital", "hamlet", "wrote", "fox"]  # vocabulary: 5 specials + 6 words
MAX_NEW = 2
BEAMS = 16


def _all_answers(vocab: int, eos: int) -> list[tuple[int, ...]]:
    """Every sequence beam search can finish with MAX_NEW=2: [eos] or any (t1 != eos, t2)."""
    out: list[tuple[int, ...]] = [(eos,)]
    out += [(a, b) for a, b in itertools.product(range(vocab), repeat=2) if a != eos]
    return out


def _brute_force_logp(gen, question, passage, answers) -> dict[tuple[int, ...], float]:
    """log p(y | x, z) for every answer, from plain full forward passes (no cache)."""
    b = gen.backend
    ids, mask = b._tokenize_inputs([(question, passage)])
    model = gen.model
    start = b.decoder_start_token_id
    with torch.no_grad():
        rows = torch.tensor([[start, a[0]] for a in answers])
        logits = model(
            input_ids=ids.expand(len(answers), -1),
            attention_mask=mask.expand(len(answers), -1),
            decoder_input_ids=rows,
        ).logits.log_softmax(-1)
    out = {}
    for r, a in enumerate(answers):
        out[a] = sum(float(logits[r, t, a[t]]) for t in range(len(a)))
    return out


@pytest.mark.parametrize("seed", (0, 1, 2))
@pytest.mark.parametrize("k", (1, 3, 5))
def test_fast_equals_brute_force(dirs, load, seed, k):
    gen = load(dirs.bart(seed, words=WORDS))
    b = gen.backend
    vocab = b.vocab_size
    assert vocab == 11
    passages = make_passages(k, seed)
    answers = _all_answers(vocab, b.eos_token_id)
    prior = torch.log_softmax(torch.tensor([p.score for p in passages]), 0).tolist()

    # With length_penalty 0 and 16 beams >= what survives each step, the beam of passage z is
    # exactly the 16 most probable answers under z (the beam search part is checked against
    # transformers in test_reference_decoding; here the enumeration checks the fast marginalisation
    # itself).
    beams = []
    scores = []
    for p in passages:
        lp = _brute_force_logp(gen, QUESTION, p, answers)
        top = sorted(answers, key=lambda a: -lp[a])[:BEAMS]
        beams.append(set(top))
        scores.append(lp)
    union = set().union(*beams)
    skip_bos = all(a[0] == b.bos_token_id for a in union)
    expected = {}
    for a in union:
        joint = [
            prior[z]
            + scores[z][a]
            - (scores_first(gen, QUESTION, passages[z], a) if skip_bos else 0)
            for z in range(k)
            if a in beams[z]
        ]
        expected[a] = math.log(sum(math.exp(j) for j in joint))
    ranked = sorted(expected, key=lambda a: -expected[a])

    opts = DecodingOptions(
        mode="rag-sequence-fast",
        num_beams=BEAMS,
        max_new_tokens=MAX_NEW,
        length_penalty=0.0,
        num_return_sequences=BEAMS,
    )
    hyps = gen.generate(QUESTION, passages, opts).hypotheses
    assert [tuple(h.token_ids) for h in hyps] == ranked[:BEAMS]
    for h in hyps:
        a = tuple(h.token_ids)
        assert h.log_prob == pytest.approx(expected[a], abs=1e-5)
        post = [
            math.exp(prior[z] + scores[z][a] - expected[a]) if a in beams[z] else 0.0
            for z in range(k)
        ]
        assert h.doc_posterior == pytest.approx(post, abs=1e-5)


def scores_first(gen, question, passage, answer) -> float:
    return (
        _brute_force_logp(gen, question, passage, [answer])[answer]
        - _brute_force_logp(gen, question, passage, [answer[1:]])[answer[1:]]
    )
