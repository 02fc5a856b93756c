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


def test_prepare_builds_only_the_named_demo_indexes(
    tiny_data_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The init step builds the index served first (compose passes the retriever's default);
    init-more the rest, reusing its passages' vectors; a name no demo index has builds
    nothing and says so."""
    from openbook.index import open_index

    root = tmp_path / "indexes"
    args = ["demo", "prepare", "--skip-models", "--index-root", str(root)]
    args += ["--data-dir", str(tiny_data_dir)]
    monkeypatch.setenv("OPENBOOK_TRAINER_PREPARE_INDEXES", "wiki-2018")
    first = CliRunner().invoke(_root_app(), args)
    assert first.exit_code == 0, first.output
    assert sorted(p.name for p in root.iterdir()) == ["wiki-2018"]
    monkeypatch.setenv("OPENBOOK_TRAINER_PREPARE_INDEXES", "my-own-index")
    other = CliRunner().invoke(_root_app(), args)
    assert other.exit_code == 0, other.output
    assert "not demo indexes, left to their owner: my-own-index" in other.output
    assert sorted(p.name for p in root.iterdir()) == ["wiki-2018"]
    monkeypatch.delenv("OPENBOOK_TRAINER_PREPARE_INDEXES")
    rest = CliRunner().invoke(_root_app(), args)
    assert rest.exit_code == 0, rest.output
    assert "already built" in rest.output  # wiki-2018 is not built again
    built = sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
    assert built == ["wiki-2016", "wiki-2016-bm25", "wiki-2018", "wiki-2018-bm25"]
    with open_index(root / "wiki-2016") as index:
        assert index.manifest.fusion is not None  # fitted as when built all at once
