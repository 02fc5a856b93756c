"""An LM head with int8 weights, for decoding on CPU (issue 45, item 2).

A decoding step multiplies every decoder row's final hidden state by the output embedding:
for Gemma 3 270M a 262,144 x 640 matrix, 335 MB in bf16, about two thirds of the weight bytes a
step reads. Stored in int8 with one scale per output row (weight-only, symmetric), it is half
of that; the hidden states stay in the model's precision and the product is torch's own
weight-only int8 kernel (``torch._weight_int8pack_mm``, what torchao's int8 weight-only layout
dispatches to on CPU), not a kernel of ours.

    W (V, d) ~ scale[:, None] * Q,  Q = round(W / scale[:, None]) in [-127, 127] (int8),
    scale[v] = max_j |W[v, j]| / 127,
    logits (..., V) = hidden (..., d) @ (scale[:, None] * Q).T

The error of a logit is at most ``0.5 * scale[v] * sum_j |hidden_j|``; greedy tokens would change
where the top two logits are that close (11 of 300 development answers did, docs/results.md),
so the tokens that can be chosen are scored again exactly (below). Whether it is faster
depends on the rows per step and the processor (docs/benchmarks.md, "The LM head in int8"):
the kernel reads half the bytes but dequantizes per row, so it pays with few rows (one
request's k passages) and loses with many.

Two products, one per kind of hidden state (:class:`Int8Product`), both torch's own kernels:

* **weight-only** (bf16/fp16 hidden states): ``torch._weight_int8pack_mm``, above. Exact up to
  the weights' rounding.
* **dynamic** (float32 hidden states on x86, where ``auto`` serves float32 because the CPU has no
  bf16 arithmetic): fbgemm's int8 x int8 product (``torch.ops.quantized.linear_dynamic``),
  which quantizes the hidden states too, on every call. On an AVX2-only CPU the weight-only
  kernel has no fast float32 path (twice as slow as the float32 head end to end,
  docs/benchmarks.md), while fbgemm's reads the same int8 bytes ~10x faster than the float32
  head. fbgemm picks one activation scale per call from the whole batch's range; a row's
  logits must not depend on what is batched with it, so each row is divided by its own largest
  magnitude and one anchor row ``[1, -1, 0, ...]`` fixes the batch's range at [-1, 1]: every
  row is then quantized with the same fixed step 2/127 (7-bit, fbgemm's ``reduce_range`` that
  AVX2's 16-bit pair sums need), and multiplied back by its magnitude after the product::

      m_r = max_j |h_rj|,  a_r = quant(h_r / m_r)  (step 2/127, error <= 2/127 per entry),
      logits_r = m_r * (a_r @ (scale[:, None] * Q).T)

  so the error of a logit grows by at most ``m_r * 2/127 * sum_j |scale[v] * Q[v, j]|``.

**The tokens that can be chosen are scored exactly** (the weight-only product). The int8 product
only screens. By Cauchy-Schwarz a token's int8 logit is within ``eps_r(v) = |h_r|_2 * |e_v|_2`` of
its exact one, e_v = W_v - scale_v * Q_v the row's rounding error (its norm kept per token);
the row's int8 best a_r is worth at least
``L~_r(a_r) - eps_r(a_r)``. Every token whose int8 logit plus its own bound reaches that, less
``margin`` and bf16's rounding, is scored again with the model's own full-precision weights (the
tied embedding's matrix, not a copy), and its exact logit replaces the int8 one::

    C_r = {v : L~_r(v) + eps_r(v) >= L~_r(a_r) - eps_r(a_r) - margin - rounding}
    logits[r, C_r] = h_r @ W[C_r].T          (W: the full-precision head)

A token outside C_r has p_r(v) < exp(-margin) * p_r(a_r), a_r the row's int8 best (in C_r, so
exact). A token in no row's C_r therefore has a RAG-Token marginal sum_r w_r p_r(v) below
exp(-margin) * k times the best candidate's: with ``margin >= ln k`` greedy RAG-Token's choice
over k passage rows is among tokens scored exactly where they matter, and with any margin
RAG-Sequence's per-row greedy choice is. What stays approximate (each term within its eps_r) is the
normalizer's share of the tokens outside C_r and a candidate's terms in rows where it is far
from the best: they move log-probabilities and passage posteriors by a rounding-sized amount
where a few tokens hold a row's mass. The default margin, ln 64 (:data:`RESCORE_MARGIN`), makes
greedy RAG-Token's choice exact for up to 64 passages. A row whose own candidates would be more
than :data:`RESCORE_MAX_SHARE` of the vocabulary (a flat distribution) is scored wholly with the
full-precision weights. Which of a row's logits are exact depends on that row alone, so a
request's logits do not depend on its batch. So answers are the full-precision head's up to the
rounding that decides near-ties anyway, while a step reads int8 weights for all but the few
hundred to few thousand rows of the head that it scores again.

The dynamic product is not rescored: its hidden states' 7-bit rounding adds
``m_r * 2/127 * |W~_v|_1`` to the bound, tens of nats on Gemma 3's final hidden states (a few
entries near 60), so every row would fall back to the full-precision product (measured: 63 of 65
rows in 13 steps); it stays the approximate product above. Setting the largest channels aside
does not rescue it (the large entries are spread over many channels: docs/results.md, "The LM
head in int8 in float32"), and unrescored it kept 90.7% of 216 development answers, below the
97% a default needs.

The input embedding is not touched: a tied model's embedding keeps its own full-precision
matrix, which the rescoring reads (an untied head's full-precision matrix is kept for it too),
and the screening product reads the int8 copy.
"""

from __future__ import annotations

import math
import warnings
from enum import StrEnum

import torch
from torch import Tensor, nn

from openbook.errors import InvalidArgument

# torch's CPU kernel reads past the end of a row whose width is not a multiple of 16 (seen as
# segfaults in bf16 on torch 2.13): such heads are refused, never run.
WIDTH_MULTIPLE = 16
_QUANTIZE_ROWS = 16_384  # rows converted at a time: a float32 copy of the whole head is not made
# Tokens within this many nats (plus the error bound) of a row's best are scored exactly: greedy
# RAG-Token's choice is then exact for requests of up to e^margin = 64 passages (module docstring).
RESCORE_MARGIN = math.log(64)
# A row with more than this share of the vocabulary to rescore is scored in full precision.
RESCORE_MAX_SHARE = 1 / 16
# bf16 rounds each output, sum and cut the rescoring compares to 2^-9 of its size; four of them:
# the rounding part of the reach, relative to the logits compared.
_ROUNDING = 2.0**-7


class Int8Product(StrEnum):
    """Which of torch's int8 kernels multiplies by the head (module docstring)."""

    WEIGHT_ONLY = "weight-only"
    DYNAMIC = "dynamic"

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Int8Product:
        """The faster product for hidden states of ``dtype`` on this machine: fbgemm's dynamic
        one for float32 where torch's quantized engine is fbgemm's (x86), else weight-only."""
        if dtype == torch.float32 and torch.backends.quantized.engine in ("x86", "fbgemm"):
            return cls.DYNAMIC
        return cls.WEIGHT_ONLY


class Int8Head(nn.Module):
    """``Linear(d, V, bias=False)`` with int8 weights and one scale per output row.

    Buffers: ``weight_int8`` (V, d) int8 (weight-only; the dynamic product keeps the codes in
    fbgemm's packed form instead), ``scales`` (V,) in the precision of the hidden states
    it is given (the model's). ``forward``: hidden (..., d) -> logits (..., V), the hidden
    states' dtype. ``product`` (default: :meth:`Int8Product.for_dtype` of the weight's dtype)
    says which kernel multiplies; the dynamic one also keeps fbgemm's packed copy of the codes.
    ``weight`` itself is kept (not copied) to score again, exactly, the tokens within
    ``margin`` of each row's best (module docstring); ``margin`` None: the int8 product alone.
    """

    weight_int8: Tensor
    scales: Tensor
    error_norms: Tensor
    _anchor: Tensor

    def __init__(
        self,
        weight: Tensor,
        product: Int8Product | None = None,
        margin: float | None = RESCORE_MARGIN,
    ) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise InvalidArgument(
                f"an LM head's weight is (vocab, width), got {tuple(weight.shape)}"
            )
        vocab, width = weight.shape
        if width % WIDTH_MULTIPLE:
            raise InvalidArgument(
                f"an int8 LM head needs a width that is a multiple of {WIDTH_MULTIPLE} "
                f"(torch's int8 kernel); this model's is {width}"
            )
        if weight.device.type != "cpu":
            raise InvalidArgument(f"the int8 LM head runs on CPU; this model is on {weight.device}")
        packed = torch.empty((vocab, width), dtype=torch.int8)
        scales = torch.empty(vocab, dtype=torch.float32)
        # per row v: |W_v - scale_v * Q_v|_2 with the scale as the product reads it (rounded to
        # the model's precision): the weights' error, in the rescoring's bound
        error_norms = torch.empty(vocab, dtype=torch.float32)
        l1_max = 0.0  # max_v |W~_v|_1: the dynamic product's activation rounding, in its bound
        with torch.no_grad():
            for start in range(0, vocab, _QUANTIZE_ROWS):
                rows = weight[start : start + _QUANTIZE_ROWS].float()
                # an all-zero row keeps scale 1: its codes are 0 whatever the scale
                scale = rows.abs().amax(dim=1) / 127
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                codes = torch.round(rows / scale[:, None]).clamp_(-127, 127)
                packed[start : start + len(rows)] = codes.to(torch.int8)
                scales[start : start + len(rows)] = scale
                used = scale.to(weight.dtype).float()[:, None] * codes
                error_norms[start : start + len(rows)] = (rows - used).norm(dim=1)
                l1_max = max(l1_max, float(used.abs().sum(dim=1).max()))
        self.in_features, self.out_features = int(width), int(vocab)
        self.product = product or Int8Product.for_dtype(weight.dtype)
        if self.product is Int8Product.DYNAMIC:
            # its hidden states rounded to 7 bits make the bound tens of nats on a real model's
            # rows (a few entries ~60): every row would fall back to full precision
            margin = None
        self.margin = margin
        self._reference = weight.detach() if margin is not None else None
        self.register_buffer("error_norms", error_norms.to(weight.dtype), persistent=False)
        self._l1_max = l1_max
        self.rescored_tokens = 0  # tokens scored again, over all steps (for benchmarks)
        self.full_steps = 0  # rows scored wholly in full precision (too many candidates)
        self.register_buffer("scales", scales.to(weight.dtype))
        self._fbgemm_weight: object | None = None
        if self.product is Int8Product.WEIGHT_ONLY:
            self.register_buffer("weight_int8", packed)
        else:
            # the codes live once, in fbgemm's packed form (a second copy would be V x d bytes)
            self._fbgemm_weight = _fbgemm_packed(packed, scales)
            del packed
            # [1, -1, 0, ...]: fixes every call's activation range at [-1, 1] (module docstring)
            anchor = torch.zeros(1, width, dtype=torch.float32)
            anchor[0, 0], anchor[0, 1] = 1.0, -1.0
            self.register_buffer("_anchor", anchor, persistent=False)

    def forward(self, hidden: Tensor) -> Tensor:
        """hidden (..., d) -> logits (..., V): the int8 product, its near-best tokens exact."""
        flat = hidden.reshape(-1, self.in_features).contiguous()  # a view when it already is
        logits = self._product(flat)
        if self._reference is not None and len(flat):
            logits = self._rescored(flat, logits)
        return logits.reshape(*hidden.shape[:-1], self.out_features)

    def approximate(self, hidden: Tensor) -> Tensor:
        """hidden (..., d) -> logits (..., V) of the int8 product alone (no rescoring)."""
        flat = hidden.reshape(-1, self.in_features).contiguous()
        return self._product(flat).reshape(*hidden.shape[:-1], self.out_features)

    def _product(self, flat: Tensor) -> Tensor:
        if self._fbgemm_weight is not None:
            return self._dynamic_product(flat)
        scales = self.scales if self.scales.dtype == flat.dtype else self.scales.to(flat.dtype)
        return torch._weight_int8pack_mm(flat, self.weight_int8, scales)

    def error_bound(self, flat: Tensor) -> Tensor:
        """(N, d) -> (N, V) float32: how far each int8 logit can be from the one of the
        full-precision weights, before rounding of the outputs: ``|h_r|_2 * |e_v|_2`` for the
        weights' error e_v (Cauchy-Schwarz; per token, so a row of small codes is trusted
        more), plus, for the dynamic product, the hidden states' rounding (module docstring)."""
        rows = flat.float()
        bound = rows.norm(dim=1, keepdim=True) * self.error_norms.float()[None]
        if self._fbgemm_weight is not None:
            bound += rows.abs().amax(dim=1, keepdim=True) * (2 / 127) * self._l1_max
        return bound

    def _rescored(self, flat: Tensor, logits: Tensor) -> Tensor:
        """(N, d), (N, V) int8 logits -> the same with every token that can be chosen scored by
        the full-precision weights (module docstring). Row by row: which of a row's logits are
        exact depends on that row alone, never on the rows batched with it."""
        assert self._reference is not None and self.margin is not None
        norms = flat.float().norm(dim=1, keepdim=True)  # (N, 1)
        best = logits.argmax(dim=1, keepdim=True)  # (N, 1): the row's int8 best, a_r
        top = logits.gather(1, best).float()
        slack = norms * self.error_norms.float()[best]  # its exact logit is >= top - slack
        # bf16 rounds both products' outputs, the sum below and the cut, each by at most 2^-9
        # of the logits compared (no larger than |top| + the reach)
        reach = self.margin + slack
        reach = reach + _ROUNDING * (top.abs() + reach)
        cut = (top - reach).to(logits.dtype)
        # v may be chosen where its largest possible exact logit reaches the cut:
        # L~_r(v) + |h_r|_2 |e_v|_2 >= L~_r(a_r) - |h_r|_2 |e_a|_2 - margin - rounding
        dtype = logits.dtype
        upper = torch.addcmul(logits, norms.to(dtype), self.error_norms.to(dtype)[None])
        candidates = upper >= cut  # (N, V)
        del upper
        flat_rows = candidates.sum(dim=1) > RESCORE_MAX_SHARE * self.out_features
        if bool(flat_rows.any()):  # too many near the best: the whole row in full precision
            self.full_steps += int(flat_rows.sum())
            full = flat_rows.nonzero().squeeze(1)
            logits[full] = (flat[full] @ self._reference.T).to(logits.dtype)
            candidates[full] = False
        tokens = candidates.any(dim=0).nonzero().squeeze(1)
        if len(tokens):
            self.rescored_tokens += len(tokens)
            exact = (flat @ self._reference[tokens].T).to(logits.dtype)
            own = candidates[:, tokens]
            logits[:, tokens] = torch.where(own, exact, logits[:, tokens])
        return logits

    def _dynamic_product(self, flat: Tensor) -> Tensor:
        """(N, d) -> (N, V) through fbgemm, each row quantized on its own (module docstring)."""
        dtype = flat.dtype
        rows = flat.float()
        magnitude = rows.abs().amax(dim=1, keepdim=True)
        magnitude = torch.where(magnitude > 0, magnitude, torch.ones_like(magnitude))
        unit = torch.cat([rows / magnitude, self._anchor])
        logits = torch.ops.quantized.linear_dynamic(unit, self._fbgemm_weight, True)[:-1]
        return (logits * magnitude).to(dtype)

    def dequantized(self) -> Tensor:
        """The weights this head multiplies by, (V, d) float32 (for tests and error bounds)."""
        if self._fbgemm_weight is not None:
            codes, _ = torch.ops.quantized.linear_unpack(self._fbgemm_weight)
            return codes.dequantize()
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 {self.product.value}"
        )


def _fbgemm_packed(codes: Tensor, scales: Tensor) -> object:
    """fbgemm's packed form of ``codes`` (V, d) int8 with one float32 scale per row: the
    per-channel qint8 tensor its prepack takes, built from the same codes (zero points 0)."""
    with warnings.catch_warnings():
        # torch 2.13 marks quantized-tensor creation deprecated (pytorch#184982); fbgemm's
        # prepack still takes only such a tensor, and torch is pinned (constraints.txt).
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(
            codes, scales.double(), torch.zeros(len(scales), dtype=torch.long), 0
        )
    return torch.ops.quantized.linear_prepack(weight, None)
