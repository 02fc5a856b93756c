"""Opening stored ``.npy`` arrays from several threads at once, one header at a time.

NumPy reads a ``.npy`` header with :func:`ast.literal_eval`, and CPython 3.11 keeps the AST
builder's recursion depth in state the whole interpreter shares: two threads building ASTs at
the same moment can fail one of them with ``SystemError: AST constructor recursion depth
mismatch`` (python/cpython#106905 and the reports linked there). An index opens arrays from
several threads — a document write re-opening its segment's BM25 and vectors while a
compaction reads the base's — so every opening of a stored array in :mod:`openbook.index`
holds :data:`OPENING` (a memory-mapped open reads only the header: the lock is held for
microseconds). Libraries that call ``np.load`` themselves (``bm25s``) are opened under
:func:`opening`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

OPENING = threading.Lock()


@contextmanager
def opening() -> Iterator[None]:
    """Hold the lock every opening of a stored array holds (for a library's own ``np.load``)."""
    with OPENING:
        yield


def open_array(path: Path | str) -> np.ndarray:
    """The array stored at ``path``, memory-mapped read-only."""
    with OPENING:
        return np.load(path, mmap_mode="r")
