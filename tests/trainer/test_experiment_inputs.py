"""The inputs every experiment reads (openbook_trainer/experiments/inputs.py): one group of
``openbook experiments`` options, handed to a command as one object, defaults filled in."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from openbook_trainer.experiments.inputs import ExperimentInputs, with_input_options


def _app(seen: list[ExperimentInputs]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @with_input_options
    def show(inputs: ExperimentInputs, n: int = typer.Option(1)) -> None:
        seen.append(inputs)

    @app.command()
    def other() -> None:  # a second command, so typer keeps the command names
        pass

    return app


def test_the_inputs_default_to_the_settings_and_the_demo_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OPENBOOK_INDEX_ROOT", str(tmp_path / "indexes"))
    monkeypatch.setenv("OPENBOOK_DATA_DIR", str(tmp_path / "data"))
    seen: list[ExperimentInputs] = []
    result = CliRunner().invoke(_app(seen), ["show", "--n", "2"])
    assert result.exit_code == 0, result.output
    assert seen == [
        ExperimentInputs(
            questions=tmp_path / "data" / "squad" / "questions.jsonl",
            index_root=tmp_path / "indexes",
            generator=Path("var/models/gemma-3-270m"),
        )
    ]


def test_the_options_stand_where_the_inputs_parameter_does() -> None:
    seen: list[ExperimentInputs] = []
    app = _app(seen)
    args = ["show", "--index-root", "i", "--generator", "g", "--questions", "q.jsonl"]
    assert CliRunner().invoke(app, args).exit_code == 0
    assert seen == [ExperimentInputs(Path("q.jsonl"), Path("i"), Path("g"))]
    shown = CliRunner().invoke(app, ["show", "--help"], env={"COLUMNS": "200"}).output
    flags = ["--index-root", "--generator", "--questions", "--n"]
    assert [shown.index(f + " ") for f in flags] == sorted(shown.index(f + " ") for f in flags)
