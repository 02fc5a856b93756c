"""``openbook-trainer``: the jobs image's command — train, evaluate, prepare the demo, run the
paper's experiments, build and import indexes. (``openbook`` mounts the same sub-commands.)"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

import typer
from typer.core import TyperGroup

if TYPE_CHECKING:  # typer vendors click: its groups take and return typer's own click objects
    from typer._click.core import Command, Context

# name -> (module whose ``app`` is the typer app, help); openbook_cli mounts these same
# commands under the same names (through command_group).
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("openbook_trainer.cli", "Fine-tune the query encoder and generator jointly."),
    "merge-adapter": (
        "openbook_trainer.merge",
        "Merge a checkpoint's LoRA adapters into their bases.",
    ),
    "eval": ("openbook_trainer.evaluation.cli", "Score a running system or a checkpoint."),
    "demo": ("openbook_trainer.demo.cli", "Demo data, indexes and default models."),
    "experiments": ("openbook_trainer.experiments.cli", "The paper's experiments, in small."),
    "index": ("openbook.index.cli", "Build, import and inspect indexes."),
}


class _Commands(TyperGroup):
    """The sub-commands, each imported when it is named: a single-command app (train,
    merge-adapter, eval) is that command, a multi-command one (demo, experiments, index) a group
    of its own."""

    def list_commands(self, ctx: Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: Context, name: str) -> Command | None:
        if name not in COMMANDS:
            return None
        module, help_text = COMMANDS[name]
        # why: each command's module pulls in its own heavy libraries (torch, transformers), and
        # a job runs one command: compose's init, which mostly finds nothing to do, runs at every
        # start on the way to the services and took seconds of CPU importing all of them
        sub_app: typer.Typer = importlib.import_module(module).app
        command = typer.main.get_command(sub_app)
        # the name it is mounted under: a one-command app's click command is named after its
        # function (train_command), and a group has none; help lists commands by this name
        command.name = name
        command.help = command.help or help_text
        return command


def command_group() -> TyperGroup:
    """The sub-commands as one group (:class:`_Commands`)."""
    # typer's own click: its commands raise typer's exceptions, which only its groups handle.
    return _Commands(
        name="openbook-trainer",
        help="openbook's jobs: training, evaluation, demo preparation, experiments, indexes.",
    )


def main() -> None:
    sys.exit(command_group().main(prog_name="openbook-trainer"))


if __name__ == "__main__":
    main()
