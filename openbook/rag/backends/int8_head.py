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

The error of a logit is at most ``0.5 * scale[v] * sum_j |hidden_j|``; greedy tokens change only
where the top two logits are that close, which is why the head is opt-in and its answer
agreement is measured (docs/results.md). Whether it is faster depends on the rows per step and
the processor (docs/benchmarks.md, "The LM head in int8"): the kernel reads half the bytes but
dequantizes per row, so it pays with few rows (one request's k passages) and loses with many.

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

The input embedding is not touched: a tied model's embedding keeps its own full-precision
matrix, and only the head's product reads the int8 copy.
"""

from __future__ import annotations

import warnings
from enum import StrEnum

import torch
from torch import Tensor, nn

from openbook.errors import InvalidArgument

# torch's CPU kernel reads past the end of a row whose width is not a multiple of 16 (seen as
# segfaults in bf16 on torch 2.13): such heads are refused, never run.
WIDTH_MULTIPLE = 16
_QUANTIZE_ROWS = 16_384  # rows converted at a time: a float32 copy of the whole head is not made


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
    """

    weight_int8: Tensor
    scales: Tensor
    _anchor: Tensor

    def __init__(self, weight: Tensor, product: Int8Product | None = None) -> None:
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
        with torch.no_grad():
            for start in range(0, vocab, _QUANTIZE_ROWS):
                rows = weight[start : start + _QUANTIZE_ROWS].float()
                # an all-zero row keeps scale 1: its codes are 0 whatever the scale
                scale = rows.abs().amax(dim=1) / 127
                scale = torch.where(scale > 0, scale, torch.ones_like(scale))
                codes = torch.round(rows / scale[:, None]).clamp_(-127, 127)
                packed[start : start + len(rows)] = codes.to(torch.int8)
                scales[start : start + len(rows)] = scale
        self.in_features, self.out_features = int(width), int(vocab)
        self.register_buffer("scales", scales.to(weight.dtype))
        self.product = product or Int8Product.for_dtype(weight.dtype)
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
        flat = hidden.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        if self._fbgemm_weight is not None:
            logits = self._dynamic_product(flat)
        else:
            scales = self.scales if self.scales.dtype == flat.dtype else self.scales.to(flat.dtype)
            logits = torch._weight_int8pack_mm(flat, self.weight_int8, scales)
        return logits.reshape(*hidden.shape[:-1], self.out_features)

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
