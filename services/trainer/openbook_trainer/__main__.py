"""``openbook-trainer``: the jobs image's command — train, evaluate, prepare the demo, run the
paper's experiments, build and import indexes. (``openbook`` mounts the same sub-commands.)"""

from __future__ import annotations

import sys

import typer

from openbook.index.cli import app as index_app
from openbook_trainer.cli import app as train_app
from openbook_trainer.demo.cli import app as demo_app
from openbook_trainer.evaluation.cli import app as eval_app
from openbook_trainer.experiments.cli import app as experiments_app

# name -> (typer app, help); openbook_cli mounts these same apps under the same names.
COMMANDS: dict[str, tuple[typer.Typer, str]] = {
    "train": (train_app, "Fine-tune the query encoder and generator jointly."),
    "eval": (eval_app, "Score a running system or a checkpoint."),
    "demo": (demo_app, "Demo data, indexes and default models."),
    "experiments": (experiments_app, "The paper's experiments, in small."),
    "index": (index_app, "Build, import and inspect indexes."),
}

app = typer.Typer(
    help="openbook's jobs: training, evaluation, demo preparation, experiments, indexes.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
for _name, (_sub_app, _help) in COMMANDS.items():
    app.add_typer(_sub_app, name=_name, help=_help)


def main() -> None:
    sys.exit(app())


if __name__ == "__main__":
    main()
