"""One error vocabulary for invalid input in openbook.index (issue 44): a caller's mistake is an
:class:`openbook.errors.InvalidArgument` (a ``ValueError`` too, so ``except ValueError`` still
holds), which every boundary maps to INVALID_ARGUMENT / 4xx; a bare ``ValueError`` that escapes
is a bug (INTERNAL). The modules below raise no bare ``ValueError``. Not converted yet: joining
a parallel build's slices (join.py: mostly the state of the slices on disk), the write-ahead
log's records (wal.py), two internal invariants of stages.py, segment_bm25.py, and the Milvus
engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from openbook.errors import InvalidArgument
from openbook.index.fusion import Fusion
from openbook.index.passages import split_passages

INDEX = Path(__file__).resolve().parents[2] / "openbook" / "index"
CONVERTED = (
    "checkpoint.py",
    "embedding_files.py",
    "empty_base.py",
    "encoders.py",
    "engine.py",
    "faiss_index.py",
    "fusion.py",
    "importer.py",
    "live.py",
    "loaded.py",
    "parallel.py",
    "passages.py",
    "rag_encoder.py",
    "shard.py",
    "store.py",
    "vectors.py",
)


@pytest.mark.parametrize("module", CONVERTED)
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
    assert not bare, f"{module}: raise InvalidArgument naming the field (lines {bare})"


def test_the_library_entry_points_refuse_with_invalid_argument():
    with pytest.raises(InvalidArgument, match="max_words"):
        split_passages("t", "a b c", max_words=0)
    with pytest.raises(InvalidArgument, match="candidates"):
        Fusion.from_dict({"dense_weight": 1.0, "bm25_weight": 1.0, "candidates": 0})
    # still a ValueError for the callers that catch one
    assert issubclass(InvalidArgument, ValueError)
