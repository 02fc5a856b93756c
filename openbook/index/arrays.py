"""Opening stored ``.npy`` arrays: one header at a time, and with the file kept open for reads.

**One header at a time.** NumPy reads a ``.npy`` header with :func:`ast.literal_eval`, and
CPython 3.11 keeps the AST builder's recursion depth in state the whole interpreter shares: two
threads building ASTs at the same moment can fail one of them with ``SystemError: AST
constructor recursion depth mismatch`` (python/cpython#106905 and the reports linked there).
An index opens arrays from several threads — a document write re-opening its segment's BM25
and vectors while a compaction reads the base's — so every opening of a stored array in
:mod:`openbook.index` holds :data:`OPENING` (a memory-mapped open reads only the header: the
lock is held for microseconds). Libraries that call ``np.load`` themselves (``bm25s``) are
opened under :func:`opening`.

**The file kept open.** :func:`open_array` also opens the file itself and keeps the descriptor
as long as the map lives (:func:`file_of`): reading rows with ``pread``
(:func:`openbook.index.faiss_index.gather_rows`) must read the file the map was opened on,
which outlives its name — an index directory renamed or removed by a swap, an adoption or a
compaction while a search still holds the old view.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

OPENING = threading.Lock()
# The open descriptor of each map open_array made, closed when the map is collected.
_FILES: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()


@contextmanager
def opening() -> Iterator[None]:
    """Hold the lock every opening of a stored array holds (for a library's own ``np.load``)."""
    with OPENING:
        yield


def open_array(path: Path | str) -> np.ndarray:
    """The array stored at ``path``, memory-mapped read-only, its file kept open beside the
    map (:func:`file_of`)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        with OPENING:
            array = np.load(path, mmap_mode="r")
        mapped = getattr(array, "_mmap", None)
        # the same file as the descriptor's, unless the name was given to another between the
        # two opens (then the reads go through the map)
        if isinstance(mapped, mmap.mmap) and os.fstat(fd).st_ino == os.stat(path).st_ino:
            _FILES[mapped] = fd
            weakref.finalize(mapped, os.close, fd)
            fd = -1
    finally:
        if fd >= 0:
            os.close(fd)
    return array


def file_of(array: np.ndarray) -> tuple[int, int] | None:
    """``(descriptor, file position of the array's first byte)`` of an array :func:`open_array`
    mapped (or a view of one), None for any other array."""
    mapped = getattr(array, "_mmap", None)
    if not isinstance(array, np.memmap) or not isinstance(mapped, mmap.mmap):
        return None
    fd = _FILES.get(mapped)
    if fd is None:
        return None
    # np.memmap maps from its offset rounded down to the allocation granularity; a view keeps
    # its parent's offset and points further into the same map
    map_start = array.offset - array.offset % mmap.ALLOCATIONGRANULARITY
    base = np.frombuffer(mapped, dtype=np.uint8).ctypes.data
    return fd, map_start + (array.ctypes.data - base)
