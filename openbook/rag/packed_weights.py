"""Linear weights in oneDNN's blocked layout, reordered once at load: decoding on CPU.

Why: torch multiplies bf16 activations by a bf16 ``nn.Linear`` on CPU through oneDNN, which
first reorders the weight into its own blocked layout, on every call. A decoding step has few
rows (one request's k passages), so that reorder is a large share of the product: it reads and
writes the whole weight, then the product reads it again. Reordered once and kept (what torch's own
compiler does for frozen weights, ``torch.ops.mkldnn._reorder_linear_weight`` and
``_linear_pointwise``), the product reads the weight once. Measured on an AMD EPYC with
AVX512-BF16, 2 threads (docs/benchmarks.md, "Weights packed for oneDNN"): Gemma 3 270M's
262,144 x 640 LM head at 5 rows 12.2 -> 8.1 ms, a 2,048 x 640 layer 1.6x at 5 rows and 1.2x at
a prefill's 700; a default answer's decoding 1.35x faster, the answer 1.20x.

In bf16 on a CPU without AMX the products are the same kernel without the per-call reorder:
**bitwise the same results** (tested; 200 of 200 real requests on an AMD EPYC with AVX512-BF16),
so greedy answers, log-probabilities and passage posteriors do not change. With AMX, oneDNN
runs another kernel for the unpacked weight than for the packed one (another order of
accumulation): on an Intel Xeon with AMX-BF16, 100 of 200 real requests bitwise the same, 198
the same token ids, decoding 1.28x faster (docs/benchmarks.md, "On a processor with AMX";
the development questions in docs/results.md, "Weights packed on AMX").
In float32 torch multiplies with another library (MKL, slow at a few rows), so packing changes
the rounding: oneDNN's product in place of MKL's. It is packed by default too
(:attr:`Packing.AUTO`), measured worth it where float32 is what is served, a CPU without bf16
arithmetic (an AMD EPYC with AVX2 only, 2 threads: 1.375x per answer, decoding 2.07x, the
same token ids as unpacked; docs/results.md, "Weights packed in float32"); :attr:`Packing.BF16`
keeps MKL's float32 products.

A packed module holds the reordered weight only. A weight another module shares (a tied LM head
reads the input embedding's matrix) is kept by that module: the head then holds both layouts
(for Gemma 3 270M, 335 MB more resident in bf16, 671 MB in float32, counted in the RSS
measured at load). A packed model is for inference only (no gradients through
``_linear_pointwise``); :func:`unpack_linears` gives the ``nn.Linear`` modules back (a LoRA
merge, saving) with the very same weights, re-tied to the module they were shared with.
"""

from __future__ import annotations

from enum import StrEnum

import torch
from torch import Tensor, nn

from openbook.errors import InvalidArgument

# Rows per product the layout is chosen for: one RAG-Token request's passages (k=5). Measured on
# the AMD EPYC (LM head, 2 threads): the layout for 5 rows was the fastest of those for 1, 5, 40
# rows and none at 1-5 rows (4.7-5.6 against 7.2-7.7 ms) and within 5% of the best at 40-300.
ROWS_HINT = 5


class Packing(StrEnum):
    """Which models :func:`pack_linears` packs (``OPENBOOK_GENERATOR_PACKED_WEIGHTS``)."""

    AUTO = "auto"  # bf16 and float32 on CPU (float32: oneDNN's rounding in place of MKL's)
    BF16 = "bf16"  # bf16 only: float32 keeps MKL's products
    OFF = "off"


def packs(model: nn.Module, packing: Packing = Packing.AUTO) -> bool:
    """Whether :func:`pack_linears` packs ``model`` under ``packing``: weights on a CPU where
    oneDNN runs, in bf16 (where oneDNN computes bf16), or in float32 under :attr:`Packing.AUTO`."""
    try:
        weight = next(model.parameters())
    except StopIteration:
        return False
    if packing is Packing.OFF or weight.device.type != "cpu":
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return weight.dtype == torch.float32 and packing is Packing.AUTO


class PackedLinear(nn.Module):
    """A bias-free ``nn.Linear``'s product, its weight (out, in) reordered once for oneDNN.

    forward: x (..., in) -> (..., out): in bf16 bitwise what the ``nn.Linear`` it replaced
    gives where oneDNN runs the same kernel for both (not on AMX: module docstring); in float32
    oneDNN's product, where the ``nn.Linear``'s is MKL's (another rounding).
    """

    in_features: int
    out_features: int
    packed_weight: Tensor
    shared: Tensor | None

    def __init__(self, linear: nn.Linear, shared: Tensor | None = None) -> None:
        super().__init__()
        if linear.bias is not None:
            raise InvalidArgument(
                "a packed Linear has no bias (nn.Linear adds one in varying orders)"
            )
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), ROWS_HINT)
        # a buffer, not a parameter: nothing trains it, and .parameters() keeps naming the
        # model's own precision and device
        self.register_buffer("packed_weight", packed, persistent=False)
        # The parameter another module owns and this one was made from (a tied head), given
        # back by unpacked() instead of a copy; held by reference, not stored twice, and not
        # registered here (the owner's state dict names it).
        self.__dict__["shared"] = shared

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")

    def unpacked(self) -> nn.Linear:
        """The ``nn.Linear`` this was made from: the same weight values (the shared parameter
        itself where there was one)."""
        linear = nn.Linear(self.in_features, self.out_features, bias=False, device="meta")
        if isinstance(self.shared, nn.Parameter):
            linear.weight = self.shared
        else:
            dense = self.packed_weight.to_dense()
            linear.weight = nn.Parameter(dense, requires_grad=False)
        return linear

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: nn.Module, packing: Packing = Packing.AUTO) -> int:
    """Replace every ``nn.Linear`` without a bias of ``model`` (where :func:`packs`) by a
    :class:`PackedLinear`; the number replaced (0 where it does not pack, or nothing is left to)."""
    if not packs(model, packing):
        return 0
    owners: dict[int, int] = {}  # id(parameter) -> modules holding it directly
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            # Subclasses (LoRA layers, int8 heads) keep their own products; a bias is added in
            # another order by nn.Linear as the input's rank varies, so biased layers stay.
            if type(child) is not nn.Linear or child.bias is not None:
                continue
            shared = child.weight if owners[id(child.weight)] > 1 else None
            setattr(parent, name, PackedLinear(child, shared))
            replaced += 1
    return replaced


def is_packed(model: nn.Module) -> bool:
    """Whether any of ``model``'s linear layers is a :class:`PackedLinear`."""
    return any(isinstance(m, PackedLinear) for m in model.modules())


def unpack_linears(model: nn.Module) -> int:
    """Give ``model`` back the ``nn.Linear`` modules :func:`pack_linears` replaced; the number
    given back."""
    restored = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.unpacked())
                restored += 1
    return restored
