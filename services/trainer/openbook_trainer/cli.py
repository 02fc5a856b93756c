"""``openbook train``: fine-tune RAG's query encoder and/or generator (see docs/training.md).

``openbook-trainer train`` and ``openbook train`` run it.
Every flag can also be set in ``--config FILE.yaml`` (same names); flags win over the file.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any, NoReturn

import typer

from openbook.index import IndexLoadError
from openbook.storage.checkpoint import CheckpointError
from openbook_trainer.choices import Adapter, Mode, Precision, Retrieval, Task
from openbook_trainer.distributed import DistributedError
from openbook_trainer.evaluation.data import DataError


def _adapter_option(part: str) -> Any:
    """``--PART-adapter``, the same choice for either trainable part of RAG."""
    return typer.Option(
        None,
        f"--{part.replace(' ', '-')}-adapter",
        help=f"lora: train a LoRA adapter of the {part} only (checkpoints hold the adapter)",
    )


def train_command(
    config: Path | None = typer.Option(None, "--config", help="YAML file of options"),
    train: Path | None = typer.Option(None, "--train", help="training JSONL"),
    dev: Path | None = typer.Option(None, "--dev", help="dev JSONL for periodic evaluation"),
    index: Path | None = typer.Option(None, "--index", help="index directory (kept frozen)"),
    generator: Path | None = typer.Option(None, "--generator", help="generator model dir"),
    query_encoder: str | None = typer.Option(
        None, "--query-encoder", help="name or dir; default: the index's query encoder"
    ),
    out: Path | None = typer.Option(None, "--out", help="checkpoint root"),
    task: Task | None = typer.Option(
        None, "--task", help="dev metrics: qa (default), generation, classification"
    ),
    mode: Mode | None = typer.Option(None, "--mode", help="rag-token (default) or rag-sequence"),
    k: int | None = typer.Option(None, "--k", help="passages per question (default 5)"),
    retrieval: Retrieval | None = typer.Option(
        None,
        "--retrieval",
        help="dense, or hybrid (the fused dense + BM25 prior); default: the index's",
    ),
    train_query_encoder: bool | None = typer.Option(
        None, "--train-query-encoder/--freeze-query-encoder"
    ),
    train_generator: bool | None = typer.Option(None, "--train-generator/--freeze-generator"),
    steps: int | None = typer.Option(None, "--steps", help="optimizer steps"),
    epochs: float | None = typer.Option(None, "--epochs", help="passes over --train (default 1)"),
    batch_size: int | None = typer.Option(None, "--batch-size"),
    grad_accum: int | None = typer.Option(None, "--grad-accum"),
    lr_generator: float | None = typer.Option(None, "--lr-generator"),
    lr_query_encoder: float | None = typer.Option(None, "--lr-query-encoder"),
    warmup_steps: int | None = typer.Option(None, "--warmup-steps"),
    label_smoothing: float | None = typer.Option(None, "--label-smoothing"),
    precision: Precision | None = typer.Option(None, "--precision"),
    device: str | None = typer.Option(None, "--device", help="cpu, cuda, cuda:1 (default: auto)"),
    eval_every: int | None = typer.Option(None, "--eval-every", help="steps; 0: at end only"),
    save_every: int | None = typer.Option(None, "--save-every", help="steps; 0: at end only"),
    keep_last: int | None = typer.Option(None, "--keep-last", help="checkpoints kept"),
    seed: int | None = typer.Option(None, "--seed"),
    shard_optimizer: bool | None = typer.Option(
        None,
        "--shard-optimizer/--no-shard-optimizer",
        help="under torchrun: shard the Adam state across ranks (ZeRO-1)",
    ),
    dist_timeout: float | None = typer.Option(
        None, "--dist-timeout", help="seconds a rank waits for the others (1800)"
    ),
    resume: bool | None = typer.Option(
        None, "--resume/--no-resume", help="continue from OUT/latest (default: resume)"
    ),
    progress: bool | None = typer.Option(None, "--progress/--no-progress"),
    generator_adapter: Adapter | None = _adapter_option("generator"),
    query_encoder_adapter: Adapter | None = _adapter_option("query encoder"),
    lora_rank: int | None = typer.Option(None, "--lora-rank", help="adapter rank r (16)"),
    lora_alpha: float | None = typer.Option(None, "--lora-alpha", help="scale alpha (32)"),
    lora_dropout: float | None = typer.Option(None, "--lora-dropout", help="(0.05)"),
    lora_targets: list[str] | None = typer.Option(
        None, "--lora-target", help="a module name to adapt (repeat); default: all linear"
    ),
) -> None:
    """Fine-tune RAG: marginal NLL through p(z|x) into the query encoder and/or generator."""
    flags = dict(locals())
    flags.pop("config")
    flags["lora_targets"] = flags["lora_targets"] or None  # none given: the config's
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook.rag import ModelLoadError
    from openbook_trainer.config import ConfigError, TrainConfig

    try:
        cfg = TrainConfig.load(config, **flags)
    except ConfigError as e:
        _fail(str(e))
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook_trainer.loop import train as run_training
    from openbook_trainer.loop import training_threads

    try:
        compute = training_threads()
    except ValueError as e:  # pydantic's ValidationError: OPENBOOK_COMPUTE_THREADS is no count
        _fail(f"OPENBOOK_COMPUTE_THREADS: {e}")
    try:
        result = run_training(cfg, compute=compute)
    except (
        ConfigError,
        CheckpointError,
        DataError,
        DistributedError,
        IndexLoadError,
        ModelLoadError,
    ) as e:
        _fail(str(e), code=1)
    except KeyboardInterrupt:
        typer.echo(
            "interrupted; rerun the same command to resume from the last checkpoint", err=True
        )
        raise typer.Exit(130) from None
    where = f" -> {result.checkpoint}" if result.checkpoint else ""
    typer.echo(f"done at step {result.step}{where}")


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"openbook train: error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(help=train_command.__doc__)(train_command)


def main() -> None:
    sys.exit(app())
