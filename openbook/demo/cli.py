"""``openbook demo prepare``: build the demo indexes and the default generator (init step).

Mounted by the main CLI as ``app.add_typer(demo_app, name="demo")``. A second run finds both
complete and does nothing, saying so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated

import typer

from openbook.demo.data import default_data_dir

DEFAULT_INDEX_ROOT = "var/indexes"
DEFAULT_MODELS_DIR = "var/models"

app = typer.Typer(help="Offline demo data, indexes and default models.", no_args_is_help=True)


@app.callback()
def _demo() -> None:
    """Offline demo data, indexes and default models."""


def _env_path(var: str, default: str | Path) -> Path:
    return Path(os.environ.get(var) or default)


@app.command()
def prepare(
    index_root: Annotated[
        Path | None,
        typer.Option(help="Where indexes live (env OPENBOOK_INDEX_ROOT, default var/indexes)"),
    ] = None,
    models_dir: Annotated[
        Path | None,
        typer.Option(help="Where models live (env OPENBOOK_MODELS_DIR, default var/models)"),
    ] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="Demo data (env OPENBOOK_DATA_DIR, default the repository's data/)"),
    ] = None,
    skip_models: Annotated[bool, typer.Option(help="Do not prepare the generator")] = False,
    skip_indexes: Annotated[bool, typer.Option(help="Do not build the indexes")] = False,
) -> None:
    """Build the missing demo indexes and the default generator; a no-op when all exist."""
    from openbook.demo.indexes import prepare_demo_indexes
    from openbook.demo.models import (
        DEFAULT_MODEL_DIRNAME,
        is_prepared,
        prepare_default_generator,
    )

    # OPENBOOK_PREPARE (set by docker-compose.yml): what the init step prepares —
    # "indexes,models" (default), "indexes", "models" or "none".
    wanted = {w.strip() for w in os.environ.get("OPENBOOK_PREPARE", "indexes,models").split(",")}
    unknown = wanted - {"indexes", "models", "none", ""}
    if unknown:
        raise typer.BadParameter(
            f"OPENBOOK_PREPARE: unknown part(s) {', '.join(sorted(unknown))}; "
            "use indexes, models or none"
        )
    skip_indexes = skip_indexes or "indexes" not in wanted
    skip_models = skip_models or "models" not in wanted
    index_root = index_root or _env_path("OPENBOOK_INDEX_ROOT", DEFAULT_INDEX_ROOT)
    models_dir = models_dir or _env_path("OPENBOOK_MODELS_DIR", DEFAULT_MODELS_DIR)
    data_dir = data_dir or default_data_dir()
    start = time.monotonic()
    did: list[str] = []

    if not skip_indexes:
        built = prepare_demo_indexes(index_root, data_dir, progress=True)
        did += [f"index {name}" for name in built]
    if not skip_models:
        model_dir = models_dir / DEFAULT_MODEL_DIRNAME
        if is_prepared(model_dir):
            typer.echo(f"generator: already prepared at {model_dir}", err=True)
        else:
            prepare_default_generator(model_dir, progress=True)
            did.append(f"generator {model_dir}")

    if did:
        typer.echo(f"prepared {', '.join(did)} in {time.monotonic() - start:.0f} s")
    else:
        typer.echo("nothing to do: the demo indexes and the default generator are ready")
