"""Where the shipped demo data lives and how to read it (see ``data/README.md``)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from openbook_trainer.settings import TrainerSettings

# services/trainer/openbook_trainer/demo/data.py -> the repository root
REPO_DATA_DIR = Path(__file__).resolve().parents[4] / "data"

SQUAD_PARAGRAPHS = Path("squad/paragraphs.jsonl")
SQUAD_QUESTIONS = Path("squad/questions.jsonl")
LEADERS_2016 = Path("leaders/wiki2016.jsonl")
LEADERS_2018 = Path("leaders/wiki2018.jsonl")
LEADERS_QUESTIONS = Path("leaders/questions.jsonl")

ALL_FILES = (SQUAD_PARAGRAPHS, SQUAD_QUESTIONS, LEADERS_2016, LEADERS_2018, LEADERS_QUESTIONS)


@dataclass(frozen=True)
class Snapshot:
    """One demo index: its name, its input files (relative to the data dir) and its type."""

    name: str
    inputs: tuple[Path, ...]
    index_type: str  # "flat" (dense) or "bm25"


DEMO_SNAPSHOTS: tuple[Snapshot, ...] = (
    Snapshot("wiki-2016", (SQUAD_PARAGRAPHS, LEADERS_2016), "flat"),
    Snapshot("wiki-2018", (SQUAD_PARAGRAPHS, LEADERS_2018), "flat"),
    Snapshot("wiki-2016-bm25", (SQUAD_PARAGRAPHS, LEADERS_2016), "bm25"),
    Snapshot("wiki-2018-bm25", (SQUAD_PARAGRAPHS, LEADERS_2018), "bm25"),
)


def default_data_dir() -> Path:
    """The settings' ``OPENBOOK_DATA_DIR`` if set, else the repository's ``data/`` (when
    openbook runs from a checkout or an editable install), else ``./data``."""
    configured = TrainerSettings().data_dir
    if configured is not None:
        return configured
    return REPO_DATA_DIR if REPO_DATA_DIR.is_dir() else Path("data")


def read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    """Yield one object per non-empty line."""
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{line_no}: invalid JSON ({exc})") from exc


def missing_files(data_dir: Path, files: tuple[Path, ...] = ALL_FILES) -> list[Path]:
    """The files of ``files`` that ``data_dir`` lacks."""
    return [data_dir / f for f in files if not (data_dir / f).is_file()]
