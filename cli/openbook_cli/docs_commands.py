"""The ``openbook docs`` sub-commands: put, upload, rm, get, ls and create-index, over HTTP.

Each command prints the gateway's JSON reply (``put FILE`` a summary of the load) and exits 1
with the gateway's refusal on stderr. The logic is :mod:`openbook_cli.docs`'s.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from openbook_cli.docs import (
    DEFAULT_BATCH_BYTES,
    DEFAULT_BATCH_SIZE,
    BatchOptions,
    DocsError,
    GatewayTarget,
    create_index,
    get_document,
    list_documents,
    put_document,
    put_file,
    remove_document,
)
from openbook_cli.docs_upload import upload
from openbook_cli.gateway_options import GatewayOptions, echo_json, fail, reply

docs_app = typer.Typer(
    help="Documents of live indexes: put, upload, rm, get, ls, create-index (the gateway's "
    "documents API; writes need a key with the write scope, OPENBOOK_API_KEY, or "
    "OPENBOOK_ADMIN_TOKEN).",
    no_args_is_help=True,
)

_GATEWAY = GatewayOptions(300.0, "the admin token (writes)", with_key=True)


def _metadata(option: str | None) -> Any:
    """The ``--metadata`` option of ``put`` and ``upload`` as JSON (None: not given); the
    gateway checks what it holds."""
    if option is None:
        return None
    try:
        return json.loads(option)
    except ValueError as exc:
        raise DocsError(f"--metadata is not JSON: {exc}") from None


@docs_app.command("put")
@_GATEWAY
def put_command(
    index: str = typer.Argument(..., help="the index to write to"),
    file: Path | None = typer.Argument(
        None, help="a JSONL file: one {id, title, text, metadata?} object per line"
    ),
    doc_id: str | None = typer.Option(None, "--id", help="one document's id (without FILE)"),
    title: str = typer.Option("", "--title", help="its title"),
    text: str | None = typer.Option(None, "--text", help="its text"),
    metadata: str | None = typer.Option(
        None, "--metadata", help="its metadata: a JSON object of scalars"
    ),
    batch_size: int = typer.Option(DEFAULT_BATCH_SIZE, min=1, help="documents per batch"),
    batch_bytes: int = typer.Option(DEFAULT_BATCH_BYTES, min=1, help="bytes per batch at most"),
    start: int = typer.Option(
        0, min=0, help="skip this many lines of FILE (acknowledged by an earlier run)"
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    *,
    target: GatewayTarget,
) -> None:
    """Insert or replace documents: a JSONL FILE in batches, or one given by --id/--text."""
    try:
        if file is not None:
            if doc_id is not None or text is not None or metadata is not None:
                raise DocsError("give either FILE or --id/--title/--text/--metadata, not both")
            options = BatchOptions(batch_size, batch_bytes, start)
            echo_json(put_file(target, index, file, options, progress=not no_progress))
            return
        if doc_id is None or text is None:
            raise DocsError("give a JSONL FILE, or --id and --text (and --title) of one document")
        echo_json(put_document(target, index, doc_id, title, text, _metadata(metadata)))
    except (DocsError, OSError, ValueError) as exc:
        raise fail("docs", "put", exc) from None


@docs_app.command("upload")
@_GATEWAY
def upload_command(
    index: str = typer.Argument(..., help="the index to write to"),
    paths: list[Path] = typer.Argument(
        ..., help="files (text, Markdown, HTML, PDF), directories (recursively), zip/tar archives"
    ),
    metadata: str | None = typer.Option(
        None, "--metadata", help="metadata for every file: a JSON object of scalars"
    ),
    no_progress: bool = typer.Option(False, "--no-progress", help="no progress bar"),
    *,
    target: GatewayTarget,
) -> None:
    """Upload files, one document each; files already in the index (same content) are
    skipped, so running it again resumes a run that stopped."""
    try:
        meta = _metadata(metadata)
        report = upload(target, index, paths, metadata=meta, progress=not no_progress)
    except (DocsError, OSError) as exc:
        raise fail("docs", "upload", exc) from None
    echo_json(report.summary(index))
    if report.refused:
        typer.echo(f"openbook docs upload: {len(report.refused)} file(s) refused", err=True)
        raise typer.Exit(1)


def _one_document(
    name: str, action: Callable[[GatewayTarget, str, str], Any], summary: str
) -> None:
    """Add the command ``name INDEX ID``: ``action`` on one document, by its id."""

    @docs_app.command(name, help=summary)
    @_GATEWAY
    def command(
        index: str, doc_id: str = typer.Argument(..., metavar="ID"), *, target: GatewayTarget
    ) -> None:
        reply("docs", name, lambda: action(target, index, doc_id))


_one_document(
    "rm", remove_document, "Delete a document (its passages are never served once this returns)."
)
_one_document("get", get_document, "A document, its metadata and its passage ids.")


@docs_app.command("ls")
@_GATEWAY
def ls_command(
    index: str,
    cursor: str | None = typer.Option(None, help="the next_cursor of the previous page"),
    limit: int | None = typer.Option(None, min=1, help="ids per page (default: the gateway's)"),
    *,
    target: GatewayTarget,
) -> None:
    """A page of document ids, in id order, and the cursor of the next page."""
    reply("docs", "ls", lambda: list_documents(target, index, cursor, limit))


@docs_app.command("create-index")
@_GATEWAY
def create_index_command(
    name: str,
    index_type: str | None = typer.Option(
        None, "--type", help="flat | hnsw | hnsw-sq8 | ivfpq | bm25 (default: like's, else flat)"
    ),
    like: str | None = typer.Option(None, help="an index whose encoders and type to take"),
    *,
    target: GatewayTarget,
) -> None:
    """Create an empty index."""
    reply("docs", "create-index", lambda: create_index(target, name, index_type, like))
