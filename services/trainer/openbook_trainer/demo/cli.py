"""``openbook demo prepare``: build the demo indexes and the default generator (init step).

Mounted by the main CLI as ``app.add_typer(demo_app, name="demo")``. A second run finds both
complete and does nothing, saying so.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from openbook_trainer.demo.data import DEMO_SNAPSHOTS, default_data_dir
from openbook_trainer.settings import TrainerSettings

app = typer.Typer(help="Offline demo data, indexes and default models.", no_args_is_help=True)


@app.callback()
def _demo() -> None:
    """Offline demo data, indexes and default models."""


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
    try:
        settings = TrainerSettings()
    except ValidationError as exc:
        raise typer.BadParameter(str(exc)) from None
    # OPENBOOK_TRAINER_PREPARE (set by docker-compose.yml): what the init step prepares.
    skip_indexes = skip_indexes or not settings.prepares("indexes")
    skip_models = skip_models or not settings.prepares("models")
    index_root = index_root or settings.index_root
    models_dir = models_dir or settings.models_dir
    data_dir = data_dir or default_data_dir()
    start = time.monotonic()
    did: list[str] = []
    if skip_models and skip_indexes:
        # compose's init and init-more where OPENBOOK_TRAINER_PREPARE says nothing to prepare
        # (stacks started on prepared data): said before importing what preparing needs
        typer.echo("nothing to do: the demo indexes and the default generator are ready")
        return
    # (transformers and torch stay out of `openbook --help`, which imports every command)
    # why: torch and transformers load only where there is something to prepare
    from openbook.index.encoders import DEFAULT_ENCODER, encoder_weights_dir
    from openbook_trainer.demo.indexes import prepare_demo_indexes
    from openbook_trainer.demo.models import (
        DEFAULT_ADAPTER,
        DEFAULT_ADAPTER_DIRNAME,
        DEFAULT_MODEL_DIRNAME,
        DEFAULT_QUERY_ADAPTER,
        DEFAULT_QUERY_ADAPTER_DIRNAME,
        install_shipped_adapter,
        is_prepared,
        prepare_default_generator,
    )

    # The generator's conversion (a minute of GGUF dequantization) runs beside the index
    # builds instead of after them: the first start waits for the longer of the two, not the
    # sum (docs/benchmarks.md, "First answer"). Both release the GIL for their heavy work
    # (numpy, torch, the tokenizers), so a thread is enough.
    with ThreadPoolExecutor(1, thread_name_prefix="prepare-generator") as pool:
        converting: Future[Path] | None = None
        model_dir = models_dir / DEFAULT_MODEL_DIRNAME
        if not skip_models:
            if is_prepared(model_dir):
                typer.echo(f"generator: already prepared at {model_dir}", err=True)
            else:
                converting = pool.submit(prepare_default_generator, model_dir, progress=True)
        if not skip_indexes:
            names = settings.index_names()
            if names is not None:
                known = {s.name for s in DEMO_SNAPSHOTS}
                if other := [n for n in names if n not in known]:
                    typer.echo(
                        f"not demo indexes, left to their owner: {', '.join(other)}", err=True
                    )
                names = [n for n in names if n in known]
            built = prepare_demo_indexes(index_root, data_dir, progress=True, names=names)
            did += [f"index {name}" for name in built]
        if converting is not None:
            converting.result()
            did.append(f"generator {model_dir}")
    if not skip_models:
        adapter_dir = models_dir / DEFAULT_ADAPTER_DIRNAME
        shipped = data_dir / "adapters"
        if install_shipped_adapter(shipped / DEFAULT_ADAPTER, model_dir, adapter_dir):
            did.append(f"adapter {adapter_dir}")
        # The query encoder's: its base is the packaged MiniLM the demo indexes are built with.
        q_adapter_dir = models_dir / DEFAULT_QUERY_ADAPTER_DIRNAME
        q_base = encoder_weights_dir(DEFAULT_ENCODER)
        if install_shipped_adapter(shipped / DEFAULT_QUERY_ADAPTER, q_base, q_adapter_dir):
            did.append(f"query encoder adapter {q_adapter_dir}")

    if did:
        typer.echo(f"prepared {', '.join(did)} in {time.monotonic() - start:.0f} s")
    else:
        typer.echo("nothing to do: the demo indexes and the default generator are ready")
