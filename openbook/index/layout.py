"""The files of an index directory, shared by the write side (which creates them) and the read
side (which opens them). One name per file, defined here only.

An index directory holds ``manifest.json`` (``manifest.MANIFEST``: what the index is, and the
sha256 of every other file), :data:`PASSAGES_FILE` (the passages, by row), a dense index's
:data:`VECTORS_FILE` (row r: passage r's float32 vector) and ``index.faiss``
(``faiss_index.INDEX_FILE``), and a BM25 view's ``bm25/`` (``bm25.BM25_DIR``). While it is
being built it lives in ``.<name>.partial`` (``openbook.storage.artifacts.partial_dir``) beside the
final directory, with the build's resumable state in :data:`BUILD_STATE_DIR` inside it; one
build at a time holds :func:`build_lock_path`.
"""

from __future__ import annotations

from pathlib import Path

PASSAGES_FILE = "passages.sqlite"
VECTORS_FILE = "vectors.npy"
# Scratch space inside the partial dir (fingerprint, stage markers, embedding shards), removed
# before the directory is published.
BUILD_STATE_DIR = "_build"


def build_lock_path(out_dir: Path) -> Path:
    """The lock file of builds into ``out_dir``: hidden, beside it (``.<name>.lock``)."""
    return out_dir.parent / f".{out_dir.name}.lock"
