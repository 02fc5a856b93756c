"""What every experiment reads, and the ``openbook experiments`` options that say where it is.

:class:`ExperimentInputs` is the first part of each experiment's config (the SQuAD questions, the
demo indexes, the base generator); :func:`with_input_options` adds ``--index-root``,
``--generator`` and ``--questions`` to a command once and hands it the :class:`ExperimentInputs`
they make, defaults filled in, as its ``inputs`` parameter.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from openbook_trainer.demo.data import SQUAD_QUESTIONS, default_data_dir
from openbook_trainer.settings import TrainerSettings

IndexRoot = Annotated[
    Path | None, typer.Option(help="demo indexes (default: the settings' OPENBOOK_INDEX_ROOT)")
]
BaseGenerator = Annotated[Path, typer.Option(help="the base generator's directory")]
Questions = Annotated[
    Path | None, typer.Option(help="SQuAD questions JSONL (default: the demo data's)")
]


@dataclass
class ExperimentInputs:
    """What an experiment reads; each experiment's config starts with these fields."""

    questions: Path  # SQuAD questions JSONL
    index_root: Path  # the folder the demo indexes are in
    generator: Path  # the base generator's directory


def with_input_options(command: Callable[..., None]) -> Callable[..., None]:
    """``command`` with ``--index-root``, ``--generator`` and ``--questions`` in place of its
    ``inputs`` parameter (where it stands, so ``--help`` lists them there): the questions default
    to the demo data's, the indexes to the settings' ``OPENBOOK_INDEX_ROOT``."""
    signature = inspect.signature(command, eval_str=True)
    own = list(signature.parameters.values())
    at = [p.name for p in own].index("inputs")

    def option(name: str, annotation: Any, default: Any) -> inspect.Parameter:
        return own[at].replace(name=name, annotation=annotation, default=default)

    options = [
        option("index_root", IndexRoot, None),
        option("generator", BaseGenerator, Path("var/models/gemma-3-270m")),
        option("questions", Questions, None),
    ]

    @functools.wraps(command)
    def run(
        *args: Any,
        index_root: Path | None,
        generator: Path,
        questions: Path | None,
        **kwargs: Any,
    ) -> None:
        inputs = ExperimentInputs(
            questions=questions or default_data_dir() / SQUAD_QUESTIONS,
            index_root=index_root or TrainerSettings().index_root,
            generator=generator,
        )
        command(*args, inputs=inputs, **kwargs)

    parameters = [*own[:at], *options, *own[at + 1 :]]
    run.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    run.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return run
