"""Sampling (openbook/rag/sampling.py): RAG-Token draws every token from the passage marginal of
the paper's eq. 2 under temperature, then top-k, then top-p; a seeded request gets the same answer
alone or in any batch; temperature 0 stays greedy / beam search; bad values name their field."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from openbook.errors import InvalidArgument
from openbook.rag import DecodingOptions
from openbook.rag.sampling import draw, request_generator, sampling_distribution
from openbook_testkit.rag import QUESTION, make_passages

KINDS = ("bart", "llama")


def _generator(dirs, load, kind):
    return load(dirs.bart(0) if kind == "bart" else dirs.causal(kind))


# ---------------------------------------------------------------- the transforms, by hand


def test_temperature_then_top_k_then_top_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    scores = probs.log()
    # top-p 0.8: the likeliest tokens until their mass reaches 0.8 (0.5 + 0.3)
    got = sampling_distribution(scores, 1.0, 0, 0.8)
    assert got[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    # top-k 3, then top-p on what is left: 0.5/0.95 + 0.3/0.95 = 0.84 >= 0.8
    got = sampling_distribution(scores, 1.0, 3, 0.8)
    assert got[0].tolist() == pytest.approx([0.625, 0.375, 0.0, 0.0])
    # temperature 2 flattens first (p^(1/2)), then the nucleus is taken from the flat one
    flat = probs.sqrt() / probs.sqrt().sum()
    got = sampling_distribution(scores, 2.0, 0, 1.0)
    assert got[0].tolist() == pytest.approx(flat[0].tolist(), abs=1e-6)
    got = sampling_distribution(scores, 2.0, 0, 0.5)
    kept = flat[0, :2] / flat[0, :2].sum()
    assert got[0, :2].tolist() == pytest.approx(kept.tolist(), abs=1e-6)
    # a tiny temperature is argmax, without overflow or NaN
    got = sampling_distribution(scores, 1e-30, 0, 1.0)
    assert got[0].tolist() == [1.0, 0.0, 0.0, 0.0]


def test_a_token_without_mass_is_never_drawn():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]]).expand(4, 5)
    uniforms = torch.tensor([0.0, 0.4999, 0.5, 1.0], dtype=torch.float64)  # 1.0: past the end
    picked = draw(probs, uniforms)
    assert picked.tolist() == [1, 1, 3, 3]


# ---------------------------------------------------------------- against the exact marginal


def _by_hand(log_p: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The documented transforms, written out independently of openbook.rag.sampling."""
    probs = log_p.double().exp() ** (1.0 / temperature)
    probs = probs / probs.sum()
    kept = torch.zeros_like(probs)
    order = torch.argsort(probs, descending=True)[:top_k]
    mass = 0.0
    for token in order.tolist():
        if mass >= top_p * float(probs[order].sum()):
            break
        kept[token] = probs[token]
        mass += float(probs[token])
    return kept / kept.sum()


def _chi2(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's statistic over the tokens ``expected`` gives mass (a draw outside: inf)."""
    inside = expected > 0
    if counts[~inside].sum() > 0:
        return math.inf
    total = float(counts.sum())
    e = expected[inside] * total
    return float(((counts[inside] - e) ** 2 / e).sum())


def test_sampled_tokens_follow_the_exact_passage_marginal(dirs, load):
    """RAG-Token's first token, sampled through the engine (2,400 draws), against eq. 2
    computed here from each passage's own next-token distribution, p(y|x) = sum_z p(z|x)
    p(y|x,z), then temperature, top-k, top-p by hand: a chi-square test. The same draws are
    checked to reject what a wrong implementation would sample (the prior ignored, log-probs
    mixed instead of probabilities, top-p before temperature), so the test has the power to
    tell."""
    gen = _generator(dirs, load, "llama")
    passages = [
        replace(p, score=s) for p, s in zip(make_passages(3, seed=1), (0.0, 0.3, 0.6), strict=True)
    ]
    temperature, top_k, top_p = 2.0, 10, 0.6
    with torch.inference_mode():
        enc = gen.backend.encode([(QUESTION, passages)], len(passages))
    per_passage = enc.first_logprobs.double()  # (k, V): log p(y_1 | x, z)
    prior = torch.log_softmax(torch.tensor([p.score for p in passages], dtype=torch.float64), 0)
    marginal = torch.logsumexp(per_passage + prior[:, None], dim=0)  # log p(y_1 | x), eq. 2
    expected = _by_hand(marginal, temperature, top_k, top_p)
    bins = int((expected > 0).sum())
    assert bins == 5 and float(expected[expected > 0].min()) > 0.05

    n, requests = 16, 150
    options = [
        DecodingOptions(
            max_new_tokens=1,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            num_return_sequences=n,
            seed=seed,
        )
        for seed in range(requests)
    ]
    counts = torch.zeros_like(expected)
    for result in gen.generate_batch([(QUESTION, passages, o) for o in options]):
        for hyp in result.hypotheses:
            counts[hyp.token_ids[0]] += 1
    # 4 degrees of freedom: P(chi2 > 30) ~ 5e-6 when the draws follow the marginal (and the
    # seeds are fixed: the test is deterministic)
    assert _chi2(counts, expected) < 30.0, (counts[expected > 0].tolist(), expected[expected > 0])
    wrong = {
        "prior ignored": _by_hand(torch.logsumexp(per_passage, 0), temperature, top_k, top_p),
        "log-probs mixed": _by_hand(
            (per_passage * prior.exp()[:, None]).sum(0), temperature, top_k, top_p
        ),
        "top-p first": _by_hand(
            _by_hand(marginal, 1.0, top_k, top_p).clamp_min(1e-300).log(), temperature, top_k, 1.0
        ),
    }
    for name, other in wrong.items():
        assert _chi2(counts, other) > 100.0, name


# ---------------------------------------------------------------- seeds and batches


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence-thorough", "rag-sequence-fast"))
def test_same_seed_same_answers_alone_or_in_any_batch(dirs, load, kind, mode):
    gen = _generator(dirs, load, kind)
    sampled = DecodingOptions(
        mode=mode, max_new_tokens=6, temperature=1.0, top_p=0.95, num_return_sequences=3, seed=7
    )
    passages = make_passages(3, seed=2)
    alone = gen.generate(QUESTION, passages, sampled)
    assert len(alone.hypotheses) == 3
    batch = gen.generate_batch(
        [
            ("Who wrote Hamlet?", make_passages(2, seed=4), DecodingOptions(max_new_tokens=4)),
            (QUESTION, passages, sampled),
            ("Where is the tower?", make_passages(4), DecodingOptions(num_beams=2)),
            (QUESTION, passages, DecodingOptions(mode=mode, temperature=1.0, seed=8)),
        ]
    )
    together = batch[1]
    assert [h.token_ids for h in together.hypotheses] == [h.token_ids for h in alone.hypotheses]
    for a, b in zip(together.hypotheses, alone.hypotheses, strict=True):
        assert a.log_prob == pytest.approx(b.log_prob, abs=1e-4)
    other_seed = gen.generate(QUESTION, passages, DecodingOptions(**{**vars(sampled), "seed": 8}))
    assert [h.token_ids for h in other_seed.hypotheses] != [h.token_ids for h in alone.hypotheses]


@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence-fast"))
def test_a_seeded_request_joining_mid_decode_draws_as_alone(dirs, load, mode):
    """Continuous batching: sampled requests join a running batch at different steps (with
    chunked prefill for one), and each still draws what it draws alone."""
    gen = _generator(dirs, load, "llama")
    arrivals = [
        (0, DecodingOptions(mode=mode, max_new_tokens=8, temperature=1.0, seed=1), None),
        (0, DecodingOptions(max_new_tokens=9, min_new_tokens=9), None),
        (2, DecodingOptions(mode=mode, max_new_tokens=6, temperature=0.8, top_k=5, seed=2), 1),
        (3, DecodingOptions(mode=mode, max_new_tokens=5, temperature=1.5, seed=1), None),
    ]
    requests = [(QUESTION, make_passages(3, seed=i), o) for i, (_, o, _) in enumerate(arrivals)]
    results = {}
    with torch.inference_mode():
        engine = gen.engine()
        step = 0
        while len(results) < len(requests):
            for i, (arrives, _, chunk) in enumerate(arrivals):
                if arrives == step:
                    engine.add(*requests[i], tag=i, chunk_passages=chunk)
            for running in engine.prefilling:
                engine.prefill(running)
            results.update(engine.step())
            step += 1
    for i, (q, ps, o) in enumerate(requests):
        alone = gen.generate(q, ps, o)
        assert [h.token_ids for h in results[i].hypotheses] == [
            h.token_ids for h in alone.hypotheses
        ]


def test_without_a_seed_each_request_draws_anew(dirs, load):
    gen = _generator(dirs, load, "llama")
    options = DecodingOptions(max_new_tokens=8, temperature=2.0)
    passages = make_passages(3)
    answers = {
        tuple(gen.generate(QUESTION, passages, options).hypotheses[0].token_ids) for _ in range(4)
    }
    assert len(answers) > 1


def test_samples_of_one_request_are_independent_draws(dirs, load):
    """n samples of one request: each row draws on its own (they differ), and the log-prob of
    each is its own marginal likelihood, the one greedy scoring gives its tokens."""
    gen = _generator(dirs, load, "llama")
    passages = make_passages(3)
    result = gen.generate(
        QUESTION,
        passages,
        DecodingOptions(max_new_tokens=6, temperature=2.0, num_return_sequences=4, seed=1),
    )
    ids = [tuple(h.token_ids) for h in result.hypotheses]
    assert len(set(ids)) > 1
    for hyp in result.hypotheses:
        assert math.isfinite(hyp.log_prob) and hyp.log_prob < 0
        assert len(hyp.token_doc_posteriors) == len(hyp.token_ids)


@pytest.mark.parametrize("kind", KINDS)
def test_temperature_zero_is_greedy_whatever_else_it_says(dirs, load, kind):
    gen = _generator(dirs, load, kind)
    passages = make_passages(3)
    for mode in ("rag-token", "rag-sequence-thorough"):
        greedy = gen.generate(QUESTION, passages, DecodingOptions(mode=mode, max_new_tokens=6))
        ignored = gen.generate(
            QUESTION,
            passages,
            DecodingOptions(mode=mode, max_new_tokens=6, top_p=0.3, top_k=2, seed=5),
        )
        assert [h.token_ids for h in ignored.hypotheses] == [h.token_ids for h in greedy.hypotheses]
        assert ignored.hypotheses[0].log_prob == greedy.hypotheses[0].log_prob


def test_a_tiny_temperature_samples_the_greedy_answer(dirs, load):
    gen = _generator(dirs, load, "bart")
    passages = make_passages(3)
    greedy = gen.generate(QUESTION, passages, DecodingOptions(max_new_tokens=6))
    cold = gen.generate(
        QUESTION, passages, DecodingOptions(max_new_tokens=6, temperature=1e-6, seed=3)
    )
    assert cold.hypotheses[0].token_ids == greedy.hypotheses[0].token_ids


@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence-fast"))
def test_a_sampled_request_streams_its_answer(dirs, load, mode):
    gen = _generator(dirs, load, "llama")
    passages = make_passages(3, seed=6)
    options = DecodingOptions(mode=mode, max_new_tokens=8, temperature=1.0, seed=11)
    events = []
    streamed = gen.generate(QUESTION, passages, options, on_token=events.append)
    plain = gen.generate(QUESTION, passages, options)
    best = plain.hypotheses[0]
    assert streamed.hypotheses[0].token_ids == best.token_ids
    if mode == "rag-token":
        assert [e.token_id for e in events] == best.token_ids
        assert best.text.startswith("".join(e.text for e in events))
    else:  # the answer is one passage's draw, streamed as that passage's tokens
        per_passage = [[e.token_id for e in events if e.passage == z] for z in range(3)]
        assert best.token_ids in per_passage


# ---------------------------------------------------------------- bad values


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1.0, "top_p": 0.0}, "top_p"),
        ({"temperature": 1.0, "top_p": 1.01}, "top_p"),
        ({"temperature": 1.0, "top_k": -1}, "top_k"),
        ({"temperature": 1.0, "seed": 2**63}, "seed"),
        ({"temperature": 1.0, "num_beams": 2}, "num_beams"),
        ({"num_beams": 2, "num_return_sequences": 3}, "num_return_sequences"),
    ],
)
def test_bad_sampling_options_name_their_field(fields, named):
    with pytest.raises(InvalidArgument, match=f"^{named}"):
        DecodingOptions(**fields).validate()


def test_samples_may_outnumber_beams():
    DecodingOptions(temperature=0.7, num_return_sequences=16).validate()


def test_request_generator_takes_negative_and_unsigned_seeds():
    a = torch.rand(3, generator=request_generator(-1))
    b = torch.rand(3, generator=request_generator(2**64 - 1))
    assert a.tolist() == b.tolist()
