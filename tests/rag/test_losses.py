"""Losses equal transformers' get_nll (values and gradients), directly and via RagGenerator.loss."""

from __future__ import annotations

import pytest
import torch

from openbook.rag.losses import rag_sequence_nll, rag_token_nll
from openbook_testkit.rag import QUESTION, make_passages

PAD, BOS, START = 1, 0, 2


def _random_case(seed: int, batch: int, k: int, length: int, vocab: int = 11):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch * k, length, vocab, generator=g) * 3
    scores = torch.randn(batch, k, generator=g)
    target = torch.randint(3, vocab, (batch, length), generator=g)
    target[:, 0] = START
    target[:, 1] = BOS  # every row: BOS first, so exclude_bos_score has an effect
    for b in range(batch):  # ragged lengths, one single-token answer (prior-at-position-1 rule)
        end = 2 + (b * 3) % (length - 1) if b else 2
        target[b, end:] = PAD
    return logits, scores, target


def _ref_nll(ref_model, kind, logits, scores, target, **kw):
    k = scores.shape[1]
    if kind == "sequence":
        return ref_model.get_nll(logits, scores, target, n_docs=k, **kw)
    kw.pop("exclude_bos_score", None)
    return ref_model.get_nll(logits, scores, target, n_docs=k, **kw)


# transformers' RAG-Token loss has no exclude_bos_score
@pytest.mark.parametrize(
    ("kind", "exclude_bos_score"), (("sequence", False), ("sequence", True), ("token", False))
)
@pytest.mark.parametrize("k", (1, 3, 5))
@pytest.mark.parametrize("epsilon", (0.0, 0.1))
@pytest.mark.parametrize("reduce_loss", (False, True))
def test_nll_matches_get_nll(
    dirs, load, reference_for, kind, k, epsilon, reduce_loss, exclude_bos_score
):
    bart = dirs.bart(0)
    ref = reference_for(bart, load(bart)).model(kind, k)
    for seed in range(3):
        logits, scores, target = _random_case(seed, batch=3, k=k, length=6)
        ours_in = [logits.clone().requires_grad_(), scores.clone().requires_grad_()]
        ref_in = [logits.clone().requires_grad_(), scores.clone().requires_grad_()]
        kw = dict(reduce_loss=reduce_loss, epsilon=epsilon, exclude_bos_score=exclude_bos_score)
        fn = rag_sequence_nll if kind == "sequence" else rag_token_nll
        ours = fn(*ours_in, target, PAD, bos_token_id=BOS, **kw)
        theirs = _ref_nll(ref, kind, *ref_in, target, **kw)
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
        ours.sum().backward()
        theirs.sum().backward()
        for a, b in zip(ours_in, ref_in, strict=True):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)
        if k > 1:  # with one passage p(z|x) == 1 whatever the score
            assert ours_in[1].grad.abs().sum() > 0


@pytest.mark.parametrize("mode", ("rag-sequence", "rag-token"))
@pytest.mark.parametrize("k", (1, 3))
@pytest.mark.parametrize("epsilon", (0.0, 0.1))
def test_generator_loss_matches_rag_forward(dirs, load, reference_for, mode, k, epsilon):
    """RagGenerator.loss (tokenisation, BART forward, loss) == RagXForGeneration(labels=..)."""
    bart = dirs.bart(1)
    gen = load(bart)
    kind = "sequence" if mode == "rag-sequence" else "token"
    ref_model = reference_for(bart, gen).model(kind, k, label_smoothing=epsilon)
    questions = [QUESTION, "Who wrote Hamlet?"]
    passages = [make_passages(k, 0), make_passages(k, 1)]
    targets = ["Paris", "William Shakespeare wrote it"]
    scores = torch.tensor([[p.score for p in ps] for ps in passages], requires_grad=True)
    ours = gen.loss(questions, passages, scores, targets, mode, epsilon=epsilon, reduce_loss=False)

    ref = reference_for(bart, gen)
    ctx = [ref.context(q, ps) for q, ps in zip(questions, passages, strict=True)]
    width = max(c[0].shape[1] for c in ctx)
    ids = torch.cat(
        [torch.nn.functional.pad(c[0], (0, width - c[0].shape[1]), value=PAD) for c in ctx]
    )
    mask = torch.cat([torch.nn.functional.pad(c[1], (0, width - c[1].shape[1])) for c in ctx])
    labels = gen.backend.tokenize_targets(targets)
    assert labels[0, :2].tolist() == [START, BOS]
    ref_scores = scores.detach().clone().requires_grad_()
    out = ref_model(
        context_input_ids=ids,
        context_attention_mask=mask,
        doc_scores=ref_scores,
        labels=labels,
        n_docs=k,
        reduce_loss=False,
    )
    torch.testing.assert_close(ours, out.loss, atol=1e-5, rtol=1e-5)
    ours.sum().backward()
    out.loss.sum().backward()
    torch.testing.assert_close(scores.grad, ref_scores.grad, atol=1e-5, rtol=1e-5)


def test_generator_loss_trains_generator_weights(dirs, load):
    gen = load(dirs.bart(1))
    passages = [make_passages(2, 0)]
    scores = torch.tensor([[0.3, -0.2]], requires_grad=True)
    gen.model.zero_grad()
    loss = gen.loss([QUESTION], passages, scores, ["Paris"], "rag-sequence", exclude_bos_score=True)
    assert loss.dim() == 0
    loss.backward()
    assert scores.grad is not None and gen.model.lm_head.weight.grad is not None
    gen.model.zero_grad()
