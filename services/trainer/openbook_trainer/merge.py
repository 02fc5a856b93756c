"""``openbook merge-adapter``: a checkpoint's LoRA adapters merged into their base models'
weights: the generator's written as an ordinary generator directory (``OPENBOOK_GENERATOR_MODEL``
can name it), the query encoder's as an ordinary encoder directory
(``OPENBOOK_RETRIEVER_QUERY_ENCODER`` can name it). No peft is needed to serve them, and they are
as fast as their bases."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn

import typer

from openbook.storage.artifacts import publish, staging_dir
from openbook.storage.checkpoint import (
    GENERATOR_VERSION_FILE,
    CheckpointError,
    generator_adapter_dir,
    open_checkpoint,
    query_encoder_adapter_dir,
)


def merge_command(
    checkpoint: Path = typer.Argument(..., help="checkpoint dir (or root: its latest)"),
    out: Path | None = typer.Option(
        None, "--out", help="directory to write the merged generator to"
    ),
    query_encoder_out: Path | None = typer.Option(
        None, "--query-encoder-out", help="directory to write the merged query encoder to"
    ),
    base: Path | None = typer.Option(
        None, "--base", help="the base generator dir; default: the one the trainer recorded"
    ),
) -> None:
    """Merge a checkpoint's LoRA adapters (generator: --out, query encoder: --query-encoder-out)
    into their base models' weights."""
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook.index.checkpoint import load_query_encoder
    from openbook.rag.checkpoint import load_generator, save_generator_dir

    if out is None and query_encoder_out is None:
        _fail("name where to write: --out (the generator) and/or --query-encoder-out")
    for target in (out, query_encoder_out):
        if target is not None and target.exists():
            _fail(f"{target} exists: choose a new directory")
    try:
        ckpt, manifest = open_checkpoint(checkpoint)
        if out is not None and generator_adapter_dir(ckpt) is None:
            _fail(f"{ckpt} holds a whole generator, no adapter: it is already merged")
        if query_encoder_out is not None and query_encoder_adapter_dir(ckpt) is None:
            _fail(f"{ckpt} holds no query encoder adapter (a whole encoder, or none)")
        generator = (
            None
            if out is None
            else load_generator(ckpt, device="cpu", dtype="float32", verify=False, base=base)
        )
        encoder = None if query_encoder_out is None else load_query_encoder(ckpt, verify=False)
    except (CheckpointError, ValueError) as e:
        _fail(str(e), code=1)
    version = f"{manifest.version}-merged"
    if generator is not None and out is not None:
        base_dir = Path(base if base is not None else manifest.base_generator)
        with staging_dir(out) as tmp:
            save_generator_dir(generator, tmp, base_dir)
            (tmp / GENERATOR_VERSION_FILE).write_text(
                json.dumps({"version": version}) + "\n", encoding="utf-8"
            )
            publish(tmp, out)
        typer.echo(f"{out}: {manifest.version} merged into {base_dir} (version {version})")
    if encoder is not None and query_encoder_out is not None:
        with staging_dir(query_encoder_out) as tmp:
            encoder.name = str(manifest.base_query_encoder)  # its lineage: what it started from
            encoder.save(tmp)
            publish(tmp, query_encoder_out)
        typer.echo(
            f"{query_encoder_out}: {manifest.version}'s query encoder merged into "
            f"{manifest.base_query_encoder}"
        )


def _fail(message: str, code: int = 2) -> NoReturn:
    typer.echo(f"openbook merge-adapter: error: {message}", err=True)
    raise typer.Exit(code)


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command(help=merge_command.__doc__)(merge_command)
