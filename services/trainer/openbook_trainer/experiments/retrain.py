"""Retraining the default generator's adapter on every training article's questions, with the
retrieval it is served with (hybrid) in the loop.

The shipped adapter was trained on 240 questions seen once, with dense retrieval; it is served
behind hybrid retrieval, whose top k differs (more often holding the answer). This run trains a
fresh LoRA adapter of the generator on *all* questions of the 30 training articles (the split
of ``finetune.split_by_article``: the 10 development articles stay unseen), RAG-Token loss over
the fused top k of the demo index, with the query encoder frozen at the shipped query encoder
adapter, so that the index's fusion (fitted with that encoder on the training articles) is the
prior the generator learns under and is served with.

The run is an ordinary ``openbook train`` run (``loop.train``): checkpoints every
``save_every`` steps and resumes from the last one, so it can be stopped and continued across
sessions (the same command again). :func:`export_candidate` writes the newest checkpoint's
adapter beside the shipped query encoder adapter in the layout of ``data/adapters``, which
``openbook experiments trust --candidate`` measures against the shipped default on the
development articles.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from openbook.storage.checkpoint import generator_adapter_dir, latest_checkpoint, read_manifest
from openbook_trainer.config import TrainConfig
from openbook_trainer.experiments.finetune import split_by_article, write_questions
from openbook_trainer.experiments.inputs import ExperimentInputs
from openbook_trainer.loop import TrainResult, train, training_threads

GENERATOR_ADAPTER = "gemma-3-270m-squad"  # the names data/adapters uses
QUERY_ENCODER_ADAPTER = "minilm-squad-query"


@dataclass
class RetrainConfig(ExperimentInputs):
    query_encoder_adapter: Path  # frozen: the one the index's fusion was fitted with
    out: Path
    index: str = "wiki-2018"
    dev_articles: int = 10
    seed: int = 0
    k: int = 5
    steps: int = 180
    batch_size: int = 4  # 4 questions x k passages: ~12 GB of activations for Gemma 3 270M
    lr_generator: float = 5e-4
    warmup_steps: int = 15
    lora_rank: int = 16
    lora_alpha: float = 32.0
    save_every: int = 20


def training_questions(config: RetrainConfig) -> list[dict]:
    """Every question of the training articles (none of a development article), by id."""
    rows = [json.loads(line) for line in Path(config.questions).read_text().splitlines() if line]
    train_titles, _ = split_by_article(config.questions, config.dev_articles, config.seed)
    kept = set(train_titles)
    return sorted((r for r in rows if r["title"] in kept), key=lambda r: r["id"])


def write_training_file(config: RetrainConfig) -> Path:
    """``out/train.jsonl``: :func:`training_questions`."""
    return write_questions(Path(config.out) / "train.jsonl", training_questions(config))


def train_config(config: RetrainConfig, train_file: Path) -> TrainConfig:
    return TrainConfig(
        train=train_file,
        index=Path(config.index_root) / config.index,
        generator=config.generator,
        query_encoder=str(Path(config.query_encoder_adapter).resolve()),
        out=Path(config.out) / "checkpoints",
        mode="rag-token",
        k=config.k,
        retrieval="hybrid",
        train_query_encoder=False,
        generator_adapter="lora",
        lora_rank=config.lora_rank,
        lora_alpha=config.lora_alpha,
        steps=config.steps,
        batch_size=config.batch_size,
        lr_generator=config.lr_generator,
        warmup_steps=config.warmup_steps,
        save_every=config.save_every,
        keep_last=2,
        seed=config.seed,
    )


def run_retrain(config: RetrainConfig) -> TrainResult:
    """Train (or resume) to ``config.steps``; the checkpoints are under ``out/checkpoints``."""
    cfg = train_config(config, write_training_file(config))
    (Path(config.out) / "config.json").write_text(
        json.dumps({k: str(v) for k, v in asdict(config).items()}, indent=2) + "\n"
    )
    return train(cfg, compute=training_threads())


def export_candidate(config: RetrainConfig, dest: Path) -> Path:
    """The newest checkpoint's generator adapter and the (frozen) query encoder adapter, in
    ``data/adapters``' layout under ``dest``; returns the checkpoint exported."""
    ckpt = latest_checkpoint(Path(config.out) / "checkpoints")
    if ckpt is None:
        raise ValueError(f"no checkpoint under {Path(config.out) / 'checkpoints'}: train first")
    adapter = generator_adapter_dir(ckpt)
    if adapter is None:
        raise ValueError(f"{ckpt} holds no generator adapter")
    dest.mkdir(parents=True, exist_ok=True)
    for source, name in (
        (adapter, GENERATOR_ADAPTER),
        (Path(config.query_encoder_adapter), QUERY_ENCODER_ADAPTER),
    ):
        target = dest / name
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(source, target)
    manifest = read_manifest(ckpt)
    (dest / "checkpoint.json").write_text(
        json.dumps({"checkpoint": str(ckpt), "step": manifest.step}, indent=2) + "\n"
    )
    return ckpt
