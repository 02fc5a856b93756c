"""RAG marginalisation over a causal LM: cached prompt prefix, padding, stop strings, losses."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag import cache as rows_module
from openbook.rag.backends.base import log_softmax
from openbook.rag.losses import rag_sequence_nll, rag_token_nll
from openbook.types import Passage
from openbook_testkit.rag import QUESTION, make_passages

ARCHS = ("gemma3", "llama")


def _full_logprobs(
    gen, passage: Passage, answer: list[int], question: str = QUESTION
) -> torch.Tensor:
    """log p(answer_t | prompt, answer_<t) from one uncached forward over the unpadded prompt."""
    b = gen.backend
    ids = b.prefix_ids + b.prompt_ids(question, passage) + answer
    with torch.no_grad():
        lp = gen.model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    n = len(ids)
    return lp[n - len(answer) - 1 : n - 1].gather(1, torch.tensor(answer)[:, None]).squeeze(1)


def _uneven_passages(k: int) -> list[Passage]:
    ps = make_passages(k, 3)
    for i, p in enumerate(ps):  # prompts of clearly different lengths -> real padding
        p.text = p.text + " Paris" * (3 * i)
    return ps


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_prefix_cached_scoring_equals_full_prompt(dirs, load, arch):
    gen = load(dirs.causal(arch))
    b = gen.backend
    passages = _uneven_passages(3)
    enc = b.encode([(QUESTION, passages)], 3)
    answer = [40, 17, 99, 5, 1]
    scored = b.score(enc, torch.arange(3), torch.tensor([answer] * 3))
    for z, p in enumerate(passages):
        torch.testing.assert_close(scored[z], _full_logprobs(gen, p, answer), atol=1e-5, rtol=0)
    # and the step-by-step decoding cache agrees as well
    state = b.start(enc, 1)
    lp = enc.first_logprobs
    for t, tok in enumerate(answer):
        for z, p in enumerate(passages):
            ref = _full_logprobs(gen, p, answer[: t + 1])[t]
            assert float(lp[z, tok]) == pytest.approx(float(ref), abs=1e-5)
        lp = b.step(state, torch.tensor([tok] * 3))


@pytest.mark.parametrize("budget", [1, 3 * 300, 10**9])
@torch.no_grad()
def test_scoring_within_a_logit_budget_equals_full_prompt(dirs, load, monkeypatch, budget):
    """Rows chunked and, below one row's logits, positions segmented over the growing cache: the
    log-probs stay those of one uncached forward (budget 1: one row, one position at a time)."""
    from openbook.rag.backends import base

    monkeypatch.setattr(base, "SCORE_LOGIT_ELEMENTS", budget)
    gen = load(dirs.causal("gemma3"))
    b = gen.backend
    passages = _uneven_passages(3)
    enc = b.encode([(QUESTION, passages)], 3)
    answers = [[40, 17, 99, 5, 1], [7, 8, 9, 10, 11]]
    rows = torch.tensor([0, 1, 2, 2, 1, 0])
    seqs = torch.tensor([answers[i % 2] for i in range(6)])
    scored = b.score(enc, rows, seqs)
    for i in range(6):
        ref = _full_logprobs(gen, passages[int(rows[i])], answers[i % 2])
        torch.testing.assert_close(scored[i], ref, atol=1e-5, rtol=0)


def _brute_force_rag_token_greedy(gen, passages, max_new: int) -> list[int]:
    b = gen.backend
    prior = torch.log_softmax(torch.tensor([p.score for p in passages]), 0)
    stops = b.spec.stop
    out: list[int] = []
    for _ in range(max_new):
        per_doc = []
        for p in passages:
            ids = b.prefix_ids + b.prompt_ids(QUESTION, p) + out
            with torch.no_grad():
                per_doc.append(gen.model(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1))
        marginal = torch.logsumexp(torch.stack(per_doc) + prior[:, None], 0)
        tok = int(marginal.argmax())
        out.append(tok)
        if tok == b.eos_token_id or any(s in b.tokenizer.decode(out[-8:]) for s in stops):
            break
    return out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("growth_slots", (1, rows_module.GROWTH_SLOTS))
def test_rag_token_greedy_equals_brute_force(dirs, load, arch, k, growth_slots, monkeypatch):
    """Against uncached forwards; also with a cache that grows past its spare slots."""
    monkeypatch.setattr(rows_module, "GROWTH_SLOTS", growth_slots)
    gen = load(dirs.causal(arch))
    passages = _uneven_passages(k)
    res = gen.generate(QUESTION, passages, DecodingOptions(max_new_tokens=8))
    assert res.hypotheses[0].token_ids == _brute_force_rag_token_greedy(gen, passages, 8)


def test_beam_modes_are_consistent(dirs, load):
    gen = load(dirs.causal("llama"))
    passages = _uneven_passages(3)
    prior = torch.log_softmax(torch.tensor([p.score for p in passages]), 0)
    for mode in ("rag-token", "rag-sequence-thorough", "rag-sequence-fast"):
        opts = DecodingOptions(mode=mode, num_beams=3, max_new_tokens=5, num_return_sequences=3)
        hyps = gen.generate(QUESTION, passages, opts).hypotheses
        assert len(hyps) == 3
        if mode == "rag-sequence-thorough":
            for h in hyps:  # log p(y|x) = log sum_z p(z|x) p(y|x,z) from full forwards
                per_doc = [float(_full_logprobs(gen, p, h.token_ids).sum()) for p in passages]
                expected = math.log(
                    sum(math.exp(a + b) for a, b in zip(prior, per_doc, strict=True))
                )
                assert h.log_prob == pytest.approx(expected, abs=1e-4)
            assert [h.log_prob for h in hyps] == sorted((h.log_prob for h in hyps), reverse=True)


def test_stop_strings_end_the_answer(dirs, tmp_path):
    src = dirs.causal("llama")
    gen = RagGenerator.load(src, device="cpu")
    passages = make_passages(2)
    free = gen.generate(QUESTION, passages, DecodingOptions(max_new_tokens=8)).hypotheses[0]
    # make the 3rd generated token's text a stop string
    stop_text = gen.tokenizer.decode([free.token_ids[2]])
    assert stop_text
    d = tmp_path / "stopped"
    shutil.copytree(src, d)
    spec = json.loads((d / "openbook_prompt.json").read_text())
    spec["stop"] = [stop_text]
    (d / "openbook_prompt.json").write_text(json.dumps(spec))
    stopped_gen = RagGenerator.load(d, device="cpu")
    for mode in ("rag-token", "rag-sequence-thorough"):
        for beams in (1, 2):
            opts = DecodingOptions(mode=mode, num_beams=beams, max_new_tokens=8)
            h = stopped_gen.generate(QUESTION, passages, opts).hypotheses[0]
            decoded = stopped_gen.tokenizer.decode(h.token_ids)
            assert stop_text in decoded
            assert stop_text not in stopped_gen.tokenizer.decode(h.token_ids[:-1])
            assert stop_text not in h.text
    first = stopped_gen.generate(QUESTION, passages, DecodingOptions(max_new_tokens=8)).hypotheses[
        0
    ]
    assert first.token_ids == free.token_ids[: len(first.token_ids)]


@pytest.mark.parametrize("mode", ("rag-token", "rag-sequence"))
def test_causal_loss_equals_full_forward_math(dirs, load, mode):
    gen = load(dirs.causal("gemma3"))
    b = gen.backend
    questions = [QUESTION, "Who wrote Hamlet?"]
    passages = [_uneven_passages(3), make_passages(3, 1)]
    targets = ["Paris", "Shakespeare did"]
    scores = torch.tensor([[p.score for p in ps] for ps in passages], requires_grad=True)
    loss = gen.loss(questions, passages, scores, targets, mode, reduce_loss=False)
    target_ids = b.tokenize_targets(targets)
    assert (
        target_ids[0, 1:].tolist()[:2]
        == b.tokenizer(" Paris", add_special_tokens=False)["input_ids"][:2]
    )
    expected = []
    for q, ps, row in zip(questions, passages, target_ids.tolist(), strict=True):
        answer = [t for t in row[1:] if t != b.pad_token_id]
        per_doc = torch.stack([_full_logprobs(gen, p, answer, q) for p in ps])  # (k, T)
        prior = torch.log_softmax(torch.tensor([p.score for p in ps]), 0)
        if mode == "rag-sequence":
            expected.append(-torch.logsumexp(prior + per_doc.sum(1), 0))
        else:
            expected.append(-torch.logsumexp(prior[:, None] + per_doc, 0).sum())
    torch.testing.assert_close(loss.detach(), torch.stack(expected), atol=1e-5, rtol=1e-5)
    loss.sum().backward()
    assert scores.grad.abs().sum() > 0
    gen.model.zero_grad()
    # logits layout is interchangeable with the BART one: same result through the raw loss functions
    with torch.no_grad():
        logits = b.target_logits(list(zip(questions, passages, strict=True)), target_ids)
    fn = rag_sequence_nll if mode == "rag-sequence" else rag_token_nll
    torch.testing.assert_close(
        fn(logits, scores.detach(), target_ids, b.pad_token_id), loss.detach(), atol=1e-5, rtol=0
    )


@torch.no_grad()
def test_prompt_prefill_computes_logits_at_the_last_position_only(dirs, load):
    """The LM head sees one position per row at encode time, whatever the prompt length: the
    262k-vocabulary head over every prompt position is what exhausted memory."""
    gen = load(dirs.causal("gemma3"))
    head = gen.model.get_output_embeddings()
    seen: list[tuple[int, ...]] = []
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    try:
        gen.backend.encode([(QUESTION, _uneven_passages(4))], 4)
    finally:
        hook.remove()
    # one call for every prefill group (rows of similar prompt length), one position per row
    assert seen == [(4, gen.model.config.hidden_size)]


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_the_lm_head_applied_after_prefill_reproduces_the_models_own(dirs, load, arch):
    """encode applies the LM head once for all prefill groups (``_head_logits``) only where it
    was seen to give the model's own logits; otherwise each group runs the model's own head."""
    gen = load(dirs.causal(arch))
    b = gen.backend
    assert b._own_head  # Gemma 3 / Llama: the output embedding (+ soft-capping) is the head
    passages = _uneven_passages(4)
    own = b.encode([(QUESTION, passages)], 4).first_logprobs
    try:
        b._own_head = False
        models = b.encode([(QUESTION, passages)], 4).first_logprobs
    finally:
        b.refresh()
    assert b._own_head
    assert torch.allclose(own, models, atol=1e-5)


@torch.no_grad()
def test_prompts_of_different_lengths_are_prefilled_without_much_padding(dirs, load):
    """Rows are prefilled in groups of similar prompt length: the tokens computed stay within
    1/0.9 of the real prompt tokens (one padded batch computes every row at the longest)."""
    gen = load(dirs.causal("gemma3"))
    b = gen.backend
    passages = make_passages(4, 3)
    for i, p in enumerate(passages):  # prompts from ~70 to ~130 tokens
        p.text = p.text + " Paris" * (20 * i)
    lengths = [len(b.prompt_ids(QUESTION, p)) for p in passages]
    assert max(lengths) > 1.5 * min(lengths)  # the case that padding made expensive
    computed: list[int] = []
    hook = gen.model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: computed.append(args[0].numel())
    )
    try:
        enc = b.encode([(QUESTION, passages)], 4)
    finally:
        hook.remove()
    assert sum(computed) <= sum(lengths) / 0.9
    # and every row's first distribution is that of its prompt prefilled alone
    for z, p in enumerate(passages):
        alone = b.encode([(QUESTION, [p])], 1)
        assert torch.allclose(enc.first_logprobs[z], alone.first_logprobs[0], atol=1e-5)


@torch.no_grad()
def test_a_request_whose_caller_gave_up_leaves_the_batch_between_steps(dirs, load):
    from openbook.rag.errors import Abandoned

    gen = load(dirs.causal("gemma3"))
    options = DecodingOptions(max_new_tokens=64, min_new_tokens=64)
    rows_fed: list[int] = []
    original = gen.backend.step

    def counted(state, tokens):
        rows_fed.append(int(tokens.shape[0]))
        return original(state, tokens)

    gen.backend.step = counted
    try:
        for mode in ("rag-token", "rag-sequence-thorough"):
            options.mode = mode
            rows_fed.clear()
            request = (QUESTION, make_passages(2), options)
            asked = {"n": 0}

            def gives_up_after_three(asked=asked) -> bool:
                asked["n"] += 1
                return asked["n"] > 3

            out = gen.generate_batch([request, request], [gives_up_after_three, lambda: True])
            assert all(isinstance(r, Abandoned) for r in out)
            assert len(rows_fed) <= 3
            # the caller still waiting gets its whole answer; the other's rows leave at once
            rows_fed.clear()
            out = gen.generate_batch([request, request], [lambda: True, lambda: False])
            assert isinstance(out[0], Abandoned)
            assert not isinstance(out[1], Abandoned)
            assert len(out[1].hypotheses[0].token_ids) == 64
            assert set(rows_fed) == {2}  # only the waiting request's two passage rows ran
    finally:
        gen.backend.step = original


@torch.no_grad()
def test_scoring_keeps_every_lm_head_call_within_the_logit_budget(dirs, load, monkeypatch):
    from openbook.rag.backends import base

    gen = load(dirs.causal("gemma3"))
    vocab = gen.backend.vocab_size
    budget = 2 * vocab  # two positions' logits: forces row chunks and position segments
    monkeypatch.setattr(base, "SCORE_LOGIT_ELEMENTS", budget)
    enc = gen.backend.encode([(QUESTION, _uneven_passages(3))], 3)
    seen: list[int] = []
    head = gen.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[:-1]))
    try:
        gen.backend.score(enc, torch.tensor([0, 1, 2]), torch.tensor([[40, 17, 99, 5, 1]] * 3))
    finally:
        hook.remove()
    assert seen and all(int(torch.tensor(s).prod()) * vocab <= budget for s in seen), seen


def test_training_logits_cover_the_answer_positions_only(dirs, load):
    gen = load(dirs.causal("gemma3"))
    b = gen.backend
    passages = _uneven_passages(2)
    targets = b.tokenize_targets(["Paris", "the capital"])
    prompt_width = b._prompt_batch([(QUESTION, p) for p in passages])[0].shape[1]
    seen: list[tuple[int, ...]] = []
    head = gen.model.get_output_embeddings()
    hook = head.register_forward_hook(lambda _m, args, _out: seen.append(tuple(args[0].shape)))
    try:
        logits = b.target_logits([(QUESTION, passages)] * 2, targets)
    finally:
        hook.remove()
    # With gradients on, the shared prefix is re-run for its cache (one position through the
    # LM head, not the whole prefix); then the LM head runs over the T loss positions only, not
    # the prompt before them.
    hidden = gen.model.config.hidden_size
    assert torch.is_grad_enabled()
    assert seen == [(1, 1, hidden), (4, targets.shape[1], hidden)]
    assert prompt_width > 1 and logits.shape[:2] == (4, targets.shape[1])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_log_softmax_in_place_is_torchs_own_bit_for_bit(dtype):
    """The backends' log_softmax normalizes reduced-precision logits in place in their float32
    copy (openbook/rag/backends/base.py): the same values as torch.log_softmax, for any shape,
    and the logits themselves untouched."""
    torch.manual_seed(0)
    for shape in ((1, 262_144), (5, 1, 1_000), (40, 3_001), (3, 0), (0, 7)):
        logits = (torch.randn(shape) * 8).to(dtype)
        before = logits.clone()
        got = log_softmax(logits)
        assert got.dtype == torch.float32
        assert torch.equal(got, torch.log_softmax(logits.float(), dim=-1))
        assert torch.equal(logits, before)
    # under autograd it stays differentiable (no in-place out= there)
    logits = torch.randn(2, 50, requires_grad=True)
    log_softmax(logits.to(dtype))[:, 0].sum().backward()
    assert logits.grad is not None
