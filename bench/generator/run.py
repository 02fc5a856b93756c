"""Time openbook.rag decoding against transformers' RAG ``generate`` on the same generator weights.

    .venv/bin/python bench/generator/run.py          # BART-base-sized random weights, k=5, 4 beams
    .venv/bin/python bench/generator/run.py --quick  # tiny model, a few seconds

For every mode and batch size it prints our time, transformers' time, the speed-up
(transformers / ours) and whether both produced the same token ids, then RAG-Sequence fast decoding
against our own thorough decoding. transformers has no RAG-Sequence "fast" decoding; that row is
timed against (and its ids compared with) transformers' thorough decoding, from which fast decoding
may legitimately differ.

Timings: per batch size, each repeat runs every implementation once, round-robin (so that load from
other processes hits all alike), after one warm-up round on the first batch size; the tables show
medians. "ms" is wall-clock time; "cpu x" is the speed-up in process CPU time, which other
processes on a shared machine disturb less. All ratios come from the same run.

Weights are random (no downloads): BART-base shapes with transformers' default initialisation,
except an untied LM head (std 0.1), without which a random BART repeats one token forever.
``min_new_tokens == max_new_tokens`` keeps both implementations decoding the same number of steps.
Each passage is ``--words`` random words (plus a 3-word title and a 12-word question).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import (
    BartConfig,
    BartForConditionalGeneration,
    DPRConfig,
    DPRQuestionEncoder,
    GenerationConfig,
    RagConfig,
    RagSequenceForGeneration,
    RagTokenForGeneration,
)

from openbook.rag import DecodingOptions, RagGenerator
from openbook.types import Passage

# The tiny-model helpers: the test kit (tests/openbook_testkit, development only).
from openbook_testkit.rag import strip_trailing
from openbook_trainer.experiments.synthetic import word_tokenizer

BASE = dict(d_model=768, layers=6, heads=12, ffn=3072, vocab=50265, head_std=0.1)
QUICK = dict(d_model=64, layers=2, heads=4, ffn=128, vocab=2000, head_std=0.5)
MODES = (
    ("rag-token", "token"),
    ("rag-sequence-thorough", "sequence"),
    ("rag-sequence-fast", "sequence"),
)


def build_model(directory: Path, size: dict) -> Path:
    words = [f"w{i}" for i in range(size["vocab"] - 5)]
    tokenizer = word_tokenizer(words)
    config = BartConfig(
        vocab_size=len(tokenizer),
        d_model=size["d_model"],
        encoder_layers=size["layers"],
        decoder_layers=size["layers"],
        encoder_attention_heads=size["heads"],
        decoder_attention_heads=size["heads"],
        encoder_ffn_dim=size["ffn"],
        decoder_ffn_dim=size["ffn"],
        max_position_embeddings=1024,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = BartForConditionalGeneration(config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        model.lm_head.weight.copy_(torch.randn(model.lm_head.weight.shape, generator=gen))
        model.lm_head.weight.mul_(size["head_std"])
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2
    )
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def make_requests(batch: int, k: int, words: int, vocab: int) -> list[tuple[str, list[Passage]]]:
    g = torch.Generator().manual_seed(batch)

    def text(n: int) -> str:
        return " ".join(f"w{int(i)}" for i in torch.randint(0, vocab - 5, (n,), generator=g))

    return [
        (
            text(12),
            [
                Passage(str(j), text(3), text(words), score=float(torch.randn(1, generator=g)))
                for j in range(k)
            ],
        )
        for _ in range(batch)
    ]


def reference_model(gen: RagGenerator, kind: str, k: int):
    c = gen.model.config
    q = DPRConfig(vocab_size=30, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    cfg = RagConfig.from_question_encoder_generator_configs(
        q,
        c,
        n_docs=k,
        bos_token_id=0,
        eos_token_id=2,
        pad_token_id=1,
        decoder_start_token_id=2,
        vocab_size=c.vocab_size,
    )
    cls = RagTokenForGeneration if kind == "token" else RagSequenceForGeneration
    model = cls(cfg, question_encoder=DPRQuestionEncoder(q), generator=gen.model).eval()
    model.to(device=gen.model.device, dtype=gen.model.dtype)
    generator = model.rag.generator
    generate = type(generator).generate

    def masked_generate(input_ids=None, attention_mask=None, **kw):
        # transformers 5 no longer infers the encoder mask from padding here (see tests/rag)
        if attention_mask is None and input_ids is not None:
            attention_mask = input_ids.ne(1).long()
        return generate(generator, input_ids, attention_mask=attention_mask, **kw)

    generator.generate = masked_generate
    return model


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _once(fn) -> tuple[float, float, object]:
    _sync()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    _sync()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def timed(fns: dict[str, object], repeats: int, warmup: bool) -> dict[str, tuple]:
    """Run every callable once per repeat, round-robin; per name: (median wall s, median CPU s,
    last output)."""
    if warmup:
        for fn in fns.values():
            fn()
    runs: dict[str, list] = {name: [] for name in fns}
    last: dict[str, object] = {}
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu, last[name] = _once(fn)
            runs[name].append((wall, cpu))
    return {
        name: (
            statistics.median(w for w, _ in xs),
            statistics.median(c for _, c in xs),
            last[name],
        )
        for name, xs in runs.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, short answers")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--beams", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: 20 (6 --quick)")
    ap.add_argument("--words", type=int, default=None, help="passage words (100; 20 --quick)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per side (median)")
    ap.add_argument(
        "--modes", nargs="+", default=[m for m, _ in MODES], choices=[m for m, _ in MODES]
    )
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = ap.parse_args()
    size = QUICK if args.quick else BASE
    batches = args.batches or ([1, 2] if args.quick else [1, 8])
    max_new = args.max_new_tokens or (6 if args.quick else 20)
    words = args.words or (20 if args.quick else 100)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        gen = RagGenerator.load(build_model(Path(tmp) / "bart", size), args.device, args.dtype)
    print("command: python " + " ".join(sys.argv))
    print(
        f"device={gen.device} dtype={gen.dtype} threads={torch.get_num_threads()} "
        f"cpu={platform.processor() or platform.machine()} torch={torch.__version__}"
    )
    print(
        f"d_model={size['d_model']} layers={size['layers']}+{size['layers']} "
        f"vocab={size['vocab']} k={args.k} beams={args.beams} new_tokens={max_new} "
        f"passage_words={words} repeats={args.repeats} (medians; ours/hf interleaved)"
    )
    print()
    refs = {kind: reference_model(gen, kind, args.k) for _, kind in MODES}
    table: list[str] = []
    fast_rows: list[str] = []
    for bi, batch in enumerate(batches):
        reqs = make_requests(batch, args.k, words, size["vocab"])
        rows = [(q, p) for q, ps in reqs for p in ps]
        ids, mask = gen.backend._tokenize_inputs(rows)
        scores = torch.tensor([[p.score for p in ps] for _, ps in reqs], device=ids.device)
        fns: dict[str, object] = {}
        for mode, kind in MODES:
            if mode not in args.modes:
                continue
            opts = DecodingOptions(
                mode=mode,
                num_beams=args.beams,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                num_return_sequences=1,
            )
            fns[f"ours {mode}"] = lambda reqs=reqs, opts=opts: gen.generate_batch(
                [(q, p, opts) for q, p in reqs]
            )
            # transformers has no fast RAG-Sequence decoding: fast is compared with its thorough
            if f"hf {kind}" in fns:
                continue
            length = {"max_length": max_new + 1} if kind == "token" else {"max_new_tokens": max_new}

            def hf(ref=refs[kind], length=length, ids=ids, mask=mask, scores=scores):
                with torch.inference_mode():
                    return ref.generate(
                        context_input_ids=ids,
                        context_attention_mask=mask,
                        doc_scores=scores.to(ref.dtype),
                        n_docs=args.k,
                        num_beams=args.beams,
                        num_return_sequences=1,
                        min_new_tokens=max_new,
                        **length,
                    )

            fns[f"hf {kind}"] = hf
        res = timed(fns, args.repeats, warmup=bi == 0)
        for mode, kind in MODES:
            if f"ours {mode}" not in res:
                continue
            ow, oc, ours = res[f"ours {mode}"]
            hw, hc, theirs = res[f"hf {kind}"]
            theirs = [strip_trailing(r.tolist()[1:], 1) for r in theirs]
            same = theirs == [r.hypotheses[0].token_ids for r in ours]
            if mode == "rag-sequence-fast":
                name = f"{mode} (vs hf thorough)"
                label = "same as hf thorough" if same else "differs from hf thorough (allowed)"
            else:
                name, label = mode, "yes" if same else "NO"
            table.append(
                f"| {name} | {batch} | {ow * 1e3:.0f} | {hw * 1e3:.0f} | {hw / ow:.2f}x "
                f"| {hc / oc:.2f}x | {label} |"
            )
        if "ours rag-sequence-fast" in res and "ours rag-sequence-thorough" in res:
            tw, tc, _ = res["ours rag-sequence-thorough"]
            fw, fc, _ = res["ours rag-sequence-fast"]
            fast_rows.append(
                f"| ours fast vs ours thorough | {batch} | {tw * 1e3:.0f} | {fw * 1e3:.0f} "
                f"| {tw / fw:.2f}x | {tc / fc:.2f}x |"
            )
        print(f"(batch {batch} done)", file=sys.stderr, flush=True)
    print("| mode | batch | ours ms | hf ms | speed-up | cpu x | same ids |")
    print("|---|---:|---:|---:|---:|---:|---|")
    print("\n".join(table))
    if fast_rows:
        print()
        print("| RAG-Sequence | batch | thorough ms | fast ms | speed-up | cpu x |")
        print("|---|---:|---:|---:|---:|---:|")
        print("\n".join(fast_rows))


if __name__ == "__main__":
    main()
