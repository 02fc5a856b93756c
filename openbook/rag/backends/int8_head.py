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

The input embedding is not touched: a tied model's embedding keeps its own full-precision
matrix, and only the head's product reads the int8 copy.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from openbook.errors import InvalidArgument

# torch's CPU kernel reads past the end of a row whose width is not a multiple of 16 (seen as
# segfaults in bf16 on torch 2.13): such heads are refused, never run.
WIDTH_MULTIPLE = 16
_QUANTIZE_ROWS = 16_384  # rows converted at a time: a float32 copy of the whole head is not made


class Int8Head(nn.Module):
    """``Linear(d, V, bias=False)`` with int8 weights and one scale per output row.

    Buffers: ``weight_int8`` (V, d) int8, ``scales`` (V,) in the precision of the hidden states
    it is given (the model's). ``forward``: hidden (..., d) -> logits (..., V), the hidden
    states' dtype.
    """

    weight_int8: Tensor
    scales: Tensor

    def __init__(self, weight: Tensor) -> None:
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
        self.register_buffer("weight_int8", packed)
        self.register_buffer("scales", scales.to(weight.dtype))

    def forward(self, hidden: Tensor) -> Tensor:
        flat = hidden.reshape(-1, self.in_features)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        scales = self.scales if self.scales.dtype == flat.dtype else self.scales.to(flat.dtype)
        logits = torch._weight_int8pack_mm(flat, self.weight_int8, scales)
        return logits.reshape(*hidden.shape[:-1], self.out_features)

    def dequantized(self) -> Tensor:
        """The weights this head multiplies by, (V, d) float32 (for tests and error bounds)."""
        return self.weight_int8.float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"
