"""``openbook demo prepare`` mounted as a sub-command, on tiny data and a fake converter."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from openbook_trainer.demo import models
from openbook_trainer.demo.cli import app as demo_app

from .test_models import FakeConverter


def _root_app() -> typer.Typer:
    root = typer.Typer()

    @root.command()
    def version() -> None:  # a second command, as in the real CLI
        typer.echo("0")

    root.add_typer(demo_app, name="demo")
    return root


def test_prepare_models_then_noop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeConverter()
    monkeypatch.setattr(models, "convert_gguf", fake)
    monkeypatch.setenv("OPENBOOK_MODELS_DIR", str(tmp_path / "models"))
    runner = CliRunner()
    first = runner.invoke(_root_app(), ["demo", "prepare", "--skip-indexes"])
    assert first.exit_code == 0, first.output
    assert models.is_prepared(tmp_path / "models" / models.DEFAULT_MODEL_DIRNAME)
    assert "prepared generator" in first.output
    second = runner.invoke(_root_app(), ["demo", "prepare", "--skip-indexes"])
    assert second.exit_code == 0, second.output
    assert fake.calls == 1 and "nothing to do" in second.output


def test_prepare_indexes_noop_when_built(tiny_index_root: Path, tiny_data_dir: Path) -> None:
    result = CliRunner().invoke(
        _root_app(),
        [
            "demo",
            "prepare",
            "--skip-models",
            "--index-root",
            str(tiny_index_root),
            "--data-dir",
            str(tiny_data_dir),
        ],
    )
    assert result.exit_code == 0, result.output
    assert "nothing to do" in result.output
    assert "already built" in result.output
