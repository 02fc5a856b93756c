"""Sampling one token per row from a next-token log-distribution, reproducibly per request.

The distribution a row samples from is the one its search is given: for RAG-Token the passage
marginal of the paper's eq. 2, p(y_i|x,y_<i) = sum_z p(z|x) p(y_i|x,z,y_<i); for RAG-Sequence
the passage's own p(y_i|x,z,y_<i). Its transforms apply in this order (transformers' order):

1. the model family's logits processors (minimum length, forced BOS/EOS, n-gram blocking:
   :func:`openbook.rag.beam._process`), as for greedy and beam search;
2. temperature T: p^(1/T), renormalised (computed as softmax((log p - max log p) / T), so a
   tiny T neither overflows nor turns every token into -inf);
3. top-k: only the k likeliest tokens keep their mass (ties at the k-th value all kept);
4. top-p (nucleus): the smallest set of likeliest tokens whose mass reaches p, taken from the
   distribution after 2 and 3 (the likeliest token always stays);
5. one draw by inverse CDF: the first token whose cumulative mass exceeds u * total, u uniform
   in [0, 1) from the request's own generator. A token of zero mass is never drawn.

Reproducibility: the uniforms come from a CPU ``torch.Generator`` owned by one request (seeded
by its ``seed``, or at random), one per row per step, drawn whether or not the row is still
running, so a request's draws depend on nothing but the request: not on the other requests in
its batch, nor on the device (the same uniforms on CPU and CUDA).
"""

from __future__ import annotations

import secrets

import torch
from torch import Tensor

# A seed given as a signed 64-bit integer maps onto the generator's unsigned 64-bit seeds.
_SEED_MOD = 2**64


def request_generator(seed: int | None) -> torch.Generator:
    """The random generator of one sampling request: seeded with ``seed``, or at random."""
    generator = torch.Generator(device="cpu")
    generator.manual_seed(secrets.randbits(63) if seed is None else seed % _SEED_MOD)
    return generator


def sampling_distribution(scores: Tensor, temperature: float, top_k: int, top_p: float) -> Tensor:
    """The probabilities (rows, V) a draw follows (steps 2-4 of the module docstring), from the
    processed log-probs ``scores`` (rows, V), computed in float32."""
    scores = scores.float()
    top = scores.max(dim=-1, keepdim=True).values
    logits = (scores - top) / temperature
    vocab = logits.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        ordered, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(ordered, dim=-1) - ordered  # mass of the likelier tokens
        drop = before >= top_p
        drop[:, 0] = False
        probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row of ``probs`` (rows, V), by inverse CDF with ``uniforms`` (rows,) in
    [0, 1): the first token whose cumulative mass (in float64) exceeds u * total."""
    cdf = torch.cumsum(probs.double(), dim=-1)
    target = uniforms.to(cdf.device, torch.float64)[:, None] * cdf[:, -1:]
    picked = torch.searchsorted(cdf, target, right=True)[:, 0]
    # u * total rounding up to the total (u = 1 - 2^-53 and a large total) must not walk past
    # the last token with mass: the first position where the CDF reaches the total
    last = (cdf < cdf[:, -1:]).sum(dim=-1)
    return torch.minimum(picked, last)


def sample(
    scores: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator,
) -> Tensor:
    """One token per row (rows,) from the processed log-probs ``scores`` (rows, V)."""
    uniforms = torch.rand(scores.shape[0], generator=generator, dtype=torch.float64)
    return draw(sampling_distribution(scores, temperature, top_k, top_p), uniforms)
