"""``openbook eval``: score a running system (HTTP ``/answer``) or a checkpoint on a JSONL file.

``openbook-trainer eval`` and ``openbook eval`` run it.
"""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NoReturn

import typer

from openbook.index import open_index
from openbook.index.request import SearchRequest
from openbook_trainer.choices import CalibrationKind, Decoding, Task
from openbook_trainer.evaluation.data import DataError, read_examples
from openbook_trainer.evaluation.runner import (
    EvalError,
    Prediction,
    per_example_correct,
    predict_http,
    predict_local,
)
from openbook_trainer.evaluation.runner import score_predictions as score


def eval_command(
    data: Path = typer.Option(..., "--data", help="JSONL of {question|input, answers|target}"),
    url: str | None = typer.Option(
        None, "--url", help="gateway base URL, e.g. http://localhost:8000"
    ),
    checkpoint: Path | None = typer.Option(
        None, "--checkpoint", help="a checkpoint dir, or a checkpoint root (uses its latest)"
    ),
    index: Path | None = typer.Option(None, "--index", help="index dir (with --checkpoint)"),
    task: Task = typer.Option(
        "qa", "--task", help="qa: EM/F1; generation: BLEU/ROUGE-L; classification: accuracy"
    ),
    k: int = typer.Option(5, "--k", min=1, max=100, help="passages per question"),
    decoding: Decoding = typer.Option("rag-token", "--decoding"),
    num_beams: int = typer.Option(1, "--num-beams", min=1, max=16),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1, max=512),
    limit: int | None = typer.Option(None, "--limit", min=1, help="first N examples only"),
    out: Path | None = typer.Option(None, "--out", help="write metrics + predictions as JSON"),
    device: str | None = typer.Option(None, "--device", help="with --checkpoint: cpu, cuda, ..."),
    concurrency: int = typer.Option(
        4, "--concurrency", min=1, help="with --url: parallel requests"
    ),
    fit_calibration: Path | None = typer.Option(
        None,
        "--fit-calibration",
        help="fit a confidence calibration on these questions (the answers' confidence "
        "features or raw confidence vs exact match) and write it as "
        "confidence_calibration.json into this directory: the generator's model or adapter "
        "directory (openbook/rag/confidence.py)",
    ),
    calibration_kind: CalibrationKind = typer.Option(
        "logistic",
        "--calibration-kind",
        help="with --fit-calibration: logistic (over the answers' features: log-probabilities, "
        "passage prior, answer in the passages, cut by length) or piecewise-linear (a "
        "monotone map of raw confidence)",
    ),
) -> None:
    """Score a system on a JSONL file; print a table and optionally write JSON."""
    if (url is None) == (checkpoint is None):
        _fail("give exactly one of --url or --checkpoint")
    if checkpoint is not None and index is None:
        _fail("--checkpoint needs --index (the index the checkpoint was trained against)")
    try:
        examples = read_examples(data, limit=limit)
        if url is not None:
            preds = predict_http(
                examples,
                url,
                k=k,
                decoding=decoding,
                num_beams=num_beams,
                max_new_tokens=max_new_tokens,
                concurrency=concurrency,
            )
            target = url
        else:
            assert checkpoint is not None and index is not None
            preds, target = _predict_checkpoint(
                examples, checkpoint, index, k, decoding, num_beams, max_new_tokens, device
            )
        metrics = score(task, examples, preds, k)
        if fit_calibration is not None:
            provenance = {
                "questions": len(preds),
                "data": str(data),
                "target": target,
                "task": task,
                "k": k,
                "decoding": decoding,
                "model_versions": sorted({p.model_version for p in preds if p.model_version}),
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            }
            written = _fit_calibration(
                task, examples, preds, fit_calibration, calibration_kind, provenance
            )
    except (DataError, EvalError, ValueError, OSError) as e:
        _fail(str(e))
    versions = sorted({p.model_version for p in preds if p.model_version})
    typer.echo(format_table(metrics, title=f"{data.name} ({task}) on {target}"))
    if versions:
        typer.echo(f"model version: {', '.join(versions)}")
    if fit_calibration is not None:
        typer.echo(f"wrote {written}")
    if out is not None:
        report = {
            "data": str(data),
            "target": target,
            "task": task,
            "k": k,
            "decoding": decoding,
            "model_versions": versions,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "metrics": metrics,
            "predictions": [_prediction_row(e, p) for e, p in zip(examples, preds, strict=True)],
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        typer.echo(f"wrote {out}")


def _predict_checkpoint(
    examples: list,
    ckpt: Path,
    index_dir: Path,
    k: int,
    decoding: str,
    num_beams: int,
    max_new_tokens: int,
    device: str | None,
) -> tuple[list[Prediction], str]:
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook.rag import DecodingOptions
    from openbook_trainer.checkpoints import load_checkpoint

    loaded = load_checkpoint(ckpt, device=device)
    # Sizes and shapes are still checked; re-hashing a Wikipedia-sized index takes minutes.
    with open_index(index_dir, verify=False) as index:
        trained_on = loaded.manifest.index.get("checksum")
        if trained_on and trained_on != index.manifest.checksum:
            typer.echo(
                f"warning: checkpoint {loaded.version} was trained against index "
                f"{loaded.manifest.index.get('name')!r} ({trained_on[:12]}), not "
                f"{index.name!r} ({index.manifest.checksum[:12]})",
                err=True,
            )
        encoder = loaded.query_encoder or (index.query_encoder if index.dense else None)
        options = DecodingOptions(mode=decoding, num_beams=num_beams, max_new_tokens=max_new_tokens)
        preds = predict_local(
            examples,
            retrieve=lambda qs: index.search(SearchRequest(qs, k=k), encoder=encoder),
            generator=loaded.generator,
            options=options,
        )
    return preds, str(loaded.path)


def _fit_calibration(
    task: Task,
    examples: list,
    preds: list[Prediction],
    directory: Path,
    kind: CalibrationKind,
    provenance: dict[str, Any],
) -> Path:
    """Fit the answers of ``preds`` (their features, or their raw confidence) to whether each
    is right; write the calibration into ``directory``. Raises ValueError when it cannot be
    fitted."""
    # why: scikit-learn and transformers stay out of `openbook --help` (it imports every command)
    from openbook_trainer.calibration import fit_calibration, fit_logistic_calibration

    if task == "generation":
        raise ValueError(
            "--fit-calibration needs a task with right and wrong answers (qa, "
            "classification), not generation"
        )
    if not directory.is_dir():
        raise ValueError(f"--fit-calibration: {directory} is not a directory")
    correct = per_example_correct(examples, preds)
    if kind == "logistic":
        rows = [p.features for p in preds]
        if any(r is None for r in rows):
            raise ValueError(
                "--fit-calibration: the system reported no confidence features (a hypothesis' "
                "log_prob, raw_confidence, finish_reason and the passages' prior); "
                "--calibration-kind piecewise-linear needs raw_confidence only"
            )
        logistic = fit_logistic_calibration(
            [r for r in rows if r is not None], correct, fitted_on=provenance
        )
        return logistic.save(directory)
    raw = [p.raw_confidence for p in preds]
    if any(r is None for r in raw):
        raise ValueError("--fit-calibration: the system reported no raw_confidence")
    calibration = fit_calibration([r for r in raw if r is not None], correct)
    return calibration.save(directory)


def _prediction_row(example: Any, pred: Prediction) -> dict[str, Any]:
    return {
        "id": example.id,
        "question": example.question,
        "answers": example.answers,
        "prediction": pred.answer,
        "passage_ids": pred.passage_ids,
        "confidence": pred.confidence,
        "raw_confidence": pred.raw_confidence,
        # what a logistic calibration reads (openbook.rag.confidence.calibrate_row applies one)
        "confidence_features": pred.features,
    }


def format_table(metrics: dict[str, float], title: str = "") -> str:
    """A plain two-column table (metrics as percentages, ``n`` as a count)."""
    rows = [(name, f"{v:.0f}" if name == "n" else f"{v:.2f}") for name, v in metrics.items()]
    w1 = max([len("metric"), *(len(r[0]) for r in rows)])
    w2 = max([len("value"), *(len(r[1]) for r in rows)])
    line = f"+-{'-' * w1}-+-{'-' * w2}-+"
    out = [title] if title else []
    out += [line, f"| {'metric':<{w1}} | {'value':>{w2}} |", line]
    out += [f"| {a:<{w1}} | {b:>{w2}} |" for a, b in rows]
    out.append(line)
    return "\n".join(out)


def _fail(message: str) -> NoReturn:
    typer.echo(f"openbook eval: error: {message}", err=True)
    raise typer.Exit(2)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(help=eval_command.__doc__)(eval_command)


def main() -> None:
    sys.exit(app())
