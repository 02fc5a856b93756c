"""Request validation."""

from __future__ import annotations

import pytest

from openbook.rag import DecodingOptions, InvalidRequest
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
    ],
)
def test_invalid_options(dirs, load, changes, field):
    opts = DecodingOptions(**changes)
    with pytest.raises(InvalidRequest, match=field):
        opts.validate()
    with pytest.raises(InvalidRequest, match=field):
        load(dirs.bart(0)).generate(QUESTION, make_passages(2), opts)


def test_invalid_request_is_value_error():
    assert issubclass(InvalidRequest, ValueError)


def test_valid_edges():
    DecodingOptions(
        num_beams=16, num_return_sequences=16, max_new_tokens=512, min_new_tokens=512
    ).validate()
    for mode in ("rag-token", "rag-sequence-thorough", "rag-sequence-fast"):
        DecodingOptions(mode=mode).validate()


def test_empty_passages_and_question(dirs, load):
    gen = load(dirs.bart(0))
    with pytest.raises(InvalidRequest, match="passages"):
        gen.generate(QUESTION, [], DecodingOptions())
    with pytest.raises(InvalidRequest, match="question"):
        gen.generate("  ", make_passages(1), DecodingOptions())
    bad = make_passages(2)
    bad[1].score = float("inf")
    with pytest.raises(InvalidRequest, match=r"passages\[1\].score"):
        gen.generate(QUESTION, bad, DecodingOptions())
