from __future__ import annotations

import gzip
from pathlib import Path

import pytest

from openbook.index import read_passages, split_passages
from openbook_testkit.index import write_dpr_tsv, write_jsonl


def test_split_disjoint_windows() -> None:
    text = " ".join(f"w{i}" for i in range(250))
    parts = split_passages("T", text)
    assert [len(p.split()) for p in parts] == [100, 100, 50]
    assert " ".join(parts).split() == text.split()  # disjoint and complete
    assert split_passages("T", "   ") == []
    assert split_passages("T", "a b c", max_words=2) == ["a b", "c"]
    with pytest.raises(ValueError):
        split_passages("T", "a", max_words=0)


def test_jsonl_splits_long_text_and_keeps_title(tmp_path: Path) -> None:
    long = " ".join(f"x{i}" for i in range(130))
    p = write_jsonl(
        tmp_path / "a.jsonl",
        [{"id": "a", "title": "A", "text": "short text"}, {"id": 7, "title": "B", "text": long}],
    )
    got = list(read_passages([p]))
    assert [(x.id, x.title) for x in got] == [("a", "A"), ("7#0", "B"), ("7#1", "B")]
    assert len(got[1].text.split()) == 100 and len(got[2].text.split()) == 30


@pytest.mark.parametrize(
    ("line", "msg"),
    [
        ('{"id": "x", "title": "t"}', "missing field(s) text"),
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"id": "x", "title": "t", "text": null}', "must be a string"),
    ],
)
def test_jsonl_bad_line_names_file_and_line(tmp_path: Path, line: str, msg: str) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"id": "ok", "title": "t", "text": "fine"}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad\.jsonl:3: .*{__import__('re').escape(msg)}"):
        list(read_passages([p]))


def test_dpr_tsv_with_quotes_and_gzip(tmp_path: Path) -> None:
    rows = [
        {"id": "1", "title": "Aaron", "text": 'Aaron ( or ; "Ahärôn") is a prophet'},
        {"id": "2", "title": "Tab", "text": "plain"},
    ]
    p = write_dpr_tsv(tmp_path / "psgs_w100.tsv", rows)
    got = list(read_passages([p]))
    expected = [(r["id"], r["title"], r["text"]) for r in rows]
    assert [(x.id, x.title, x.text) for x in got] == expected
    gz = tmp_path / "psgs.tsv.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    assert [x.id for x in read_passages([gz])] == ["1", "2"]


def test_dpr_tsv_bad_line(tmp_path: Path) -> None:
    p = tmp_path / "p.tsv"
    p.write_text("id\ttext\ttitle\n1\tok\tT\n2\tonly two\n")
    with pytest.raises(ValueError, match=r"p\.tsv:3: expected 3 tab-separated columns"):
        list(read_passages([p]))


def test_articles_text_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "Moon.txt").write_text(" ".join(["moon"] * 150))
    arts = write_jsonl(tmp_path / "arts.jsonl", [{"title": "Sun", "text": "hot star"}])
    got = list(read_passages([tmp_path / "Moon.txt", arts], input_format="articles"))
    assert [(x.id, x.title, len(x.text.split())) for x in got] == [
        ("Moon#0", "Moon", 100),
        ("Moon#1", "Moon", 50),
        ("Sun#0", "Sun", 2),
    ]
    # auto picks "articles" for .txt
    assert len(list(read_passages([tmp_path / "Moon.txt"]))) == 2
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "no title"}])
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: missing field\(s\) title"):
        list(read_passages([bad], input_format="articles"))


def test_unknown_format_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="cannot guess input format"):
        list(read_passages([tmp_path / "x.csv"]))
    with pytest.raises(ValueError, match="no such file"):
        list(read_passages([tmp_path / "nope.jsonl"]))
    with pytest.raises(ValueError, match="unknown input format"):
        list(read_passages([tmp_path / "x.csv"], input_format="parquet"))


def test_non_utf8_is_a_clear_error(tmp_path: Path) -> None:
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(b'{"id": "a", "title": "t", "text": "ok"}\n{"id": "b", "title": "\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1\.jsonl:2: not UTF-8"):
        list(read_passages([p]))
