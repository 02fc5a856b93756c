"""Does the retriever learn from the answer alone? (Lewis et al. 2020, §2.4 / Table 6 ablation.)

Task (see :mod:`.synthetic`): entity e<i>'s code word c<i> appears in passage p<i> only. The
training data are (question, answer) pairs; no passage labels. The document encoder and index
are frozen and both DPR encoders start random, so the frozen retriever is at chance level.

The generator plays the part of pre-trained BART: before the experiment it learns to *read* —
to answer "what is the code of eX ?" from a passage "the code of eX is cY ." where X and Y are
paired at random, so it cannot have memorised the task's true entity→code pairs (trained
until it copies correctly 95% of the time). Then:

* ``frozen_retriever``  the retriever as initialised, generator trained (the paper's ablation);
* ``joint``             query encoder and generator trained with the RAG marginal NLL;
* ``qenc_only``         query encoder trained, generator frozen.

We report, over all questions, recall@1, recall@k and the gold passage's mean p(z|x) among the
top k retrieved (0 when it is not retrieved; ``1/k`` would be a uniform prior).

    python -m openbook_trainer.experiments.retriever_learns --out docs/retriever_learns.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from openbook.index import load_encoder, open_index
from openbook.index.request import SearchRequest
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.rag.checkpoint import save_generator_dir
from openbook.types import Passage
from openbook_trainer.config import TrainConfig
from openbook_trainer.experiments.synthetic import SyntheticTask, make_task, read_jsonl
from openbook_trainer.loop import train

# frozen_retriever: the paper's ablation, generator trained on the frozen retriever's passages.
VARIANTS = ("frozen_retriever", "joint", "qenc_only")


def pretrain_reader(
    task: SyntheticTask,
    out: Path,
    *,
    max_steps: int,
    lr: float,
    batch_size: int = 16,
    seed: int = 0,
    target_accuracy: float = 0.95,
    check_every: int = 100,
) -> dict[str, float]:
    """Teach the generator to copy a code word out of one passage (random entity/code pairs).

    Tiny transformers learn copying abruptly after a seed-dependent plateau, so this trains
    until the copying accuracy on fresh random pairs reaches ``target_accuracy`` (checked every
    ``check_every`` steps) or ``max_steps``. Writes the generator to ``out`` (HF format).
    """
    torch.manual_seed(seed)
    gen = RagGenerator.load(task.generator, device="cpu", dtype="float32")
    opt = torch.optim.AdamW(gen.model.parameters(), lr=lr)
    rng = random.Random(seed)
    n = task.n_entities
    opts = DecodingOptions(mode="rag-token", max_new_tokens=4)

    def pair() -> tuple[str, Passage, str]:
        x, y = rng.randrange(n), rng.randrange(n)
        text = f"the code of e{x} is c{y} ."
        return f"what is the code of e{x} ?", Passage(f"r{x}", f"e{x}", text), f"c{y}"

    def accuracy() -> float:
        gen.model.eval()
        probe = [pair() for _ in range(2 * n)]
        results = gen.generate_batch([(q, [p], opts) for q, p, _ in probe])
        hits = []
        for r, (_, _, a) in zip(results, probe, strict=True):
            assert isinstance(r, GenerationResult)  # gave_up is None: none is abandoned
            hits.append(r.hypotheses[0].text.strip() == a)
        return float(np.mean(hits))

    loss = torch.tensor(0.0)
    acc, step = 0.0, 0
    while step < max_steps:
        gen.model.train()
        for _ in range(min(check_every, max_steps - step)):
            batch = [pair() for _ in range(batch_size)]
            loss = (
                gen.loss(
                    [q for q, _, _ in batch],
                    [[p] for _, p, _ in batch],
                    torch.zeros(batch_size, 1),
                    [a for _, _, a in batch],
                    "rag-token",
                )
                / batch_size
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
        acc = accuracy()
        if acc >= target_accuracy:
            break
    save_generator_dir((gen.model, gen.tokenizer), out, None)  # weights and tokenizer only
    return {"steps": step, "final_loss": float(loss.detach()), "copy_accuracy": acc}


def retrieval_stats(task: SyntheticTask, encoder_dir: Path | str, k: int) -> dict[str, float]:
    """recall@1, recall@k and mean gold p(z|x) within the top k, over every question."""
    rows = read_jsonl(task.train)
    questions = [r["question"] for r in rows]
    gold = [r["gold_ids"][0] for r in rows]
    enc = load_encoder(str(encoder_dir), role="query", cached=False)
    with open_index(task.index) as index:
        hits = index.search(SearchRequest(questions, k=k), encoder=enc)
    r1 = rk = p_gold = 0.0
    for g, h in zip(gold, hits, strict=True):
        ids = [p.id for p in h]
        scores = np.array([p.score for p in h], dtype=np.float64)
        prior = np.exp(scores - scores.max())
        prior /= prior.sum()
        r1 += ids[0] == g
        if g in ids:
            rk += 1
            p_gold += prior[ids.index(g)]
    n = len(rows)
    return {"recall@1": 100 * r1 / n, f"recall@{k}": 100 * rk / n, "gold_p": p_gold / n}


def run(
    workdir: Path,
    *,
    n_entities: int = 24,
    k: int = 8,
    steps: int = 600,
    batch_size: int = 8,
    lr_query_encoder: float = 1e-3,
    lr_generator: float = 1e-4,
    pretrain_steps: int = 3000,
    pretrain_lr: float = 2e-3,
    seed: int = 0,
    variants: tuple[str, ...] = VARIANTS,
) -> dict[str, Any]:
    """One seed: build the task, pre-train the reader, train each variant, measure."""
    t0 = time.monotonic()
    task = make_task(
        workdir / "task", n_entities=n_entities, bart_d_model=64, bart_layers=2, seed=seed
    )
    reader = workdir / "reader"
    if reader.exists():
        shutil.rmtree(reader)
    pre = pretrain_reader(task, reader, max_steps=pretrain_steps, lr=pretrain_lr, seed=seed)
    results: dict[str, Any] = {
        "setup": {
            "n_entities": n_entities,
            "k": k,
            "steps": steps,
            "batch_size": batch_size,
            "lr_query_encoder": lr_query_encoder,
            "lr_generator": lr_generator,
            "pretrain_steps": pretrain_steps,
            "seed": seed,
            "mode": "rag-token",
        },
        "reader_pretraining": pre,
        "frozen": retrieval_stats(task, task.query_encoder, k),
    }
    for variant in variants:
        train_q = variant != "frozen_retriever"
        cfg = TrainConfig(
            train=task.train,
            dev=task.dev,
            index=task.index,
            generator=reader,
            out=workdir / f"ckpt-{variant}",
            k=k,
            steps=steps,
            batch_size=batch_size,
            lr_query_encoder=lr_query_encoder,
            lr_generator=lr_generator,
            train_query_encoder=train_q,
            train_generator=variant != "qenc_only",
            mode="rag-token",
            seed=seed,
            eval_every=0,
            save_every=0,
            progress=False,
            resume=False,
        )
        res = train(cfg)
        assert res.checkpoint is not None
        enc = res.checkpoint / "query_encoder" if train_q else task.query_encoder
        stats = retrieval_stats(task, enc, k)
        stats["dev_em"] = res.metrics.get("dev_em", float("nan"))
        stats["train_loss"] = res.metrics.get("train_loss", float("nan"))
        results[variant] = stats
    results["seconds"] = round(time.monotonic() - t0, 1)
    return results


def mean_over_seeds(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for key in ("frozen", *VARIANTS):
        rows = [r[key] for r in runs if key in r]
        if rows:
            out[key] = {m: float(np.mean([r[m] for r in rows])) for m in rows[0]}
    return out


def to_markdown(results: dict[str, Any], k: int) -> str:
    """Table of :func:`mean_over_seeds` output (or one seed's results)."""
    head = f"| retriever | recall@1 | recall@{k} | gold p(z\\|x) in top {k} | dev EM |"
    lines = [head, "|---|---:|---:|---:|---:|"]
    names = {
        "frozen_retriever": "frozen (generator trained)",
        "joint": "trained jointly with the generator",
        "qenc_only": "trained, generator frozen",
    }
    rows = dict(results)
    if "frozen_retriever" not in rows and "frozen" in rows:
        rows["frozen_retriever"] = rows["frozen"]
    for key, label in names.items():
        if key not in rows:
            continue
        r = rows[key]
        em = f"{r['dev_em']:.1f}" if "dev_em" in r else "–"
        lines.append(
            f"| {label} | {r['recall@1']:.1f} | {r[f'recall@{k}']:.1f} | {r['gold_p']:.3f} | {em} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="results JSON (a .md table beside it)")
    ap.add_argument("--workdir", type=Path, default=None, help="keep models/checkpoints here")
    ap.add_argument("--entities", type=int, default=24)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--pretrain-steps", type=int, default=3000, help="at most")
    ap.add_argument("--lr-query-encoder", type=float, default=1e-3)
    ap.add_argument("--lr-generator", type=float, default=1e-4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    with tempfile.TemporaryDirectory(prefix="retriever-learns-") as tmp:
        for seed in args.seeds:
            workdir = (args.workdir or Path(tmp)) / f"seed-{seed}"
            runs.append(
                run(
                    workdir,
                    n_entities=args.entities,
                    k=args.k,
                    steps=args.steps,
                    pretrain_steps=args.pretrain_steps,
                    seed=seed,
                    lr_query_encoder=args.lr_query_encoder,
                    lr_generator=args.lr_generator,
                )
            )
            print(f"seed {seed}:\n{to_markdown(runs[-1], args.k)}", flush=True)
    mean = mean_over_seeds(runs)
    report = {"mean": mean, "runs": runs}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    table = to_markdown(mean, args.k)
    args.out.with_suffix(".md").write_text(table + "\n")
    print(f"mean over seeds {args.seeds}:\n{table}")
    print(f"({sum(r['seconds'] for r in runs):.0f} s; wrote {args.out})")


if __name__ == "__main__":
    main()
