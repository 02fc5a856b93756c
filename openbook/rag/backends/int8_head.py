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

Three products (:class:`Int8Product`), all torch's own kernels:

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

* **oneDNN's int8 x int8** (``torch.ops.onednn.qlinear_pointwise``, the product torch's
  compiler lowers quantized linears to on x86; on a CPU with AMX it runs on AMX's int8 tiles):
  the one :meth:`Int8Product.for_dtype` picks for bf16/fp16 hidden states on a CPU with AMX or
  AVX512-VNNI (int8 dot products in one instruction), where the weight-only kernel is the
  slowest: rescored, at one request's 5 rows, 2.5x the weight-only product and 1.14-1.21x the
  packed bf16 head on AMX, 4x slower than bf16 at 40 (docs/benchmarks.md, "The int8 head on
  AMX"); 3.1x the weight-only product but 0.75x the packed bf16 head on an AMD EPYC with
  AVX512-VNNI and no AMX ("The int8 head without AMX"). Its inputs are int8 too, so each hidden
  state is written as two 7-bit pieces, both multiplied in the same call (2N rows read the
  weights once)::

      m_r = max_j |h_rj|,  u_r = 63 h_r / m_r in [-63, 63],
      hi_r = round(u_r),  lo_r = round(126 (u_r - hi_r))   (both in [-63, 63]),
      h~_r = m_r / 63 * (hi_r + lo_r / 126),  |h_rj - h~_rj| <= m_r / (63 * 252),
      logits_r = m_r / 63 * (hi_r @ Q.T + lo_r @ Q.T / 126) * scale

  The products of integer codes are exact (int32 sums; 7-bit pieces also keep a CPU without
  VNNI, which sums pairs of u8 x s8 products in 16 bits, from saturating), so a row's logits do
  not depend on the rows batched with it, and the hidden states' rounding adds
  ``|h_r - h~_r|_2 * max_v |scale_v Q_v|_2`` to the bound, a few percent of the weights' own.

**The tokens that can be chosen are scored exactly** (the weight-only and oneDNN products).
The int8 product only screens. By Cauchy-Schwarz a token's int8 logit is within
``eps_r(v) = |h_r|_2 * |e_v|_2`` of its exact one, e_v = W_v - scale_v * Q_v the row's rounding
error (its norm kept per token; oneDNN's product adds its hidden state's rounding,
``delta_r = |h_r - h~_r|_2 * max_v |scale_v Q_v|_2``); the row's int8 best a_r is worth at least
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
from openbook.rag.packed_weights import ROWS_HINT

# torch's CPU kernel reads past the end of a row whose width is not a multiple of 16 (seen as
# segfaults in bf16 on torch 2.13): such heads are refused, never run.
WIDTH_MULTIPLE = 16
_QUANTIZE_ROWS = 16_384  # rows converted at a time: a float32 copy of the whole head is not made
# Tokens within this many nats (plus the error bound) of a row's best are scored exactly: greedy
# RAG-Token's choice is then exact for requests of up to e^margin = 64 passages (module docstring).
RESCORE_MARGIN = math.log(64)
# A row with more than this share of the vocabulary to rescore is scored in full precision.
RESCORE_MAX_SHARE = 1 / 16
# bf16 rounds each output, sum and cut the rescoring compares by up to 2^-8 of its size (its unit
# roundoff: 8 bits of precision), four of them (the int8 product's output, the exact product's,
# the upper bound's sum and the cut): the rounding part of the reach, relative to the logits
# compared. (oneDNN's product compares in float32: fewer.)
_ROUNDING = 4 * 2.0**-8


class Int8Product(StrEnum):
    """Which of torch's int8 kernels multiplies by the head (module docstring)."""

    WEIGHT_ONLY = "weight-only"
    DYNAMIC = "dynamic"
    ONEDNN = "onednn"

    @classmethod
    def for_dtype(cls, dtype: torch.dtype) -> Int8Product:
        """The faster product for hidden states of ``dtype`` on this machine: fbgemm's dynamic
        one for float32 where torch's quantized engine is fbgemm's (x86); oneDNN's int8 x int8
        for bf16/fp16 on a CPU with AMX or AVX512-VNNI (measured on both; on a CPU with
        neither, not yet); else weight-only."""
        if dtype == torch.float32 and torch.backends.quantized.engine in ("x86", "fbgemm"):
            return cls.DYNAMIC
        if dtype != torch.float32 and has_int8_dot_products():
            return cls.ONEDNN
        return cls.WEIGHT_ONLY


def has_int8_dot_products() -> bool:
    """Whether oneDNN multiplies int8 by int8 here with an instruction of its own for it: AMX's
    tiles or AVX512-VNNI (torch checks the AVX512 form only)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_vnni_supported())


class Int8Head(nn.Module):
    """``Linear(d, V, bias=False)`` with int8 weights and one scale per output row.

    Buffers: ``weight_int8`` (V, d) int8 (weight-only; the dynamic and oneDNN products keep
    the codes in their library's packed form instead), ``scales`` (V,) in the precision of the
    hidden states it is given (the model's; float32 for oneDNN's product, which takes them so).
    ``forward``: hidden (..., d) -> logits (..., V), the hidden states' dtype. ``product``
    (default: :meth:`Int8Product.for_dtype` of the weight's dtype) says which kernel multiplies.
    ``weight`` itself is kept (not copied) to score again, exactly, the tokens within
    ``margin`` of each row's best (module docstring); ``margin`` None: the int8 product alone.
    """

    weight_int8: Tensor
    scales: Tensor
    error_norms: Tensor
    _anchor: Tensor
    _zero_points: Tensor

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
        self.product = product or Int8Product.for_dtype(weight.dtype)
        if self.product is Int8Product.ONEDNN and not torch.backends.mkldnn.is_available():
            raise InvalidArgument("oneDNN's int8 LM head needs torch built with oneDNN")
        # the scales as the product reads them: oneDNN's in float32, the others' in the model's
        scale_dtype = torch.float32 if self.product is Int8Product.ONEDNN else weight.dtype
        packed = torch.empty((vocab, width), dtype=torch.int8)
        scales = torch.empty(vocab, dtype=torch.float32)
        # per row v: |W_v - scale_v * Q_v|_2 with the scale as the product reads it: the
        # weights' error, in the rescoring's bound
        error_norms = torch.empty(vocab, dtype=torch.float32)
        l1_max = 0.0  # max_v |W~_v|_1: the dynamic product's activation rounding, in its bound
        l2_max = 0.0  # max_v |W~_v|_2: oneDNN's, in its bound
        with torch.no_grad():
            for start in range(0, vocab, _QUANTIZE_ROWS):
                rows = weight[start : start + _QUANTIZE_ROWS].float()
                # an all-zero row keeps scale 1: its codes are 0 whatever the scale
                scale = rows.abs().amax(dim=1) / 127
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                codes = torch.round(rows / scale[:, None]).clamp_(-127, 127)
                packed[start : start + len(rows)] = codes.to(torch.int8)
                scales[start : start + len(rows)] = scale
                used = scale.to(scale_dtype).float()[:, None] * codes
                error_norms[start : start + len(rows)] = (rows - used).norm(dim=1)
                l1_max = max(l1_max, float(used.abs().sum(dim=1).max()))
                l2_max = max(l2_max, float(used.norm(dim=1).max()))
        self.in_features, self.out_features = int(width), int(vocab)
        if self.product is Int8Product.DYNAMIC:
            # its hidden states rounded to 7 bits make the bound tens of nats on a real model's
            # rows (a few entries ~60): every row would fall back to full precision
            margin = None
        self.margin = margin
        self._reference = weight.detach() if margin is not None else None
        # float32 whatever the model's precision: rounded down, a bound would not be one
        self.register_buffer("error_norms", error_norms, persistent=False)
        self._l1_max = l1_max
        self._l2_max = l2_max
        self.rescored_tokens = 0  # tokens scored again, over all steps (for benchmarks)
        self.full_steps = 0  # rows scored wholly in full precision (too many candidates)
        self.register_buffer("scales", scales.to(scale_dtype))
        self._fbgemm_weight: object | None = None
        self._onednn_weight: Tensor | None = None
        if self.product is Int8Product.WEIGHT_ONLY:
            self.register_buffer("weight_int8", packed)
        elif self.product is Int8Product.ONEDNN:
            # the codes live once, in oneDNN's blocked layout (reordered for a step's rows)
            self._onednn_weight = torch.ops.onednn.qlinear_prepack(packed, [2 * ROWS_HINT, width])
            del packed
            self.register_buffer(
                "_zero_points", torch.zeros(vocab, dtype=torch.long), persistent=False
            )
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
        logits, delta = self._product(flat)
        if self._reference is not None and len(flat):
            logits = self._rescored(flat, logits, delta)
        return logits.to(hidden.dtype).reshape(*hidden.shape[:-1], self.out_features)

    def approximate(self, hidden: Tensor) -> Tensor:
        """hidden (..., d) -> logits (..., V) of the int8 product alone (no rescoring)."""
        flat = hidden.reshape(-1, self.in_features).contiguous()
        logits, _ = self._product(flat)
        return logits.to(hidden.dtype).reshape(*hidden.shape[:-1], self.out_features)

    def _product(self, flat: Tensor) -> tuple[Tensor, Tensor | None]:
        """(N, d) -> the int8 logits (N, V) and, where the product rounds the hidden states
        too, by how much each row's logits can move for it (N, 1) float32 (else None)."""
        if self._fbgemm_weight is not None:
            return self._dynamic_product(flat), None
        if self._onednn_weight is not None:
            return self._onednn_product(flat)
        scales = self.scales if self.scales.dtype == flat.dtype else self.scales.to(flat.dtype)
        return torch._weight_int8pack_mm(flat, self.weight_int8, scales), None

    def error_bound(self, flat: Tensor) -> Tensor:
        """(N, d) -> (N, V) float32: how far each int8 logit can be from the one of the
        full-precision weights, before rounding of the outputs: ``|h_r|_2 * |e_v|_2`` for the
        weights' error e_v (Cauchy-Schwarz; per token, so a row of small codes is trusted
        more), plus the hidden states' rounding for the dynamic and oneDNN products (module
        docstring)."""
        rows = flat.float()
        bound = rows.norm(dim=1, keepdim=True) * self.error_norms.float()[None]
        if self._fbgemm_weight is not None:
            bound += rows.abs().amax(dim=1, keepdim=True) * (2 / 127) * self._l1_max
        if self._onednn_weight is not None:
            _, _, residual = _pieces(rows)
            bound += residual * self._l2_max
        return bound

    def _rescored(self, flat: Tensor, logits: Tensor, delta: Tensor | None) -> Tensor:
        """(N, d), (N, V) int8 logits, (N, 1) the hidden states' share of their bound (None:
        none) -> the same logits with every token that can be chosen scored by the
        full-precision weights (module docstring). Row by row: which of a row's logits are
        exact depends on that row alone, never on the rows batched with it.

        Besides the product, three vectorized passes over the (N, V) logits: each row's best,
        the upper bounds, and their maxima by blocks of _BLOCK tokens; only the blocks whose
        maximum reaches the cut are compared token by token (torch's argmax, nonzero and
        counts over 262,144 entries a row cost several times a maximum on CPU)."""
        assert self._reference is not None and self.margin is not None
        vocab = logits.shape[1]
        norms = flat.float().norm(dim=1, keepdim=True)  # (N, 1)
        top, best = _row_best(logits)  # (N, 1) float32, (N, 1): the row's int8 best, a_r
        slack = norms * self.error_norms[best]  # its exact logit is >= top - slack
        if delta is not None:  # the hidden state's rounding moves every logit of the row:
            slack = slack + 2 * delta  # the best's, and each candidate's (the cut below)
        # bf16 rounds both products' outputs, the sum below and the cut, each by at most 2^-8
        # of the logits compared (no larger than |top| + the reach)
        reach = self.margin + slack
        reach = reach + _ROUNDING * (top.abs() + reach)
        cut = top - reach  # (N, 1)
        # v may be chosen where its largest possible exact logit reaches the cut:
        # L~_r(v) + |h_r|_2 |e_v|_2 (+ delta_r) >= L~_r(a_r) - |h_r|_2 |e_a|_2 (- delta_r)
        #                                            - margin - rounding
        upper = torch.addcmul(logits, norms, self.error_norms[None])  # (N, V) float32
        # (P,), (P,): the chosen pairs, of the rows with at most RESCORE_MAX_SHARE chosen
        rows, tokens, flat_rows = _reaching(upper, cut, RESCORE_MAX_SHARE * vocab)
        del upper
        if bool(flat_rows.any()):  # too many near the best: the whole row in full precision
            self.full_steps += int(flat_rows.sum())
            full = flat_rows.nonzero().squeeze(1)
            logits[full] = (flat[full] @ self._reference.T).to(logits.dtype)
        if len(rows):
            unique, position = tokens.unique(return_inverse=True)
            self.rescored_tokens += len(unique)
            exact = flat @ self._reference[unique].T  # (N, T): the model's own product
            logits[rows, tokens] = exact[rows, position].to(logits.dtype)
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

    def _onednn_product(self, flat: Tensor) -> tuple[Tensor, Tensor]:
        """(N, d) -> (N, V) float32 through oneDNN, each hidden state in two 7-bit pieces
        multiplied in one call, and each row's hidden-state share of its bound, delta_r (N, 1)
        (module docstring). Float32 out: in bf16 oneDNN rounds a row's outputs differently
        with the number of rows (seen on AMX), and a row's logits must not depend on its batch."""
        n = len(flat)
        codes, magnitude, residual = _pieces(flat.float())
        products = torch.ops.onednn.qlinear_pointwise(
            codes, 1.0, _PIECE_ZERO, self._onednn_weight, self.scales, self._zero_points,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip
        # (2N, V): hi_r @ Q.T * scale, then lo_r @ Q.T * scale
        logits = products[:n].add_(products[n:], alpha=1 / _PIECE_LOW)
        return logits.mul_(magnitude / _PIECE), residual * self._l2_max

    @property
    def transient_bytes_per_logit(self) -> int:
        """Bytes per logit of a step this head holds beside the logits it returns, at its
        peak (the memory model counts them): oneDNN's two float32 pieces, fbgemm's float32
        output and its scaled copy, and the rescoring's float32 upper bounds, candidate mask
        and chosen pairs (two int64 indices each, for at most RESCORE_MAX_SHARE of a row)."""
        # torch's weight-only kernel returns the model's precision: the logits themselves
        float32_out = self._onednn_weight is not None or self._fbgemm_weight is not None
        product = 2 * 4 if float32_out else 0
        return product + (4 + 1 + 1 if self._reference is not None else 0)

    def dequantized(self) -> Tensor:
        """The weights this head multiplies by, (V, d) float32 (for tests and error bounds)."""
        if self._fbgemm_weight is not None:
            codes, _ = torch.ops.quantized.linear_unpack(self._fbgemm_weight)
            return codes.dequantize()
        if self._onednn_weight is not None:  # stored (d, V), in oneDNN's layout
            return self._onednn_weight.to_dense().T.float() * self.scales.float()[:, None]
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"int8 {self.product.value}"
        )


def _row_best(logits: Tensor) -> tuple[Tensor, Tensor]:
    """(N, V) -> each row's largest value (N, 1) float32 and an index holding it (N, 1): the
    maxima of blocks of _BLOCK entries, then the argmax inside the best block."""
    n, vocab = logits.shape
    if vocab % _BLOCK:
        best = logits.argmax(dim=1, keepdim=True)
        return logits.gather(1, best).float(), best
    blocks = logits.view(n, vocab // _BLOCK, _BLOCK)
    block = blocks.amax(dim=2).argmax(dim=1)  # (N,): a block holding the row's maximum
    inside = blocks[torch.arange(n), block].argmax(dim=1)  # (N,)
    best = (block * _BLOCK + inside)[:, None]
    return logits.gather(1, best).float(), best


def _reaching(values: Tensor, cut: Tensor, limit: float) -> tuple[Tensor, Tensor, Tensor]:
    """(N, V), (N, 1) -> the (row, column) pairs where ``values >= cut``, row-major, of the
    rows with at most ``limit`` of them, and which rows had more (N,) bool (their pairs are
    left out: at most ``limit`` pairs a row are ever listed). By blocks of _BLOCK columns: a
    block is looked at entry by entry only where its maximum reaches the row's cut (every
    entry where V is not a multiple of _BLOCK)."""
    n, vocab = values.shape
    if vocab % _BLOCK:
        reached = values >= cut  # (N, V)
        over = reached.count_nonzero(dim=1) > limit
        reached[over] = False
        rows, columns = reached.nonzero(as_tuple=True)
        return rows, columns, over
    blocks = values.view(n, vocab // _BLOCK, _BLOCK)
    block_rows, block_ids = (blocks.amax(dim=2) >= cut).nonzero(as_tuple=True)  # (K,)
    inside = blocks[block_rows, block_ids] >= cut[block_rows]  # (K, _BLOCK)
    counts = torch.zeros(n, dtype=torch.long).index_add_(0, block_rows, inside.count_nonzero(dim=1))
    over = counts > limit
    inside[over[block_rows]] = False
    which, offset = inside.nonzero(as_tuple=True)
    return block_rows[which], block_ids[which] * _BLOCK + offset, over


# Entries per block of a row of logits (a power of two divides Gemma's 262,144 and most
# vocabularies padded for their kernels): a block's maximum screens it whole.
_BLOCK = 1024

# oneDNN's hidden-state pieces (module docstring): a row scaled to [-_PIECE, _PIECE], its high
# piece rounded, the remainder times _PIECE_LOW rounded; both stored as u8 around _PIECE_ZERO.
_PIECE = 63
_PIECE_LOW = 126
_PIECE_ZERO = 64


def _pieces(rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """rows (N, d) float32 -> codes (2N, d) uint8 (the high pieces, then the low ones, offset
    by _PIECE_ZERO), each row's magnitude m_r (N, 1) and |h_r - h~_r|_2 (N, 1)."""
    magnitude = rows.abs().amax(dim=1, keepdim=True)
    magnitude = torch.where(magnitude > 0, magnitude, torch.ones_like(magnitude))
    unit = rows * (_PIECE / magnitude)
    high = torch.round(unit)
    low = torch.round((unit - high) * _PIECE_LOW)
    approx = (high + low / _PIECE_LOW) * (magnitude / _PIECE)
    residual = (rows - approx).norm(dim=1, keepdim=True)
    codes = torch.cat([high, low]).add_(_PIECE_ZERO).to(torch.uint8)
    return codes, magnitude, residual


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
