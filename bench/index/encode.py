"""Index encoding throughput: passages/s of the document encoder as ``index build`` runs it.

Compares, in one run on the same passages, batch size and machine state:

* ``reference``: passages in input order, each batch tokenized and then encoded, in float32
  (no length sorting, no prefetching: what a plain encoding loop does);
* ``sorted``: ``Encoder.encode`` sorting by length across the whole run, no prefetching;
* ``sorted+prefetch``: the same with the tokenizer in a background thread (float32);
* on CUDA also ``sorted+prefetch+<precision>``: what ``index build --device cuda`` runs
  (``--precision auto``: bfloat16, or float16 on GPUs without it).

Each variant's passages/s and its ratio to ``reference`` are printed, with the share of padding
tokens the batches carry in input order, ordered by characters, and as ``encode`` batches them
(machine-independent: what length sorting saves). The corpus is the
SQuAD dev paragraphs shipped in ``data/`` (real Wikipedia text) split into 100-word passages as
a build splits them, repeated to ``--n``; ``--passages FILE`` takes any build input instead.
The window is the whole run (an index build sorts across each 50,000-passage embedding shard).

    .venv/bin/python bench/index/encode.py                      # default encoder, CPU or CUDA
    .venv/bin/python bench/index/encode.py --device cuda --n 50000 --batch-size 512
    .venv/bin/python bench/index/encode.py --encoder /models/dpr-ctx_encoder-multiset-base
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from itertools import cycle, islice
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_PASSAGES = ROOT / "data" / "squad" / "paragraphs.jsonl"


def load_passages(path: Path, n: int | None, max_words: int) -> tuple[list[str], list[str]]:
    from openbook.index.passages import read_passages

    passages = list(read_passages([path], "auto", max_words))
    if not passages:
        raise SystemExit(f"{path}: no passages")
    if n is not None:
        passages = list(islice(cycle(passages), n))
    return [p.text for p in passages], [p.title for p in passages]


def reference(enc: Any, texts: list[str], titles: list[str], batch_size: int) -> None:
    """Input order, tokenize then encode, float32: no sorting, no prefetching."""
    import torch

    with torch.inference_mode():
        for s in range(0, len(texts), batch_size):
            enc.encode_tensor(texts[s : s + batch_size], titles[s : s + batch_size]).cpu()


def padding_share(enc: Any, texts: list[str], titles: list[str], batch_size: int) -> dict:
    """Padding tokens / all tokens of the batches: in input order (``reference``), ordered by
    characters only, and as ``Encoder.encode`` batches (characters, then exact token counts
    per chunk)."""
    first, second = enc._inputs(texts, titles)
    trunc = "only_second" if second is not None else True
    ids = enc.tokenizer(first, second, truncation=trunc, max_length=enc.max_length)["input_ids"]
    lengths = [len(x) for x in ids]

    def share(order: list[int]) -> float:
        padded = real = 0
        for s in range(0, len(order), batch_size):
            batch = [lengths[i] for i in order[s : s + batch_size]]
            padded += max(batch) * len(batch)
            real += sum(batch)
        return 1 - real / padded

    by_chars = [i for chunk in enc._length_chunks(texts, titles, batch_size) for i in chunk]
    padded = real = 0
    for chunk in enc._length_chunks(texts, titles, batch_size):
        for _, tensors in enc._sorted_batches(texts, titles, chunk, batch_size):
            padded += tensors["attention_mask"].numel()
            real += int(tensors["attention_mask"].sum())
    return {
        "input order": share(list(range(len(texts)))),
        "characters": share(by_chars),
        "encode": 1 - real / padded,
    }


def timed(fn: Any, repeat: int) -> float:
    """Best of ``repeat`` runs, in seconds (the best is the least disturbed by the machine)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--encoder", default="all-MiniLM-L6-v2", help="alias or local encoder dir")
    ap.add_argument("--passages", type=Path, default=DEFAULT_PASSAGES, help="a build input file")
    ap.add_argument("--n", type=int, help="passages (repeating the file); default: the file's")
    ap.add_argument("--max-words", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--device", help="cpu or cuda[:N] (default: cuda if available)")
    ap.add_argument(
        "--precision",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="of the last variant on CUDA (auto: bfloat16, else float16)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="runs per variant; the best counts")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    ap.add_argument("--json", type=Path, help="also write results here")
    args = ap.parse_args(argv)

    import torch

    from openbook.index.encoders import load_encoder, resolve_precision

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    enc = load_encoder(args.encoder, role="document", cached=False)
    enc.model.to(device)
    texts, titles = load_passages(args.passages, args.n, args.max_words)
    bs = args.batch_size
    precision = resolve_precision(args.precision, device)

    variants: dict[str, Any] = {
        "reference": lambda: reference(enc, texts, titles, bs),
        "sorted": lambda: enc.encode(texts, bs, titles=titles, prefetch=False),
        "sorted+prefetch": lambda: enc.encode(texts, bs, titles=titles),
    }
    if device.type == "cuda" and precision != "float32":
        variants[f"sorted+prefetch+{precision}"] = lambda: enc.encode(
            texts, bs, titles=titles, precision=precision
        )
    # Warm up (CUDA context, kernels, allocator, tokenizer caches) outside the timings.
    enc.encode(texts[: bs * 2], bs, titles=titles[: bs * 2], precision=precision)
    reference(enc, texts[: bs * 2], titles[: bs * 2], bs)

    pad = padding_share(enc, texts, titles, bs)
    print(
        f"{enc.name} on {device} ({torch.get_num_threads()} CPU threads), {len(texts)} passages, "
        f"batch {bs}; padding tokens: "
        + ", ".join(f"{share:.0%} {how}" for how, share in pad.items())
    )
    results = []
    ref_rate = None
    for name, fn in variants.items():
        seconds = timed(fn, args.repeat)
        rate = len(texts) / seconds
        ref_rate = ref_rate or rate
        results.append({"variant": name, "seconds": seconds, "passages_per_s": rate})
        print(f"{name:>28}  {rate:10.1f} passages/s  x{rate / ref_rate:.2f}")
    best = results[-1]
    print(f"ratio {best['variant']} / reference: {best['passages_per_s'] / ref_rate:.2f}")

    if args.json:
        meta = {
            "encoder": enc.name,
            "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "passages": len(texts),
            "source": str(args.passages),
            "batch_size": bs,
            "repeat": args.repeat,
            "cpu_threads": torch.get_num_threads(),
            "padding_share": pad,
            "machine": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
        }
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
