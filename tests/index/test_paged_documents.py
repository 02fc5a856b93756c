"""A paged document (an uploaded PDF's ``page_words`` metadata, issue 33) is split page by page:
no passage spans two pages, and each passage's page follows from the metadata alone."""

from __future__ import annotations

import pytest

from openbook.errors import InvalidArgument
from openbook.index.documents import Document, passage_number, passage_page


def _paged(words_per_page: list[int]) -> Document:
    pages = [
        " ".join(f"p{n}w{i}" for i in range(count)) for n, count in enumerate(words_per_page, 1)
    ]
    return Document.create(
        "report",
        "Report",
        "\n\n".join(page for page in pages if page),
        {"page_words": ",".join(map(str, words_per_page))},
    )


def test_passages_restart_at_each_page_and_know_their_page():
    doc = _paged([5, 0, 12, 3])  # an empty second page, a third longer than a passage
    passages = doc.passages(max_words=10)
    assert [len(p.text.split()) for p in passages] == [5, 10, 2, 3]
    for n, passage in enumerate(passages):
        page = passage_page(doc.metadata, n, 10)
        assert {word.split("w")[0] for word in passage.text.split()} == {f"p{page}"}
        assert passage_number(passage.id) == n
    assert [passage_page(doc.metadata, n, 10) for n in range(5)] == [1, 3, 3, 4, None]
    assert passage_page({}, 0, 10) is None  # a document without pages


@pytest.mark.parametrize(
    ("value", "message"),
    [("5,x", "comma-separated"), ("5,3", "add up to the text's 9 words"), ("", "comma-separated")],
)
def test_a_bad_page_map_is_refused_naming_it(value, message):
    with pytest.raises(InvalidArgument, match=rf"^metadata\.page_words .*{message}"):
        Document.create("d", "", " ".join(["w"] * 9), {"page_words": value})
