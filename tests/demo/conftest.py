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


def _squad(src: Path, dst: Path, n_paragraphs: int, n_questions: int, more: int) -> None:
    """The first paragraphs and questions, plus the first question (and its paragraph) of
    ``more`` further articles: enough articles for the fine-tuning split (10 dev articles)
    that the demo's hybrid fusion is fitted with."""
    import json

    paragraphs = (src / SQUAD_PARAGRAPHS).read_text(encoding="utf-8").splitlines(keepends=True)
    questions = (src / SQUAD_QUESTIONS).read_text(encoding="utf-8").splitlines(keepends=True)
    keep_p, keep_q = paragraphs[:n_paragraphs], questions[:n_questions]
    titles = {json.loads(line)["title"] for line in keep_q}
    by_id = {json.loads(line)["id"]: line for line in paragraphs}
    for line in questions[n_questions:]:
        q = json.loads(line)
        if len(titles) == len({json.loads(x)["title"] for x in questions[:n_questions]}) + more:
            break
        if q["title"] not in titles:
            titles.add(q["title"])
            keep_q.append(line)
            if by_id[q["paragraph"]] not in keep_p:
                keep_p.append(by_id[q["paragraph"]])
    for rel, lines in ((SQUAD_PARAGRAPHS, keep_p), (SQUAD_QUESTIONS, keep_q)):
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        (dst / rel).write_text("".join(lines), encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo data cut down to ~40 passages per snapshot (23 paragraphs + 8 leaders rows)."""
    root = tmp_path_factory.mktemp("tiny-data")
    _squad(REPO_DATA_DIR, root, n_paragraphs=12, n_questions=20, more=11)
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
