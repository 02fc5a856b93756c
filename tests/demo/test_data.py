"""The shipped demo data is present, well-formed and consistent."""

from __future__ import annotations

from collections import Counter

from openbook_trainer.demo.data import (
    ALL_FILES,
    DEMO_SNAPSHOTS,
    LEADERS_2016,
    LEADERS_2018,
    LEADERS_QUESTIONS,
    REPO_DATA_DIR,
    SQUAD_PARAGRAPHS,
    SQUAD_QUESTIONS,
    missing_files,
    read_jsonl,
)


def test_all_files_present() -> None:
    assert missing_files(REPO_DATA_DIR) == []
    readme = (REPO_DATA_DIR / "README.md").read_text(encoding="utf-8")
    for needle in ("SQuAD", "CC BY-SA 4.0", "Rajpurkar", "wiki-2016", "wiki-2018"):
        assert needle in readme


def _is_text(value: object) -> bool:
    return isinstance(value, str) and bool(value.strip())


def test_squad_paragraphs_and_questions() -> None:
    paragraphs = list(read_jsonl(REPO_DATA_DIR / SQUAD_PARAGRAPHS))
    assert len(paragraphs) == 2067
    assert all(
        _is_text(p["id"]) and _is_text(p["title"]) and _is_text(p["text"]) for p in paragraphs
    )
    ids = Counter(p["id"] for p in paragraphs)
    assert max(ids.values()) == 1
    assert len({p["title"] for p in paragraphs}) == 48

    questions = list(read_jsonl(REPO_DATA_DIR / SQUAD_QUESTIONS))
    assert len(questions) == 8196
    for q in questions:
        assert _is_text(q["question"]) and q["paragraph"] in ids
        assert q["answers"] and all(_is_text(a) for a in q["answers"])
    assert len({q["title"] for q in questions}) == 40  # 8 articles held out


def test_leaders_snapshots_cover_every_question() -> None:
    questions = list(read_jsonl(REPO_DATA_DIR / LEADERS_QUESTIONS))
    assert len(questions) == 52
    for rel, year in ((LEADERS_2016, 2016), (LEADERS_2018, 2018)):
        passages = {p["id"]: p for p in read_jsonl(REPO_DATA_DIR / rel)}
        assert all(_is_text(p["title"]) and _is_text(p["text"]) for p in passages.values())
        for q in questions:
            office = passages[f"{year}:{q['position']}"]
            assert q[f"answer_{year}"] in office["text"]


def test_snapshots_use_shipped_files() -> None:
    names = {s.name for s in DEMO_SNAPSHOTS}
    assert names == {"wiki-2016", "wiki-2018", "wiki-2016-bm25", "wiki-2018-bm25"}
    for snap in DEMO_SNAPSHOTS:
        assert set(snap.inputs) <= set(ALL_FILES)
        assert snap.index_type in {"flat", "bm25"}


def test_default_data_dir_is_the_settings_one(monkeypatch, tmp_path):
    from openbook_trainer.demo.data import default_data_dir

    monkeypatch.delenv("OPENBOOK_DATA_DIR", raising=False)
    assert default_data_dir() == REPO_DATA_DIR
    monkeypatch.setenv("OPENBOOK_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path
