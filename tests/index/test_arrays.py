"""Stored arrays are opened one header at a time (openbook/index/arrays.py): NumPy parses a
``.npy`` header with ``ast.literal_eval``, which CPython 3.11 cannot run in two threads at once
(a ``SystemError`` seen once in CI: a document write beside a compaction)."""

from __future__ import annotations

import ast
import threading
from pathlib import Path

import numpy as np

from openbook.index.arrays import OPENING, open_array, opening

INDEX = Path(__file__).resolve().parents[2] / "openbook" / "index"


def test_an_array_opens_memory_mapped_and_read_only(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(12, dtype=np.float32).reshape(3, 4))
    array = open_array(tmp_path / "a.npy")
    assert isinstance(array, np.memmap) and not array.flags.writeable
    assert array.shape == (3, 4) and float(array[2, 3]) == 11.0


def test_an_open_waits_while_another_thread_holds_the_lock(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(2))
    opened = threading.Event()

    def open_one() -> None:
        open_array(tmp_path / "a.npy")
        opened.set()

    with opening():
        thread = threading.Thread(target=open_one)
        thread.start()
        assert not opened.wait(0.2)  # held up by the library's open
    thread.join(5)
    assert opened.is_set() and not OPENING.locked()


def _calls(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            names.append(ast.unparse(node.func))
    return names


def test_no_module_of_the_index_opens_an_array_around_the_lock():
    """Every ``np.load`` of openbook/index is arrays.py's, every bm25s load is
    ``bm25.load_bm25``'s (which holds the lock)."""
    offenders = []
    for path in sorted(INDEX.glob("*.py")):
        calls = _calls(ast.parse(path.read_text(), str(path)))
        if path.name != "arrays.py" and any(c in ("np.load", "numpy.load") for c in calls):
            offenders.append(f"{path.name}: np.load")
        if path.name != "bm25.py" and "bm25s.BM25.load" in calls:
            offenders.append(f"{path.name}: bm25s.BM25.load")
    assert not offenders, offenders
    assert _calls(ast.parse((INDEX / "bm25.py").read_text())).count("bm25s.BM25.load") == 1
