"""Training step time of ``openbook train``: one process against ``torchrun`` on this machine.

RAG-Token, joint training (query encoder and generator both learn), AdamW, one micro-batch per
optimizer step (``grad_accum`` 1), no dev set (no evaluation). Every run is the real command in
fresh processes, with the same global batch whatever the number of processes:

    1 process:   python -m openbook_trainer train --config C.yaml --out O
    N processes: python -m torch.distributed.run --standalone --nproc_per_node N \\
                     -m openbook_trainer train --config C.yaml --out O

Shapes (``--shapes``), models random and built locally (nothing is downloaded), cached under
``--work`` (default var/bench/train) so reruns only train:

* ``tiny``: the synthetic task (openbook_trainer.experiments.synthetic.make_task): 32-wide
  DPR encoders, a 1+1-layer 32-wide BART, 24 passages. Seconds; the smoke test.
* ``bart-large``: a BartForConditionalGeneration of BART-large's shapes (d_model 1024, 12+12
  layers, 16 heads, FFN 4096, vocab 50265; ~406M parameters) over a word-level tokenizer of
  50265 tokens, and DPR-base-shaped encoders (BERT-base: 768 wide, 12 layers, vocab 30522;
  ~109M each). The index: ``--passages`` (300) random passages of 100 words and 2-word titles,
  encoded by the random context encoder (openbook.index.build_index). Questions 10 words,
  answers 3 words, so the generator reads ~115 tokens per (question, passage) row and is
  teacher-forced on ~5.

Step time is read from the run itself: the trainer appends one row to
``OUT/train_log.jsonl`` after every optimizer step, with the wall-clock time it wrote it
(``time``; the log is polled every 10 ms, but rows of steps shorter than a poll arrive
together, so the time they were seen is not their step's). ``s/step`` is the median of the
intervals between rows (steps 2..S; the JSON also has the mean, (t[S] - t[1]) / (S - 1)): it
leaves out start-up, the first step (lazy allocations: Adam moments, DDP buckets) and the
checkpoint written at the end, from a single run per variant. ``to step 1`` is launch to the
first row (imports, model and index loading, rendezvous, the first step).

The machine may be shared: ``other CPU %`` is the CPU time processes outside the run took
while steps 2..S ran, as a share of all CPUs (hypervisor steal included). Step times with it
well above 0 are slowed by a neighbour; ``--wait-idle S`` waits for a quiet machine before
each run.

Ratios are against runs of the same invocation: ``vs 1 proc`` is the 1-process s/step of the
same precision and batch over this one's (above 1: faster), ``vs fp32`` the fp32 s/step of the
same process count and batch over this one's. Threads: each process gets usable CPUs / N
(``OMP_NUM_THREADS``), so every variant uses the whole machine and no more.

Peak memory: the resident set of the whole process tree (torchrun's launcher included),
sampled every 0.25 s. A run is stopped when the machine's available memory falls under
``--min-free-gib``, so an oversized variant is reported as such instead of invoking the
kernel's OOM killer on whatever else runs here.

    .venv/bin/python bench/train/step.py --shapes tiny                       # ~1 min
    .venv/bin/python bench/train/step.py --shapes bart-large --json docs/results/train_step.json
    .venv/bin/python bench/train/step.py --shapes bart-large --batch-size 8,4 --precision auto
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[2]

BUILD_VERSION = 1  # bump when a builder changes what it writes: cached work dirs are rebuilt
GIB = 2**30


# ---------------------------------------------------------------------------------------------
# the models, data and index of each shape


@dataclass(frozen=True)
class Task:
    train: Path
    index: Path
    generator: Path
    info: dict[str, Any]  # what was built: sizes, parameter counts


@dataclass(frozen=True)
class Shapes:
    name: str
    steps: int  # default --steps
    build: Callable[[Path, argparse.Namespace], dict[str, Any]]  # writes into a fresh dir


def _build_tiny(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from openbook_trainer.experiments.synthetic import make_task

    task = make_task(root, n_entities=24)
    return {
        "train": str(task.train.relative_to(root)),
        "index": str(task.index.relative_to(root)),
        "generator": str(task.generator.relative_to(root)),
        "passages": task.n_entities,
        "generator_params": _params(task.generator, "bart"),
        "query_encoder_params": _params(task.query_encoder, "dpr-question"),
    }


# BART-large (facebook/bart-large config.json) and DPR-base (BERT-base) dimensions
BART_LARGE_VOCAB = 50265
BERT_BASE_VOCAB = 30522
QUESTION_WORDS, PASSAGE_WORDS, TITLE_WORDS, ANSWER_WORDS = 10, 100, 2, 3


def _build_bart_large(root: Path, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        BertTokenizer,
        DPRConfig,
        DPRContextEncoder,
        DPRQuestionEncoder,
        GenerationConfig,
    )

    from openbook.index import BuildOptions, IndexSpec, build_index
    from openbook_trainer.experiments.synthetic import (
        _SPECIAL_BERT,
        BART_SPECIALS,
        word_tokenizer,
        write_jsonl,
    )

    # One token per word in both tokenizers: text draws from the words both vocabularies hold,
    # so sequence lengths in tokens are the word counts above (plus separators and specials).
    bert_words = [f"w{i}" for i in range(BERT_BASE_VOCAB - len(_SPECIAL_BERT))]
    bart_words = ["/", "//"] + [f"w{i}" for i in range(BART_LARGE_VOCAB - len(BART_SPECIALS) - 2)]
    text_words = bert_words[: len(bert_words) - 1000]
    rng = random.Random(args.seed)

    def sentence(n: int) -> str:
        return " ".join(rng.choices(text_words, k=n))

    passages = write_jsonl(
        root / "passages.jsonl",
        (
            {"id": f"p{i}", "title": sentence(TITLE_WORDS), "text": sentence(PASSAGE_WORDS)}
            for i in range(args.passages)
        ),
    )
    # enough questions that no run repeats an epoch's order in a way that matters for timing
    write_jsonl(
        root / "train.jsonl",
        (
            {
                "id": f"q{i}",
                "question": sentence(QUESTION_WORDS),
                "answers": [sentence(ANSWER_WORDS)],
            }
            for i in range(256)
        ),
    )

    dpr = DPRConfig()  # BERT-base: 768 wide, 12 layers, 12 heads, FFN 3072, 512 positions
    assert dpr.vocab_size == BERT_BASE_VOCAB
    encoders = {}
    for offset, (cls, sub) in enumerate(
        ((DPRContextEncoder, "ctx_encoder"), (DPRQuestionEncoder, "question_encoder"))
    ):
        d = root / "dpr" / sub
        d.mkdir(parents=True)
        (d / "vocab.txt").write_text("\n".join(_SPECIAL_BERT + bert_words) + "\n", "utf-8")
        tok = BertTokenizer(str(d / "vocab.txt"), do_lower_case=True, model_max_length=512)
        assert len(tok) == BERT_BASE_VOCAB
        torch.manual_seed(args.seed * 100 + offset)
        model = cls(dpr).eval()
        model.save_pretrained(d)
        tok.save_pretrained(d)
        encoders[sub] = (d, sum(p.numel() for p in model.parameters()))
        del model

    print("building the BART-large-shaped generator ...", flush=True)
    tokenizer = word_tokenizer(bart_words)
    assert len(tokenizer) == BART_LARGE_VOCAB
    bart = BartConfig(  # the defaults are BART-large's; BART's special-token ids
        vocab_size=len(tokenizer),
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    bart.forced_eos_token_id = None  # as synthetic.small_bart_config: config and generation agree
    torch.manual_seed(args.seed)
    model = BartForConditionalGeneration(bart)
    model.generation_config = GenerationConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, decoder_start_token_id=2
    )
    generator = root / "bart-large"
    model.save_pretrained(generator)
    tokenizer.save_pretrained(generator)
    generator_params = sum(p.numel() for p in model.parameters())
    del model

    print(f"encoding {args.passages} passages for the index ...", flush=True)
    build_index(
        [passages],
        root / "index",
        IndexSpec(
            name="bench-train-bart-large",
            encoder=str(encoders["ctx_encoder"][0]),
            query_encoder=str(encoders["question_encoder"][0]),
            # Dense only: the step times stay those of the paper's (dense) retrieval,
            # comparable with the runs recorded before indexes carried a bm25 view (which
            # makes training retrieve hybrid by default).
            bm25=False,
        ),
        BuildOptions(batch_size=16, progress=True),
    )
    return {
        "train": "train.jsonl",
        "index": "index",
        "generator": "bart-large",
        "passages": args.passages,
        "words": {
            "question": QUESTION_WORDS,
            "passage": PASSAGE_WORDS,
            "title": TITLE_WORDS,
            "answer": ANSWER_WORDS,
        },
        "generator_config": {
            "d_model": bart.d_model,
            "layers": [bart.encoder_layers, bart.decoder_layers],
            "heads": bart.encoder_attention_heads,
            "ffn": bart.encoder_ffn_dim,
            "vocab": bart.vocab_size,
            "dropout": bart.dropout,
        },
        "query_encoder_config": {
            "hidden": dpr.hidden_size,
            "layers": dpr.num_hidden_layers,
            "vocab": dpr.vocab_size,
        },
        "generator_params": generator_params,
        "query_encoder_params": encoders["question_encoder"][1],
    }


def _params(path: Path, kind: str) -> int:
    if kind == "bart":
        from transformers import BartForConditionalGeneration as cls
    else:
        from transformers import DPRQuestionEncoder as cls
    return sum(p.numel() for p in cls.from_pretrained(path).parameters())


SHAPES = {
    "tiny": Shapes("tiny", steps=30, build=_build_tiny),
    "bart-large": Shapes("bart-large", steps=4, build=_build_bart_large),
}


def prepare(shapes: Shapes, args: argparse.Namespace) -> Task:
    """The task under ``--work/<shapes>``: reused when built with the same settings, else
    rebuilt from scratch (``spec.json`` is written last, so a half-built dir is rebuilt)."""
    root = args.work / shapes.name
    spec = {"version": BUILD_VERSION, "shapes": shapes.name, "seed": args.seed}
    if shapes.name != "tiny":
        spec["passages"] = args.passages
    spec_file = root / "spec.json"
    if spec_file.is_file():
        saved = json.loads(spec_file.read_text())
        if saved.get("spec") == spec:
            print(f"reusing {root}", flush=True)
            return _task(root, saved["info"])
    print(f"building the {shapes.name} models and index in {root} ...", flush=True)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    started = time.perf_counter()
    info = shapes.build(root, args)
    info["build_s"] = round(time.perf_counter() - started, 1)
    spec_file.write_text(json.dumps({"spec": spec, "info": info}, indent=2))
    return _task(root, info)


def _task(root: Path, info: dict[str, Any]) -> Task:
    return Task(root / info["train"], root / info["index"], root / info["generator"], info)


# ---------------------------------------------------------------------------------------------
# one training run


@dataclass
class Run:
    precision: str
    nproc: int
    batch_size: int
    threads_per_process: int
    steps: int
    shard_optimizer: bool = False  # ZeRO-1: each rank holds 1/N of the Adam state
    status: str = "ok"  # ok | failed (rc N) | stopped: ...
    steps_logged: int = 0
    step_s: float | None = None  # median seconds per optimizer step over steps 2..S
    step_s_mean: float | None = None  # (t[S] - t[1]) / (S - 1)
    step_s_min: float | None = None
    step_s_max: float | None = None
    to_first_step_s: float | None = None  # launch -> first step logged
    after_last_step_s: float | None = None  # last step -> exit (checkpoint write)
    wall_s: float = 0.0
    peak_rss_gib: float = 0.0  # the whole process tree
    peak_rss_gib_largest_process: float = 0.0
    min_available_gib: float = 0.0  # the machine's lowest available memory during the run
    # CPU time other processes took while steps 2..S ran, in % of the machine: this machine
    # is shared, and a busy neighbour slows a step as much as anything measured here
    other_cpu_pct: float | None = None
    waited_idle_s: float = 0.0  # --wait-idle: how long the run waited for a quiet machine
    first_loss: float | None = None
    last_loss: float | None = None
    speedup_vs_1proc: float | None = None
    speedup_vs_fp32: float | None = None
    step_times_s: list[float] = field(default_factory=list)
    log: str = ""


def write_config(task: Task, path: Path, args: argparse.Namespace, run: Run) -> None:
    config = {
        "train": str(task.train),
        "index": str(task.index),
        "generator": str(task.generator),
        "mode": "rag-token",
        "k": args.k,
        "train_query_encoder": True,
        "train_generator": True,
        "batch_size": run.batch_size,
        "grad_accum": 1,
        "steps": run.steps,
        "warmup_steps": 0,
        "precision": run.precision,
        "device": "cpu",
        "seed": args.seed,
        "keep_last": 1,
        "shard_optimizer": run.shard_optimizer,
        # a rank killed by the memory guard must not keep the others waiting for 30 minutes
        "dist_timeout": 600,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def command(config: Path, out: Path, nproc: int) -> list[str]:
    train = ["-m", "openbook_trainer", "train", "--config", str(config), "--out", str(out)]
    train += ["--no-progress", "--no-resume"]
    if nproc == 1:
        return [sys.executable, *train]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return [sys.executable, *launcher, *train]


def run_once(task: Task, run: Run, run_dir: Path, args: argparse.Namespace, desc: str) -> Run:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    config, out = run_dir / "config.yaml", run_dir / "out"
    write_config(task, config, args, run)
    threads = str(run.threads_per_process)
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=threads,
        MKL_NUM_THREADS=threads,
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    log_path = run_dir / "run.log"
    train_log = out / "train_log.jsonl"
    rows: list[tuple[float, dict[str, Any]]] = []  # (seconds since launch, step row)
    cpu_marks: list[tuple[float, float]] = []  # per step row: machine busy s, this run's CPU s
    peak_tree = peak_one = 0.0
    min_available = psutil.virtual_memory().available
    stopped = ""
    run.waited_idle_s = wait_idle(args.wait_idle)
    with (
        open(log_path, "w") as log_file,
        tqdm(total=run.steps, desc=desc, unit="step", mininterval=1.0) as bar,
    ):
        started = time.perf_counter()
        launched = time.time()  # the rows' own "time" is wall-clock
        # own session: the whole tree (torchrun and its workers) can be stopped as one group
        proc = subprocess.Popen(
            command(config, out, run.nproc),
            cwd=ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        root = psutil.Process(proc.pid)
        offset, pending, next_sample = 0, b"", 0.0
        while True:
            done = proc.poll() is not None
            now = time.perf_counter() - started
            if train_log.is_file():
                with open(train_log, "rb") as f:
                    f.seek(offset)
                    chunk = f.read()
                offset += len(chunk)
                pending += chunk
                *lines, pending = pending.split(b"\n")  # a row being written stays pending
                for line in lines:
                    row = json.loads(line)
                    if "loss" in row:  # step rows; metrics rows have no loss
                        # when the trainer wrote it (rows written between two polls would
                        # otherwise share one time); a log without times: when it was seen
                        written = row["time"] - launched if "time" in row else now
                        rows.append((written, row))
                        cpu_marks.append((_machine_busy_s(), _tree(root)[1]))
                        bar.update(1)
            if done:
                break
            if now >= next_sample:
                next_sample = now + 0.25
                tree, _ = _tree(root)
                peak_tree = max(peak_tree, sum(tree))
                peak_one = max(peak_one, max(tree, default=0))
                available = psutil.virtual_memory().available
                min_available = min(min_available, available)
                bar.set_postfix(
                    rss=f"{sum(tree) / GIB:.1f}G", free=f"{available / GIB:.1f}G", refresh=False
                )
                if available < args.min_free_gib * GIB:
                    stopped = f"stopped: under {args.min_free_gib:g} GiB available"
                elif args.run_timeout and now > args.run_timeout:
                    stopped = f"stopped: over --run-timeout {args.run_timeout:g} s"
                if stopped:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    continue
            time.sleep(0.01)
        run.wall_s = time.perf_counter() - started
    run.peak_rss_gib = peak_tree / GIB
    run.peak_rss_gib_largest_process = peak_one / GIB
    run.min_available_gib = min_available / GIB
    run.steps_logged = len(rows)
    if rows:
        times = [t for t, _ in rows]
        run.to_first_step_s = times[0]
        run.first_loss, run.last_loss = rows[0][1]["loss"], rows[-1][1]["loss"]
        run.step_times_s = [b - a for a, b in zip(times, times[1:], strict=False)]
        if run.step_times_s:
            run.step_s = statistics.median(run.step_times_s)
            run.step_s_mean = (times[-1] - times[0]) / (len(times) - 1)
            run.step_s_min, run.step_s_max = min(run.step_times_s), max(run.step_times_s)
            busy = cpu_marks[-1][0] - cpu_marks[0][0]
            ours = cpu_marks[-1][1] - cpu_marks[0][1]
            capacity = (times[-1] - times[0]) * len(os.sched_getaffinity(0))
            run.other_cpu_pct = 100 * max(0.0, busy - ours) / capacity
        if not stopped:
            run.after_last_step_s = run.wall_s - times[-1]
    run.log = str(log_path)
    if stopped and run.steps_logged == run.steps:
        # every step was timed; what ran out was the end-of-run checkpoint (ZeRO-1 gathers the
        # whole optimizer state on rank 0 for it)
        run.status = f"steps ok; {stopped} in the final checkpoint save"
    elif stopped:
        run.status = stopped
    elif proc.returncode != 0:
        run.status = f"failed (rc {proc.returncode})"
    if train_log.is_file():  # keep the log, drop the checkpoint (GBs for bart-large)
        shutil.copy(train_log, run_dir / "train_log.jsonl")
    shutil.rmtree(out, ignore_errors=True)
    return run


def _tree(root: psutil.Process) -> tuple[list[int], float]:
    """Resident bytes of each process of the run's tree, and their CPU seconds in all."""
    rss, cpu = [], 0.0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return rss, cpu
    for p in procs:
        with contextlib.suppress(psutil.Error), p.oneshot():  # exited since the listing
            rss.append(p.memory_info().rss)
            t = p.cpu_times()
            cpu += t.user + t.system
    return rss, cpu


def _machine_busy_s() -> float:
    """CPU seconds the machine spent on anything (hypervisor steal included) since boot."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def wait_idle(limit_s: float, threshold_pct: float = 15.0) -> float:
    """Wait up to ``limit_s`` until the machine is quiet (under ``threshold_pct`` busy over 2 s,
    other processes' load before a run being the likeliest disturbance); seconds waited."""
    started = time.perf_counter()
    while time.perf_counter() - started < limit_s:
        if psutil.cpu_percent(interval=2.0) < threshold_pct:
            break
    return time.perf_counter() - started


# ---------------------------------------------------------------------------------------------
# report


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    flags: set[str] = set()
    model = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    of_note = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile"]
    from openbook.rag.loading import cpu_has_native_bf16

    return {
        "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "processor": model,
        "cpu_flags_of_note": {f: f in flags for f in of_note},
        "native_bf16": cpu_has_native_bf16(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "commit": _git("rev-parse", "--short", "HEAD"),
    }


def _git(*argv: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *argv], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def fill_ratios(runs: list[Run]) -> None:
    def find(precision: str, nproc: int, batch: int, shard: bool) -> Run | None:
        for r in runs:
            key = (r.precision, r.nproc, r.batch_size, r.shard_optimizer)
            if key == (precision, nproc, batch, shard) and r.step_s:
                return r
        return None

    for r in runs:
        if not r.step_s:  # unmeasured (or steps logged within one clock tick)
            continue
        one = find(r.precision, 1, r.batch_size, False)
        fp32 = find("fp32", r.nproc, r.batch_size, r.shard_optimizer)
        r.speedup_vs_1proc = one.step_s / r.step_s if one and one.step_s else None
        r.speedup_vs_fp32 = fp32.step_s / r.step_s if fp32 and fp32.step_s else None


def _f(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "-" if x is None else f"{x:.{digits}f}{suffix}"


def table(runs: list[Run]) -> str:
    head = (
        "| precision | processes x threads | batch (per rank) | s/step (min-max) | examples/s "
        "| vs 1 proc | vs fp32 | to step 1 s | peak RSS GiB (largest proc) | other CPU % "
        "| status |\n"
        "|---|---|---:|---|---:|---:|---:|---:|---|---:|---|\n"
    )
    rows = []
    for r in runs:
        per_rank = -(-r.batch_size // r.nproc)
        spread = f" ({_f(r.step_s_min)}-{_f(r.step_s_max)})" if r.step_s else ""
        rows.append(
            f"| {r.precision} | {r.nproc} x {r.threads_per_process}"
            f"{' ZeRO-1' if r.shard_optimizer else ''} | {r.batch_size} "
            f"({per_rank}) | {_f(r.step_s, 3 if (r.step_s or 0) < 1 else 2)}{spread} "
            f"| {_f(r.batch_size / r.step_s if r.step_s else None)} "
            f"| {_f(r.speedup_vs_1proc, 2, 'x')} | {_f(r.speedup_vs_fp32, 2, 'x')} "
            f"| {_f(r.to_first_step_s, 1)} | {r.peak_rss_gib:.1f} "
            f"({r.peak_rss_gib_largest_process:.1f}) | {_f(r.other_cpu_pct, 0)} | {r.status} |"
        )
    return head + "\n".join(rows)


# ---------------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def _precisions(text: str) -> list[str]:
    out = [x for x in text.split(",") if x]
    bad = [x for x in out if x not in ("fp32", "auto", "bf16")]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown precision(s) {bad}; fp32, auto or bf16")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", choices=sorted(SHAPES), default="tiny")
    ap.add_argument(
        "--steps", type=int, default=None, help="optimizer steps per run, >= 2 (tiny 30, else 4)"
    )
    ap.add_argument("--batch-size", type=_ints, default=[8], help="comma list (default 8)")
    ap.add_argument("--k", type=int, default=5, help="passages per question (default 5)")
    ap.add_argument("--nproc", type=_ints, default=[1, 2], help="comma list (default 1,2)")
    ap.add_argument(
        "--precision",
        type=_precisions,
        default=["fp32", "auto"],
        help="comma list of fp32, auto, bf16 (default fp32,auto; auto is bf16 autocast on a\n"
        "CPU with native bf16, else fp32)",
    )
    ap.add_argument(
        "--shard-optimizer",
        choices=["no", "yes", "both"],
        default="no",
        help="runs of several processes with ZeRO-1 (--shard-optimizer: each rank holds 1/N\n"
        "of the Adam state), without (no, default) or both",
    )
    ap.add_argument("--passages", type=int, default=300, help="index size for bart-large (300)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--work", type=Path, default=ROOT / "var/bench/train", help="models, index, run logs"
    )
    ap.add_argument(
        "--min-free-gib",
        type=float,
        default=1.5,
        help="stop a run when the machine's available memory falls under this (1.5)",
    )
    ap.add_argument("--run-timeout", type=float, default=0, help="seconds per run; 0: none")
    ap.add_argument(
        "--wait-idle",
        type=float,
        default=0,
        help="before each run, wait up to this many seconds for the machine to be under 15%%\n"
        "busy (a shared machine: other jobs' load lands in the step times); 0: do not wait",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    shapes = SHAPES[args.shapes]
    steps = args.steps or shapes.steps
    if steps < 2:
        ap.error("--steps must be >= 2 (the first step is not timed)")
    cpus = len(os.sched_getaffinity(0))
    args.work = args.work.resolve()

    task = prepare(shapes, args)
    # (processes, ZeRO-1) pairs; one process has no optimizer state to shard
    shard = {"no": [False], "yes": [True], "both": [False, True]}[args.shard_optimizer]
    variants = [(n, z) for n in args.nproc for z in ([False] if n == 1 else shard)]
    runs: list[Run] = []
    for batch in args.batch_size:
        for precision in args.precision:
            for nproc, shard in variants:
                run = Run(precision, nproc, batch, max(1, cpus // nproc), steps, shard)
                name = f"b{batch}-{precision}-x{nproc}{'-zero' if shard else ''}"
                desc = f"{shapes.name} batch {batch} {precision} x{nproc}"
                desc += " ZeRO-1" if shard else ""
                run_dir = args.work / shapes.name / "runs" / name
                runs.append(run_once(task, run, run_dir, args, desc))
                if run.status != "ok":
                    print(f"{desc}: {run.status}; log: {run.log}", flush=True)
                    print(Path(run.log).read_text()[-3000:], flush=True)
    fill_ratios(runs)

    machine = machine_info()
    print()
    print(
        f"{shapes.name}: rag-token, query encoder + generator trained, k={args.k}, "
        f"{steps} steps per run (s/step: median over steps 2..{steps}); {machine['processor']}, "
        f"{cpus} CPUs, {machine['memory_gib']} GiB, torch {machine['torch']}"
    )
    print(table(runs))
    if args.json:
        result = {
            "benchmark": "bench/train/step.py",
            "command": shlex.join([".venv/bin/python", "bench/train/step.py", *sys.argv[1:]])
            if argv is None
            else shlex.join([".venv/bin/python", "bench/train/step.py", *argv]),
            "machine": machine,
            "shapes": shapes.name,
            "task": task.info,
            "settings": {
                "mode": "rag-token",
                "trained": ["query_encoder", "generator"],
                "k": args.k,
                "steps": steps,
                "grad_accum": 1,
                "shard_optimizer": args.shard_optimizer,
                "timing": "train_log.jsonl rows timed by their own wall-clock 'time'; "
                "step_s: the median of the intervals between rows 1..S (steps 2..S), "
                "step_s_mean: (t[S] - t[1]) / (S - 1)",
                "threads": "usable CPUs / processes per process (OMP_NUM_THREADS)",
            },
            "runs": [asdict(r) for r in runs],
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if all(r.status.startswith(("ok", "steps ok")) for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
