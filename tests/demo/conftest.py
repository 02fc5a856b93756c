"""Shared fixtures for the demo tests: a tiny copy of the demo data."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from openbook_trainer.demo.data import (
    DEMO_SNAPSHOTS,
    LEADERS_2016,
    LEADERS_2018,
    LEADERS_QUESTIONS,
    REPO_DATA_DIR,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes over a minute of CPU (deselect: -m 'not slow')")


def _head(src: Path, dst: Path, n: int) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with src.open(encoding="utf-8") as fin:
        dst.write_text("".join(itertools.islice(fin, n)), encoding="utf-8")


def _squad_questions(src: Path, dst: Path) -> None:
    """The first 20 questions, and two of each of the next 13 articles: enough articles for
    the fine-tuning split (10 dev articles) that the demo's hybrid fusion is fitted with."""
    import json

    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    keep, per_title = lines[:20], {}
    for line in lines[20:]:
        title = json.loads(line)["title"]
        if title not in per_title and len(per_title) == 13:
            continue
        if len(group := per_title.setdefault(title, [])) < 2:
            group.append(line)
    keep += [line for group in per_title.values() for line in group]
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(keep), encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo data cut down to ~25 passages per snapshot (12 paragraphs + 8 leaders rows)."""
    root = tmp_path_factory.mktemp("tiny-data")
    _head(REPO_DATA_DIR / SQUAD_PARAGRAPHS, root / SQUAD_PARAGRAPHS, 12)
    _squad_questions(REPO_DATA_DIR / SQUAD_QUESTIONS, root / SQUAD_QUESTIONS)
    _head(REPO_DATA_DIR / LEADERS_2016, root / LEADERS_2016, 8)
    _head(REPO_DATA_DIR / LEADERS_2018, root / LEADERS_2018, 8)
    shutil.copy(REPO_DATA_DIR / LEADERS_QUESTIONS, root / LEADERS_QUESTIONS)
    return root


@pytest.fixture(scope="session")
def tiny_index_root(tiny_data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The four demo indexes built once from ``tiny_data_dir``."""
    pytest.importorskip("openbook.index")
    from openbook_trainer.demo.indexes import prepare_demo_indexes

    root = tmp_path_factory.mktemp("indexes")
    built = prepare_demo_indexes(root, tiny_data_dir, progress=False)
    assert built == [s.name for s in DEMO_SNAPSHOTS]
    return root
