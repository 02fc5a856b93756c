"""``openbook merge-adapter``: a checkpoint's LoRA adapter merged into its base model's weights,
written as an ordinary generator directory (``OPENBOOK_GENERATOR_MODEL`` can name it; no peft
needed to serve it, and as fast as the base)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import NoReturn

import typer


def merge_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint dir (or root: its latest)"),
    out: Path = typer.Option(..., "--out", help="directory to write the merged model to"),
    base: Path | None = typer.Option(
        None, "--base", help="the base model dir; default: the one the trainer recorded"
    ),
) -> None:
    """Merge a checkpoint's generator adapter into its base model's weights."""
    from openbook.artifacts import publish, staging_dir
    from openbook.checkpoint import (
        GENERATOR_VERSION_FILE,
        CheckpointError,
        generator_adapter_dir,
        load_generator,
        open_checkpoint,
        save_generator_dir,
    )

    try:
        ckpt, manifest = open_checkpoint(checkpoint)
        if generator_adapter_dir(ckpt) is None:
            _fail(f"{ckpt} holds a whole generator, no adapter: it is already merged")
        base_dir = Path(base if base is not None else manifest.base_generator)
        generator = load_generator(ckpt, device="cpu", dtype="float32", verify=False, base=base)
    except CheckpointError as e:
        _fail(str(e), code=1)
    if out.exists():
        _fail(f"{out} exists: choose a new directory")
    version = f"{manifest.version}-merged"
    with staging_dir(out) as tmp:
        save_generator_dir(generator, tmp, base_dir)
        (tmp / GENERATOR_VERSION_FILE).write_text(
            json.dumps({"version": version}) + "\n", encoding="utf-8"
        )
        publish(tmp, out)
    typer.echo(f"{out}: {manifest.version} merged into {base_dir} (version {version})")


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"openbook merge-adapter: error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(help=merge_command.__doc__)(merge_command)


def main() -> None:
    sys.exit(app())
