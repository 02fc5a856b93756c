"""Request validation."""

from __future__ import annotations

import pytest

from openbook.errors import InvalidArgument
from openbook.rag import DecodingOptions
from openbook_testkit.rag import QUESTION, make_passages


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_beams": 0}, "num_beams must be in \\[1, 16\\], got 0"),
        ({"num_beams": 17}, "num_beams"),
        ({"num_beams": 2.0}, "num_beams"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"max_new_tokens": 513}, "max_new_tokens"),
        ({"min_new_tokens": -1}, "min_new_tokens"),
        ({"min_new_tokens": 33}, "min_new_tokens must be in \\[0, 32\\]"),
        ({"num_return_sequences": 2}, "num_return_sequences must be in \\[1, 1\\]"),
        ({"num_return_sequences": 0, "num_beams": 4}, "num_return_sequences"),
        ({"mode": "rag-magic"}, "mode"),
        ({"length_penalty": float("nan")}, "length_penalty"),
        ({"length_penalty": 10.5}, "length_penalty"),
    ],
)
def test_invalid_options(dirs, load, changes, field):
    opts = DecodingOptions(**changes)
    with pytest.raises(InvalidArgument, match=field):
        opts.validate()
    with pytest.raises(InvalidArgument, match=field):
        load(dirs.bart(0)).generate(QUESTION, make_passages(2), opts)


def test_invalid_argument_is_value_error():
    assert issubclass(InvalidArgument, ValueError)


def test_valid_edges():
    DecodingOptions(
        num_beams=16, num_return_sequences=16, max_new_tokens=512, min_new_tokens=512
    ).validate()
    for mode in ("rag-token", "rag-sequence-thorough", "rag-sequence-fast"):
        DecodingOptions(mode=mode).validate()


def test_empty_passages_and_question(dirs, load):
    gen = load(dirs.bart(0))
    with pytest.raises(InvalidArgument, match="passages"):
        gen.generate(QUESTION, [], DecodingOptions())
    with pytest.raises(InvalidArgument, match="question"):
        gen.generate("  ", make_passages(1), DecodingOptions())
    bad = make_passages(2)
    bad[1].score = float("inf")
    with pytest.raises(InvalidArgument, match=r"passages\[1\].score"):
        gen.generate(QUESTION, bad, DecodingOptions())
