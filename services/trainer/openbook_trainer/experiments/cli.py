"""``openbook experiments``: the paper's hot-swap and open-domain QA experiments, in small."""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from openbook.config.settings import precision
from openbook_trainer.demo.data import default_data_dir
from openbook_trainer.experiments.hot_swap import markdown as hot_swap_markdown
from openbook_trainer.experiments.hot_swap import run_hot_swap
from openbook_trainer.experiments.inputs import ExperimentInputs, with_input_options
from openbook_trainer.experiments.report import write_section

app = typer.Typer(
    help="Reproduce the RAG paper's experiments on the demo data.",
    no_args_is_help=True,
    add_completion=False,
)


SECRET_PARAMS = {"admin_token"}

# Options several experiments share: one spelling, one help text (the inputs' are in inputs.py).
HybridIndex = Annotated[str, typer.Option(help="an index with a dense and a BM25 view")]
Results = Annotated[Path, typer.Option(help="where the result JSON and pictures are written")]
Report = Annotated[Path, typer.Option(help="the Markdown report whose section is written")]


# The sections of docs/results.md the trust experiment writes, and their titles.
TRUST_SECTIONS = {
    "trust": "Answers you can trust: hybrid retrieval, held-out EM and confidence",
    "retrain": "Retraining the default's adapter: every training question, hybrid in the loop",
    "default": "The shipped default on every development question",
    "int8-head": "The LM head in int8: the shipped default's answers against its own",
    "packed-float32": "Weights packed in float32: the shipped default's answers against its own",
    "packed-amx": "Weights packed on AMX: the shipped default's answers against its own",
    "int8-head-float32": "The LM head in int8 in float32: the shipped default's answers against "
    "its own",
}
# Every section of the report an experiment writes, and its title.
SECTION_TITLES = {
    "hot-swap": "Index hot-swap (paper §4.5)",
    "open-qa": "Open-domain QA on SQuAD (paper Table 1, Figure 3)",
    "finetune": "Fine-tuning the default on unseen articles (paper §2.4)",
    **TRUST_SECTIONS,
}


def _precision(dtype: str) -> str:
    """``--dtype`` as the generator's settings spell it, or a usage error naming the option."""
    try:
        return precision(dtype)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--dtype") from None


@contextmanager
def _exits_on(experiment: str, *errors: type[Exception]) -> Iterator[None]:
    """Exit 1 with ``EXPERIMENT: why`` on stderr when the experiment raises one of ``errors``
    (its inputs or its files are wrong): a message, not a traceback."""
    try:
        yield
    except errors as exc:
        typer.echo(f"{experiment}: {exc}", err=True)
        raise typer.Exit(1) from None


def _save(folder: Path, name: str, text: str) -> None:
    """Write an experiment's result file ``name`` into ``folder``, made if need be."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)


def _publish(
    ctx: typer.Context, report: Path, section: str, table: str, shown: str | None = None
) -> None:
    """Write ``table`` as ``section`` of the Markdown ``report``, with the command that made it,
    and print it (or ``shown``, where the terminal gets less than the report)."""
    write_section(report, section, SECTION_TITLES[section], table, _command_line(ctx))
    typer.echo(table if shown is None else shown)


def _command_line(ctx: typer.Context) -> str:
    """The command as it could be typed again: non-default options, never a secret."""
    parts = ["openbook experiments", ctx.info_name or ""]
    for param in ctx.command.params:
        value = ctx.params.get(param.name)
        if param.name in SECRET_PARAMS or value is None or value == param.default:
            continue
        parts += [param.opts[0], shlex.quote(str(value))]
    return " ".join(parts)


@app.command("hot-swap")
def hot_swap(
    ctx: typer.Context,
    url: str = typer.Option("http://127.0.0.1:8000", envvar="OPENBOOK_URL"),
    admin_token: str = typer.Option(..., envvar="OPENBOOK_ADMIN_TOKEN", show_default=False),
    questions: Path = typer.Option(None, help="leaders questions JSONL (default: demo data)"),
    k: int = typer.Option(5, min=1, max=100),
    decoding: str = typer.Option("rag-token"),
    limit: int = typer.Option(0, help="use only the first N questions (0: all)"),
    out: Path = typer.Option(Path("docs/results"), help="folder for the JSON results"),
    report: Report = Path("docs/results.md"),
) -> None:
    """Ask the leader questions on wiki-2016 and wiki-2018, swapping the live index."""
    questions = questions or default_data_dir() / "leaders" / "questions.jsonl"
    with _exits_on("hot-swap", RuntimeError, OSError):
        result = run_hot_swap(
            url, admin_token, questions, k=k, decoding=decoding, limit=limit or None
        )
    accuracy = {f"{i}/{a}": v for (i, a), v in result.accuracy.items()}
    summary = {"indexes": result.indexes, "accuracy": accuracy, "predictions": result.predictions}
    _save(out, "hot_swap.json", json.dumps(summary, indent=2))
    _publish(ctx, report, "hot-swap", hot_swap_markdown(result))


@app.command("qa")
@with_input_options
def open_qa(
    ctx: typer.Context,
    inputs: ExperimentInputs,
    n: int = typer.Option(100, min=1, help="questions in the fixed subset"),
    seed: int = typer.Option(0),
    prior_scale: float = typer.Option(
        1.0, help="extra factor on the retriever scores before the prior's softmax (> 0)"
    ),
    out: Path = typer.Option(Path("docs/results")),
    report: Report = Path("docs/results.md"),
) -> None:
    """Closed book vs RAG-Token vs RAG-Sequence, dense vs BM25, EM vs k (Figure 3)."""
    if prior_scale <= 0:
        raise typer.BadParameter("must be greater than 0", param_hint="--prior-scale")
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook_trainer.experiments.open_qa import (
        OpenQAConfig,
        markdown,
        plot_em_by_k,
        run_open_qa,
    )

    config = OpenQAConfig(**asdict(inputs), n=n, seed=seed, prior_scale=prior_scale)
    with _exits_on("qa", ValueError, OSError):
        result = run_open_qa(config, out)
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in result.config.items()}
    summary = {"scores": result.scores, "retrieval": result.retrieval, "config": settings}
    _save(out, "open_qa.json", json.dumps(summary, indent=2))
    plot = out / "em_vs_k.png"
    plot_em_by_k(result, config.ks, plot)
    table = markdown(result) + f"\n\n![EM against k]({plot.relative_to(report.parent)})"
    _publish(ctx, report, "open-qa", table, shown=markdown(result))


@app.command("finetune")
@with_input_options
def finetune(
    ctx: typer.Context,
    inputs: ExperimentInputs,
    out: Path = typer.Option(Path("var/experiments/finetune"), help="checkpoints, predictions"),
    dev_articles: int = typer.Option(10, min=1, help="articles held out for development"),
    dev_examples: int = typer.Option(100, min=1, help="development questions scored"),
    train_examples: int = typer.Option(2000, min=1, help="training questions, at most"),
    steps: int = typer.Option(60, min=1, help="optimizer steps per training run"),
    batch_size: int = typer.Option(4, min=1),
    lr_generator: float = typer.Option(1e-3, min=0, help="the adapter's learning rate"),
    lr_query_encoder: float = typer.Option(3e-4, min=0, help="(3e-5 with --full-query-encoder)"),
    full_query_encoder: bool = typer.Option(
        False, help="joint training tunes every query encoder weight, not a LoRA adapter"
    ),
    k: int = typer.Option(5, min=1, max=100),
    lora_rank: int = typer.Option(16, min=1, max=256),
    seed: int = typer.Option(0),
    results: Results = Path("docs/results"),
    report: Report = Path("docs/results.md"),
) -> None:
    """Few-shot default vs a LoRA-tuned generator vs joint training, on unseen articles."""
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook_trainer.experiments.finetune import FinetuneConfig, markdown, run_finetune

    config = FinetuneConfig(
        **asdict(inputs),
        out=out,
        dev_articles=dev_articles,
        dev_examples=dev_examples,
        train_examples=train_examples,
        steps=steps,
        batch_size=batch_size,
        lr_generator=lr_generator,
        lr_query_encoder=lr_query_encoder,
        query_encoder_adapter="none" if full_query_encoder else "lora",
        k=k,
        lora_rank=lora_rank,
        seed=seed,
    )
    with _exits_on("finetune", ValueError, OSError):
        result = run_finetune(config)
    _save(results, "finetune.json", (out / "result.json").read_text())
    _publish(ctx, report, "finetune", markdown(result))


@app.command("retrain")
@with_input_options
def retrain(
    inputs: ExperimentInputs,
    index: HybridIndex = "wiki-2018",
    query_encoder_adapter: Path = typer.Option(
        None, help="the frozen query encoder adapter (default: the demo data's)"
    ),
    out: Path = typer.Option(Path("var/experiments/retrain"), help="checkpoints, train.jsonl"),
    export: Path = typer.Option(
        Path("var/experiments/retrain/adapters"),
        help="where the newest checkpoint's adapters are written (for trust --candidate)",
    ),
    steps: int = typer.Option(180, min=1, help="optimizer steps (the schedule's length)"),
    batch_size: int = typer.Option(4, min=1),
    lr_generator: float = typer.Option(5e-4, min=0, help="the adapter's learning rate"),
    warmup_steps: int = typer.Option(15, min=0),
    k: int = typer.Option(5, min=1, max=100),
    lora_rank: int = typer.Option(16, min=1, max=256),
    save_every: int = typer.Option(20, min=1, help="steps between checkpoints (resume points)"),
    seed: int = typer.Option(0),
    train_now: bool = typer.Option(
        True, "--train/--export-only", help="train (or resume) before exporting"
    ),
) -> None:
    """Retrain the default generator's adapter on every training article's questions with
    hybrid retrieval in the loop (experiments/retrain.py); resumes where it stopped."""
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook_trainer.experiments.retrain import RetrainConfig, export_candidate, run_retrain

    adapters = default_data_dir() / "adapters"
    config = RetrainConfig(
        **asdict(inputs),
        query_encoder_adapter=query_encoder_adapter or adapters / "minilm-squad-query",
        out=out,
        index=index,
        k=k,
        steps=steps,
        batch_size=batch_size,
        lr_generator=lr_generator,
        warmup_steps=warmup_steps,
        lora_rank=lora_rank,
        save_every=save_every,
        seed=seed,
    )
    with _exits_on("retrain", ValueError, OSError):
        if train_now:
            run_retrain(config)
        ckpt = export_candidate(config, export)
    typer.echo(f"exported {ckpt} to {export}")


@app.command("trust")
@with_input_options
def trust(
    ctx: typer.Context,
    inputs: ExperimentInputs,
    index: HybridIndex = "wiki-2018",
    adapters: Path = typer.Option(
        None, help="the shipped adapters' folder (default: the demo data's adapters)"
    ),
    out: Path = typer.Option(Path("var/experiments/trust"), help="predictions, result.json"),
    dev_examples: int = typer.Option(0, min=0, help="development questions (0: all)"),
    folds: int = typer.Option(10, min=0, help="k-fold over articles for the fusion (0: skip)"),
    readers: bool = typer.Option(True, help="also answer with every system (slow)"),
    only: str = typer.Option("", help="comma-separated system numbers to run (1-based)"),
    candidate: Path = typer.Option(
        None,
        help="adapters to judge against the shipped default (a folder in data/adapters' "
        "layout, e.g. `experiments retrain`'s export): system 5",
    ),
    int8_head: bool = typer.Option(
        False, help="also the shipped default with its LM head in int8 (OPENBOOK_GENERATOR_LM_HEAD)"
    ),
    unpacked: bool = typer.Option(
        False,
        help="also the shipped default with its weights not packed "
        "(OPENBOOK_GENERATOR_PACKED_WEIGHTS=off)",
    ),
    batch_size: int = typer.Option(8, min=1),
    seed: int = typer.Option(0),
    dtype: str = typer.Option(
        "auto",
        help="the generator's precision, as OPENBOOK_GENERATOR_DTYPE: auto (what this CPU "
        "serves), float32, bfloat16, float16",
    ),
    results: Results = Path("docs/results"),
    report: Report = Path("docs/results.md"),
    section: str = typer.Option(
        "trust", help=f"the section of --report written: {', '.join(TRUST_SECTIONS)}"
    ),
) -> None:
    """Recall of dense / BM25 / hybrid retrieval, the reader's EM with intervals, and the
    confidence's calibration, on the development articles (experiments/trust.py)."""
    if section not in TRUST_SECTIONS:
        raise typer.BadParameter(f"one of {', '.join(TRUST_SECTIONS)}", param_hint="--section")
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook_trainer.experiments.trust import (
        TrustConfig,
        default_systems,
        markdown,
        plot_confidence,
        plot_coverage,
        run_trust,
    )

    if candidate is not None:
        # checked here, not an hour in when system 5 loads its adapter
        missing = [
            name
            for name in ("gemma-3-270m-squad", "minilm-squad-query")
            if not (candidate / name / "adapter_config.json").is_file()
        ]
        if missing:
            raise typer.BadParameter(
                f"{candidate} has no adapter {', '.join(missing)} (adapter_config.json): "
                "a folder in data/adapters' layout is expected",
                param_hint="--candidate",
            )
    systems = default_systems(
        adapters or default_data_dir() / "adapters", candidate, int8_head, unpacked
    )
    if only:
        try:
            systems = [systems[int(i) - 1] for i in only.split(",")]
        except (ValueError, IndexError):
            raise typer.BadParameter(
                f"systems are 1..{len(systems)}", param_hint="--only"
            ) from None
    config = TrustConfig(
        **asdict(inputs),
        out=out,
        systems=systems,
        index=index,
        dev_examples=dev_examples,
        folds=folds,
        batch_size=batch_size,
        seed=seed,
        dtype=_precision(dtype),
    )
    with _exits_on("trust", ValueError, OSError):
        result, rows = run_trust(config, readers=readers)
    _save(results, "trust.json", (out / "result.json").read_text())
    pictures = plot_confidence(result, results)
    coverage = plot_coverage(result, rows.__getitem__, results)
    if coverage is not None:
        pictures["coverage"] = coverage
    table = markdown(result, {t: str(p.relative_to(report.parent)) for t, p in pictures.items()})
    _publish(ctx, report, section, table)
