"""``openbook-trainer``: the jobs image's command — train, evaluate, prepare the demo, run the
paper's experiments, build and import indexes. (``openbook`` mounts the same sub-commands.)"""

from __future__ import annotations

import sys

import typer
from typer.core import TyperGroup

from openbook.index.cli import app as index_app
from openbook_trainer.cli import app as train_app
from openbook_trainer.demo.cli import app as demo_app
from openbook_trainer.evaluation.cli import app as eval_app
from openbook_trainer.experiments.cli import app as experiments_app
from openbook_trainer.merge import app as merge_app

# name -> (typer app, help); openbook_cli mounts these same apps under the same names.
COMMANDS: dict[str, tuple[typer.Typer, str]] = {
    "train": (train_app, "Fine-tune the query encoder and generator jointly."),
    "merge-adapter": (merge_app, "Merge a checkpoint's LoRA adapters into their bases."),
    "eval": (eval_app, "Score a running system or a checkpoint."),
    "demo": (demo_app, "Demo data, indexes and default models."),
    "experiments": (experiments_app, "The paper's experiments, in small."),
    "index": (index_app, "Build, import and inspect indexes."),
}


def command_group() -> TyperGroup:
    """The sub-commands as one group: a single-command app (train, merge-adapter, eval) is that
    command, a multi-command one (demo, experiments, index) a group of its own."""
    # typer's own click: its commands raise typer's exceptions, which only its groups handle.
    group = TyperGroup(
        name="openbook-trainer",
        help="openbook's jobs: training, evaluation, demo preparation, experiments, indexes.",
    )
    for name, (sub_app, help_text) in COMMANDS.items():
        command = typer.main.get_command(sub_app)
        command.help = command.help or help_text
        group.add_command(command, name)
    return group


def main() -> None:
    sys.exit(command_group().main(prog_name="openbook-trainer"))


if __name__ == "__main__":
    main()
