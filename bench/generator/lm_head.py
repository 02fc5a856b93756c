"""The LM head's matrix product alone: the model's weights against int8 ones (issue 45, item 2).

One decoding step of the default generator multiplies every decoder row's final hidden state
(d = 640) by Gemma 3's tied 262,144 x 640 embedding: at bf16 that reads 335 MB per step, about
two thirds of the step's weight traffic. This measures, in one process and one run (the paths
alternate round by round, so a busy machine slows them alike), what reading int8 weights
instead would give, through the two paths torch offers on CPU:

- ``int8pack``: weight-only int8, one scale per output row (``torch._weight_int8pack_mm``);
  the activations stay in the model's precision.
- ``dynamic``: torch's dynamically quantised linear (``torch.ao`` qint8, fbgemm), which also
  quantises the activations at each call (one scale for the whole batch).
- ``engine``: the product of the engine's own :class:`~openbook.rag.backends.int8_head.Int8Head`
  for the dtype, what ``OPENBOOK_GENERATOR_LM_HEAD=int8`` multiplies with: weight-only in bf16,
  fbgemm's dynamic product with every row quantized on its own (batch-independent) in float32
  on x86. Without its rescoring of each row's near-best tokens (``margin=None``): how many
  tokens that rescores depends on a real model's hidden states, not random ones; its cost is
  in the end-to-end figures of ``bench/generator/engine.py``.
- ``onednn``: oneDNN's int8 x int8 product (``torch.ops.onednn.qlinear_pointwise``, the kernel
  of torch's x86 quantization; AMX-INT8 or VNNI where the processor has them), the hidden
  states quantized row by row to 8 bits of their largest magnitude (u8, zero point 128) on
  every call and the product's output multiplied back by it: the product alone, what an int8
  head on oneDNN could gain at most before any rescoring (docs/benchmarks.md, "oneDNN's int8
  product").
- ``packed``: the model's own weights reordered once into oneDNN's blocked layout
  (:class:`~openbook.rag.packed_weights.PackedLinear`, what the service serves bf16 causal models
  with by default): the model's product without its per-call reorder, bitwise the same in bf16
  (in float32 torch's plain product is MKL's, so there it is another rounding, and the service
  does not pack).

Reported per row count (the rows of a step: k passages x requests running): the median ms of
each path, its ratio to the model's precision, and how often the argmax (the greedy token)
agrees with the unquantised product on random hidden states.

    .venv/bin/python bench/generator/lm_head.py --json docs/bench/lm-head-<cpu>.json

The vocabulary and width default to Gemma 3 270M's; weights are random (scale 0.05), which is
what the cost depends on. ``_weight_int8pack_mm`` is only run with d a multiple of 16: with
other widths its CPU kernel reads out of bounds in bf16 (segfaults seen on torch 2.13).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from openbook.rag.backends.int8_head import Int8Head
from openbook.rag.packed_weights import PackedLinear


def _median_ms(fn: Callable[[], object], rounds: int) -> float:
    fn()  # warm-up: first-call allocations and kernel selection
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _onednn_product(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
    """hidden (N, d) -> (N, V) in ``dtype`` through oneDNN's int8 x int8 product with ``codes``
    (V, d) int8 and ``scales`` (V,) float32, each row of hidden quantized on its own."""
    weight = torch.ops.onednn.qlinear_prepack(codes, None)
    zero_points = torch.zeros(len(scales), dtype=torch.long)
    out = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32

    def product(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.float()
        magnitude = rows.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
        unsigned = (torch.round(rows * (127 / magnitude)) + 128).to(torch.uint8)
        logits = torch.ops.onednn.qlinear_pointwise(
            unsigned, 1 / 127, 128, weight, scales, zero_points,
            None, 1.0, 0, out, "none", [], "",
        )  # fmt: skip
        return logits.mul_(magnitude.to(out)).to(dtype)

    return product


def _cpu_flags() -> list[str]:
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")
    try:
        flags = Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split()
    except (OSError, IndexError):
        return []
    return [f for f in wanted if f in flags]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--width", type=int, default=640)
    ap.add_argument("--rows", default="1,5,10,40", help="decoder rows per step, comma-separated")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    if args.width % 16:
        ap.error("--width must be a multiple of 16 (see the module's docstring)")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)

    weight = torch.randn(args.vocab, args.width) * 0.05
    scales = weight.abs().amax(dim=1) / 127  # (V,): one per output row
    packed = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (V, d)
    model_weight = weight.to(dtype)
    linear = torch.nn.Linear(args.width, args.vocab, bias=False)
    linear.weight.data = weight
    dynamic = torch.ao.quantization.quantize_dynamic(
        torch.nn.Sequential(linear), {torch.nn.Linear}, dtype=torch.qint8
    )
    row_scales = scales.to(dtype)
    engine_head = Int8Head(model_weight, margin=None)  # the product alone (docstring)
    plain = torch.nn.Linear(args.width, args.vocab, bias=False, dtype=dtype)
    plain.weight.data = model_weight
    packed_head = PackedLinear(plain)
    onednn = _onednn_product(packed, scales, dtype)

    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        hidden = torch.randn(rows, args.width)  # (rows, d)
        x = hidden.to(dtype)
        with torch.inference_mode():
            exact = hidden @ weight.T  # (rows, V), float32
            paths: dict[str, Callable[[], torch.Tensor]] = {
                "model": lambda x=x: torch.nn.functional.linear(x, model_weight),
                "int8pack": lambda x=x: torch._weight_int8pack_mm(x, packed, row_scales),
                "dynamic": lambda hidden=hidden: dynamic(hidden),
                "engine": lambda x=x: engine_head(x),
                "onednn": lambda x=x: onednn(x),
                "packed": lambda x=x: packed_head(x),
            }
            ms: dict[str, list[float]] = {name: [] for name in paths}
            for _ in range(3):  # alternate the paths: drift on a busy machine hits all alike
                for name, fn in paths.items():
                    ms[name].append(_median_ms(fn, max(1, args.rounds // 3)))
            agree = {
                name: float((fn().float().argmax(-1) == exact.argmax(-1)).float().mean())
                for name, fn in paths.items()
            }
        row = {
            "rows": rows,
            "ms": {name: statistics.median(v) for name, v in ms.items()},
            "argmax_agrees": agree,
        }
        base = row["ms"]["model"]
        row["speedup"] = {name: base / v for name, v in row["ms"].items()}
        results.append(row)
        print(
            f"rows {rows:3d}: model ({args.dtype}) {base:7.1f} ms | "
            + " | ".join(
                f"{n} {row['ms'][n]:7.1f} ms ({row['speedup'][n]:.2f}x, argmax {agree[n]:.2f})"
                for n in ("int8pack", "dynamic", "engine", "onednn", "packed")
            )
        )
    report = {
        "vocab": args.vocab,
        "width": args.width,
        "dtype": args.dtype,
        "engine_product": engine_head.product.value,
        "threads": args.threads,
        "torch": torch.__version__,
        "processor": platform.processor() or platform.machine(),
        "cpu_flags": _cpu_flags(),
        "results": results,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
