"""Documents of a live index: validation naming the field, the paper's passages, ids."""

from __future__ import annotations

import pytest

from openbook.errors import InvalidArgument
from openbook.index.documents import Document, document_id_of
from openbook.validation.limits import (
    MAX_DOCUMENT_ID_CHARS,
    MAX_DOCUMENT_TEXT_CHARS,
    MAX_METADATA_KEYS,
)


def test_passages_keep_the_title_and_derive_ids() -> None:
    text = " ".join(f"word{i}" for i in range(250))
    doc = Document.create("guide", "A Guide", text, {"lang": "en", "year": 2024})
    passages = doc.passages(100)
    assert [p.id for p in passages] == ["guide#0", "guide#1", "guide#2"]
    assert all(p.title == "A Guide" for p in passages)
    assert [len(p.text.split()) for p in passages] == [100, 100, 50]
    assert " ".join(p.text for p in passages) == text


def test_document_of_a_passage_id() -> None:
    assert document_id_of("guide#2") == "guide"
    assert document_id_of("a#b#10") == "a#b"
    assert document_id_of("p00") == "p00"
    assert document_id_of("x#y") == "x#y"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"id": ""}, "id"),
        ({"id": "a/b"}, "id"),
        ({"id": "x" * (MAX_DOCUMENT_ID_CHARS + 1)}, "id"),
        ({"id": "a\x00b"}, "id"),
        ({"text": ""}, "text"),
        ({"text": "   \n\t "}, "text"),
        ({"text": "w " * (MAX_DOCUMENT_TEXT_CHARS // 2 + 1)}, "text"),
        ({"title": 3}, "title"),
        ({"metadata": {"tags": ["a", "b"]}}, "metadata.tags"),
        ({"metadata": {"nested": {"a": 1}}}, "metadata.nested"),
        ({"metadata": {"score": float("nan")}}, "metadata.score"),
        ({"metadata": {f"k{i}": i for i in range(MAX_METADATA_KEYS + 1)}}, "metadata"),
        ({"metadata": ["not", "a", "map"]}, "metadata"),
    ],
)
def test_bad_documents_name_the_field(kwargs: dict, field: str) -> None:
    args = {"id": "doc", "title": "T", "text": "some words", "metadata": {}} | kwargs
    with pytest.raises(InvalidArgument) as err:
        Document.create(args["id"], args["title"], args["text"], args["metadata"])
    assert str(err.value).startswith(field), str(err.value)


def test_batch_field_prefix_and_round_trip() -> None:
    with pytest.raises(InvalidArgument, match=r"^documents\[2\]\.id"):
        Document.create("a/b", "T", "text", field="documents[2]")
    doc = Document.create("d", "T", "text here", {"a": 1, "b": None, "c": True, "d": 1.5})
    assert Document.from_dict(doc.to_dict()) == doc
    with pytest.raises(InvalidArgument, match="^text is required"):
        Document.from_dict({"id": "d", "title": "T"})
