"""Marginal negative log-likelihood losses of RAG-Sequence and RAG-Token.

Both follow the conventions of transformers' ``RagSequenceForGeneration.get_nll`` and
``RagTokenForGeneration.get_nll`` so that numbers are interchangeable with checkpoints trained
there:

* ``seq_logits`` (B*k, T, V) come from feeding ``target`` itself as decoder input, so logits at
  position t predict ``target[:, t + 1]``: the target is shifted left by one and padded with
  ``pad_token_id``.
* Positions whose (shifted) target is padding contribute nothing.
* Label smoothing with ``epsilon`` mixes the NLL with the negative *sum* of all V log-probabilities:
  loss = (1 - epsilon) * nll + (epsilon / V) * smooth.
* Gradients flow into ``doc_scores`` (through log p(z|x) = log_softmax(doc_scores)) and into
  the logits.

Shapes: B = batch, k = passages per question, T = target length, V = vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _shift_left(target: Tensor, pad_token_id: int) -> Tensor:
    """(B, T) -> (B, T): the token each logit position predicts."""
    return torch.cat([target[:, 1:], target.new_full((target.shape[0], 1), pad_token_id)], dim=1)


def _log_probs(
    seq_logits: Tensor, doc_scores: Tensor, target: Tensor, pad_token_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """What both losses start from.

    (B*k, T, V) logits, (B, k) scores, (B, T) decoder input ->
    log p(v | x, z, y_<t) as (B, k, T, V), log p(z|x) as (B, k), and the token each position
    predicts as (B, T).
    """
    batch, k = doc_scores.shape
    vocab = seq_logits.shape[-1]
    logprobs = torch.log_softmax(seq_logits.float(), dim=-1).view(batch, k, -1, vocab)
    doc_logprobs = torch.log_softmax(doc_scores.float(), dim=1)
    return logprobs, doc_logprobs, _shift_left(target, pad_token_id)


def _skips_bos(tgt: Tensor, bos_token_id: int | None, exclude_bos_score: bool) -> bool:
    """Whether position 0 goes unscored: asked for, and ``bos_token_id`` is the first predicted
    token of every row of the (B, T) ``tgt`` (BART's forced BOS)."""
    return exclude_bos_score and bos_token_id is not None and bool(tgt[:, 0].eq(bos_token_id).all())


def _finish(nll: Tensor, smooth: Tensor, epsilon: float, vocab: int, reduce_loss: bool) -> Tensor:
    if reduce_loss:
        nll, smooth = nll.sum(), smooth.sum()
    return (1.0 - epsilon) * nll + (epsilon / vocab) * smooth


def rag_sequence_nll(
    seq_logits: Tensor,
    doc_scores: Tensor,
    target: Tensor,
    pad_token_id: int,
    *,
    bos_token_id: int | None = None,
    reduce_loss: bool = False,
    epsilon: float = 0.0,
    exclude_bos_score: bool = False,
) -> Tensor:
    """RAG-Sequence loss: -log sum_z p(z|x) prod_t p(y_t | x, z, y_<t).

    Args:
        seq_logits: (B*k, T, V) generator logits, rows ordered (question, passage).
        doc_scores: (B, k) retrieval scores; p(z|x) = softmax over k.
        target: (B, T) decoder input ids (starting with the decoder start token).
        pad_token_id: padding id of the generator.
        bos_token_id: with ``exclude_bos_score``, the first predicted token is not scored when it is
            this id in every row of the batch (BART's forced BOS).
        reduce_loss: sum over the batch instead of returning (B,).
        epsilon: label smoothing.

    Math, per question (s_z,t = log p(y_t | x, z, y_<t) over unpadded positions t):
        ll_z = sum_t s_z,t + log p(z|x)            (the prior enters through position 1, as in
                                                    transformers, i.e. only if position 1 is not
                                                    padding)
        nll = -logsumexp_z ll_z
        smooth_z = sum_t sum_v log p(v | x, z, y_<t) + V log p(z|x)   (same position-1 rule)
        smooth = -logsumexp_z smooth_z
    Returns (B,) or a scalar when ``reduce_loss``.
    """
    logprobs, doc_logprobs, tgt = _log_probs(seq_logits, doc_scores, target, pad_token_id)
    batch, k, _, vocab = logprobs.shape

    token_ll = logprobs.gather(-1, tgt[:, None, :, None].expand(batch, k, -1, 1)).squeeze(-1)
    token_smooth = logprobs.sum(-1)  # (B, k, T)
    if token_ll.shape[2] > 1:
        # transformers attaches log p(z|x) to position 1; masking below may then drop it
        at_pos1 = torch.zeros_like(token_ll)
        at_pos1[:, :, 1] = 1.0
        token_ll = token_ll + at_pos1 * doc_logprobs[:, :, None]
        token_smooth = token_smooth + at_pos1 * (vocab * doc_logprobs[:, :, None])
    pad = tgt.eq(pad_token_id)[:, None, :]
    token_ll = token_ll.masked_fill(pad, 0.0)
    token_smooth = token_smooth.masked_fill(pad, 0.0)

    skip_bos = _skips_bos(tgt, bos_token_id, exclude_bos_score)
    ll = token_ll[:, :, 1:].sum(2) if skip_bos else token_ll.sum(2)
    nll = -torch.logsumexp(ll, dim=1)
    smooth = -torch.logsumexp(token_smooth.sum(2), dim=1)
    return _finish(nll, smooth, epsilon, vocab, reduce_loss)


def rag_token_nll(
    seq_logits: Tensor,
    doc_scores: Tensor,
    target: Tensor,
    pad_token_id: int,
    *,
    bos_token_id: int | None = None,
    reduce_loss: bool = False,
    epsilon: float = 0.0,
    exclude_bos_score: bool = False,
) -> Tensor:
    """RAG-Token loss: -sum_t log sum_z p(z|x) p(y_t | x, z, y_<t).

    Args as :func:`rag_sequence_nll`. transformers' RAG-Token loss has no ``exclude_bos_score``; it
    is accepted here for symmetry and, when set, skips position 0 under the same all-rows-BOS rule
    (default False reproduces transformers).

    Math, per question:
        m_t(v) = logsumexp_z (log p(z|x) + log p(v | x, z, y_<t))      (marginal next-token
        log-dist) nll = -sum_t m_t(y_t)          smooth = -sum_t sum_v m_t(v)     (unpadded t only)
    Returns (B,) or a scalar when ``reduce_loss``.
    """
    logprobs, doc_logprobs, tgt = _log_probs(seq_logits, doc_scores, target, pad_token_id)
    vocab = logprobs.shape[-1]
    marginal = torch.logsumexp(logprobs + doc_logprobs[:, :, None, None], dim=1)  # (B, T, V)

    token_ll = marginal.gather(-1, tgt[:, :, None]).squeeze(-1)  # (B, T)
    token_smooth = marginal.sum(-1)
    pad = tgt.eq(pad_token_id)
    token_ll = token_ll.masked_fill(pad, 0.0)
    token_smooth = token_smooth.masked_fill(pad, 0.0)
    if _skips_bos(tgt, bos_token_id, exclude_bos_score):
        token_ll = token_ll[:, 1:]
    return _finish(-token_ll.sum(1), -token_smooth.sum(1), epsilon, vocab, reduce_loss)
