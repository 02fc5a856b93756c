"""Fine-tuning that pays off: the default generator, LoRA-tuned on SQuAD questions, measured
open-domain on articles it never saw in training.

The demo's SQuAD questions are split **by article** (a seeded shuffle of the titles): questions
of the training articles train, those of the development articles measure, so nothing of a
development article (its passages' questions, its answers) is seen in training. Open-domain:
the question only, the top-k retrieved from the demo's dense index over every passage, with
its default retrieval (hybrid: the dense and BM25 views fused by the prior fitted on the
training articles' questions only, ``demo/indexes.py``); recall is reported for dense and
hybrid retrieval apart.

Three systems on the same development questions:

1. the few-shot default (the shipped prompt, the index's own query encoder);
2. a LoRA adapter of the generator trained with the retriever frozen;
3. joint training: the generator's adapter and the query encoder together (the paper's
   recipe; by default a LoRA adapter of the query encoder too, so the whole tuned system is a
   few MB), which also reports recall@k of the tuned query encoder against the frozen one and
   BM25.

Training resumes from its checkpoints and every prediction is logged as it is made, so an
interrupted run picks up where it stopped.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from tqdm import tqdm

from openbook.index import Encoder, LoadedIndex, open_index
from openbook.index.engine import RetrievalMode
from openbook.index.request import SearchRequest
from openbook.rag import DecodingOptions, RagGenerator
from openbook.storage.checkpoint import latest_checkpoint
from openbook_trainer.checkpoints import load_checkpoint
from openbook_trainer.config import TrainConfig
from openbook_trainer.evaluation.metrics import answer_recall_at_k
from openbook_trainer.experiments.inputs import ExperimentInputs
from openbook_trainer.experiments.records import ResultLog, em_f1, qa_row
from openbook_trainer.loop import _pick_amp_dtype, train


@dataclass
class FinetuneConfig(ExperimentInputs):
    out: Path
    dense_index: str = "wiki-2018"
    bm25_index: str = "wiki-2018-bm25"
    dev_articles: int = 10
    seed: int = 0
    train_examples: int = 2000  # at most, from the training articles
    dev_examples: int = 100  # from the development articles
    k: int = 5
    mode: Literal["rag-token", "rag-sequence"] = "rag-token"
    steps: int = 60
    batch_size: int = 4
    lr_generator: float = 1e-3
    # "lora": the query encoder trains as a LoRA adapter (rank and alpha as the generator's);
    # "none": every weight, at the paper's 3e-5
    query_encoder_adapter: Literal["none", "lora"] = "lora"
    lr_query_encoder: float = 3e-4
    lora_rank: int = 16
    lora_alpha: float = 32.0
    max_new_tokens: int = 16
    save_every: int = 10


@dataclass
class Split:
    train_articles: list[str]
    dev_articles: list[str]
    train: list[dict]
    dev: list[dict]


@dataclass
class FinetuneResult:
    config: dict
    split: dict[str, list[str]]
    scores: dict[str, dict[str, float]] = field(default_factory=dict)  # system -> metrics
    recall: dict[str, dict[int, float]] = field(default_factory=dict)  # retriever -> k -> %
    checkpoints: dict[str, str] = field(default_factory=dict)
    adapter_bytes: int = 0
    query_encoder_adapter_bytes: int = 0
    train_precision: str = ""  # the autocast dtype training ran in


def split_by_article(path: Path, dev_articles: int, seed: int) -> tuple[list[str], list[str]]:
    """(training titles, development titles): a seeded shuffle of the sorted titles."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    titles = sorted({r["title"] for r in rows})
    if not 0 < dev_articles < len(titles):
        raise ValueError(
            f"dev_articles must be between 1 and {len(titles) - 1} ({len(titles)} articles)"
        )
    random.Random(seed).shuffle(titles)
    return sorted(titles[dev_articles:]), sorted(titles[:dev_articles])


def _modes(index: LoadedIndex) -> tuple[str, ...]:
    """The retrieval modes ``index`` serves (hybrid where it has both views)."""
    return (*index.views, "hybrid") if len(index.views) > 1 else tuple(index.views)


def make_split(config: FinetuneConfig) -> Split:
    rows = [json.loads(line) for line in Path(config.questions).read_text().splitlines() if line]
    rows.sort(key=lambda r: r["id"])
    train_titles, dev_titles = split_by_article(config.questions, config.dev_articles, config.seed)
    dev_set = set(dev_titles)
    train = [r for r in rows if r["title"] not in dev_set]
    dev = [r for r in rows if r["title"] in dev_set]
    rng = random.Random(config.seed)
    train = rng.sample(train, min(config.train_examples, len(train)))
    dev = rng.sample(dev, min(config.dev_examples, len(dev)))
    return Split(train_titles, dev_titles, train, dev)


def write_questions(path: Path, rows: list[dict]) -> Path:
    """``rows``' id, question and answers as JSONL at ``path``, rewritten only when that text
    changes (a resumed training run checks its checkpoint's data sha256 against the file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(
        json.dumps({"id": r["id"], "question": r["question"], "answers": r["answers"]}) + "\n"
        for r in rows
    )
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def _train(config: FinetuneConfig, train_file: Path, out: Path, joint: bool) -> Path:
    cfg = TrainConfig(
        train=train_file,
        index=Path(config.index_root) / config.dense_index,
        generator=config.generator,
        out=out,
        mode=config.mode,
        k=config.k,
        train_query_encoder=joint,
        generator_adapter="lora",
        query_encoder_adapter=config.query_encoder_adapter if joint else "none",
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        steps=config.steps,
        batch_size=config.batch_size,
        lr_generator=config.lr_generator,
        lr_query_encoder=config.lr_query_encoder,
        warmup_steps=max(1, config.steps // 10),
        save_every=config.save_every,
        keep_last=1,
        seed=config.seed,
    )
    result = train(cfg)
    assert result.checkpoint is not None or result.step == config.steps

    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    return ckpt


def _train_precision() -> str:
    """What ``precision: auto`` trains in here (loop._pick_amp_dtype's CPU/CUDA policy)."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp = _pick_amp_dtype("auto", device)
    return f"{device.type}, " + (
        "float32" if amp is None else f"{amp} autocast".replace("torch.", "")
    )


def _evaluate(
    name: str,
    generator,
    retrieve,
    dev: list[dict],
    config: FinetuneConfig,
    log: ResultLog,
) -> dict[str, float]:
    options = DecodingOptions(mode=config.mode, max_new_tokens=config.max_new_tokens)
    rows = []
    for q in tqdm(dev, desc=name, unit="q"):
        key = f"{name}|{generator.model_version}|{q['id']}"
        row = log.get(key)
        if row is None:
            passages = retrieve([q["question"]])[0]
            answer = generator.generate(q["question"], passages, options).hypotheses[0].text
            row = qa_row(q, answer)
            log.add(key, row)
        rows.append(row)
    return em_f1(rows)


def _recall(retrieved: list[list], dev: list[dict], ks: tuple[int, ...]) -> dict[int, float]:
    texts = [[p.text for p in passages] for passages in retrieved]
    return {k: answer_recall_at_k(texts, [q["answers"] for q in dev], k) for k in ks}


def run_finetune(config: FinetuneConfig) -> FinetuneResult:
    out = Path(config.out)
    split = make_split(config)
    train_file = write_questions(out / "train.jsonl", split.train)
    write_questions(out / "dev.jsonl", split.dev)
    result = FinetuneResult(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        split={"train_articles": split.train_articles, "dev_articles": split.dev_articles},
    )
    log = ResultLog(out / "predictions.jsonl")
    ks = (1, config.k, 2 * config.k)
    questions = [q["question"] for q in split.dev]
    with open_index(Path(config.index_root) / config.bm25_index, verify=False) as bm25:
        result.recall["bm25"] = _recall(
            bm25.search(SearchRequest(questions, k=max(ks))), split.dev, ks
        )

    with open_index(Path(config.index_root) / config.dense_index, verify=False) as index:

        def recall(mode: RetrievalMode, encoder: Encoder | None = None) -> dict[int, float]:
            request = SearchRequest(questions, k=max(ks), retrieval=mode)
            return _recall(index.search(request, encoder=encoder), split.dev, ks)

        result.recall["dense, frozen query encoder"] = recall(RetrievalMode.DENSE)
        if "hybrid" in _modes(index):  # the index's default, which the systems below use
            result.recall["hybrid, frozen query encoder"] = recall(RetrievalMode.HYBRID)
        base = RagGenerator.load(config.generator)
        result.scores["few-shot default"] = _evaluate(
            "few-shot default",
            base,
            lambda qs: index.search(SearchRequest(qs, k=config.k)),
            split.dev,
            config,
            log,
        )
        del base

        for name, joint in (("adapter, frozen retriever", False), ("joint", True)):
            ckpt = _train(config, train_file, out / ("joint" if joint else "adapter"), joint)
            result.checkpoints[name] = str(ckpt)
            loaded = load_checkpoint(ckpt)
            encoder = loaded.query_encoder or index.query_encoder
            if joint:
                joint_recall = recall(RetrievalMode.DENSE, encoder)
                result.recall["dense, jointly trained query encoder"] = joint_recall
                if "hybrid" in _modes(index):
                    joint_recall = recall(RetrievalMode.HYBRID, encoder)
                    result.recall["hybrid, jointly trained query encoder"] = joint_recall
            result.scores[name] = _evaluate(
                name,
                loaded.generator,
                lambda qs, encoder=encoder: index.search(
                    SearchRequest(qs, k=config.k), encoder=encoder
                ),
                split.dev,
                config,
                log,
            )
            adapter = ckpt / "generator_adapter" / "adapter_model.safetensors"
            result.adapter_bytes = adapter.stat().st_size
            q_adapter = ckpt / "query_encoder_adapter" / "adapter_model.safetensors"
            if joint and q_adapter.is_file():
                result.query_encoder_adapter_bytes = q_adapter.stat().st_size
            result.train_precision = _train_precision()
            del loaded  # not held while the next run trains
    (out / "result.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result


def markdown(result: FinetuneResult) -> str:
    c = result.config
    lines = [
        f"Generator `{Path(c['generator']).name}`, {c['mode']} loss over the top k={c['k']} of "
        f"`{c['dense_index']}`; LoRA rank {c['lora_rank']}, alpha {c['lora_alpha']:g} on every "
        f"linear layer but the LM head; {c['steps']} steps of {c['batch_size']} questions "
        f"(lr {c['lr_generator']:g}, query encoder {c['lr_query_encoder']:g}"
        + (
            ", a LoRA adapter of the same rank on its linear layers"
            if c.get("query_encoder_adapter", "none") == "lora"
            else ", every weight"
        )
        + f"; trained in {result.train_precision or 'float32'}). Split by "
        f"article (seed {c['seed']}): {len(result.split['train_articles'])} training articles, "
        f"{len(result.split['dev_articles'])} development articles never seen in training: "
        + ", ".join(result.split["dev_articles"])
        + f". {c['dev_examples']} development questions, open-domain (the question only), "
        f"greedy, at most {c['max_new_tokens']} new tokens, float32. Adapter: "
        f"{result.adapter_bytes / 2**20:.1f} MiB"
        + (
            f"; query encoder adapter: {result.query_encoder_adapter_bytes / 2**20:.2f} MiB."
            if result.query_encoder_adapter_bytes
            else "."
        ),
        "",
        "| system | EM | F1 |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {s['em']:.1f} | {s['f1']:.1f} |" for name, s in result.scores.items()]
    ks = list(next(iter(result.recall.values())).keys())
    lines += [
        "",
        "Answer found in the top-k passages on the development questions (%):",
        "",
        "| retrieval | " + " | ".join(f"k={k}" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for name, by_k in result.recall.items():
        lines.append(f"| {name} | " + " | ".join(f"{v:.1f}" for v in by_k.values()) + " |")
    return "\n".join(lines)
