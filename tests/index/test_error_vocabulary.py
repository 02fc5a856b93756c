"""One error vocabulary in openbook.index (issue 44): a caller's mistake is an
:class:`openbook.errors.InvalidArgument` (a ``ValueError`` too, so ``except ValueError`` still
holds), which every boundary maps to INVALID_ARGUMENT / 4xx; an index directory that cannot be
served is an ``IndexLoadError`` (a ``ValueError``); a broken invariant of openbook's own code or
state is an :class:`openbook.errors.InternalError` (INTERNAL, a ``RuntimeError``). No module
of the package raises a bare ``ValueError``: each refusal says which of these it is."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from openbook.errors import InternalError, InvalidArgument, status_for
from openbook.index.fusion import Fusion
from openbook.index.join import join_slices
from openbook.index.milvus_engine import milvus_string
from openbook.index.passages import split_passages

INDEX = Path(__file__).resolve().parents[2] / "openbook" / "index"
MODULES = sorted(str(p.relative_to(INDEX)) for p in INDEX.rglob("*.py"))


def test_every_module_of_the_package_is_checked():
    # the modules the last round converted by hand, and those this one did, among them
    assert {"join.py", "wal.py", "milvus_engine.py", "stages.py", "live.py"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_invalid_input_is_an_invalid_argument_not_a_bare_value_error(module):
    tree = ast.parse((INDEX / module).read_text())
    bare = [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Raise)
        and isinstance(node.exc, ast.Call)
        and isinstance(node.exc.func, ast.Name)
        and node.exc.func.id == "ValueError"
    ]
    assert not bare, (
        f"{module}: raise InvalidArgument naming the field, or InternalError for a broken "
        f"invariant (lines {bare})"
    )


def test_the_library_entry_points_refuse_with_invalid_argument(tmp_path):
    with pytest.raises(InvalidArgument, match="max_words"):
        split_passages("t", "a b c", max_words=0)
    with pytest.raises(InvalidArgument, match="candidates"):
        Fusion.from_dict({"dense_weight": 1.0, "bm25_weight": 1.0, "candidates": 0})
    with pytest.raises(InvalidArgument, match="num-shards"):
        join_slices(tmp_path / "set", 0)
    with pytest.raises(InvalidArgument, match="missing: shard 0"):
        join_slices(tmp_path / "set", 1)  # nothing built yet
    with pytest.raises(InvalidArgument, match="U\\+0001"):
        milvus_string("a\x01b")
    # still a ValueError for the callers that catch one
    assert issubclass(InvalidArgument, ValueError)


def test_an_internal_error_is_internal_not_the_clients():
    assert status_for(InternalError("versions must grow")).name == "INTERNAL"
    assert status_for(InvalidArgument("k")).name == "INVALID_ARGUMENT"
    assert not issubclass(InternalError, ValueError)  # never caught as a client's mistake
