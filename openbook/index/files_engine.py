"""The ``files`` engine: indexes as directories under the index root (the default engine).

Read side. A built index (``openbook index build``: FAISS + BM25 files, ``loaded.py``) is a
:class:`~openbook.index.engine.SearchableIndex`; a live one (``live.py``: a published base, a
write-ahead log and a document store) is a :class:`~openbook.index.engine.DocumentIndex`, and
the base of one created empty (``empty_base.py``) is searched as a built index is. This module
is the engine's registration: the assignments below are the conformance mypy checks, so a
change to either protocol or to these classes that breaks it fails ``make lint``.
"""

from __future__ import annotations

from openbook.index.empty_base import EmptyBase
from openbook.index.engine import DocumentIndex, EngineKind, SearchableIndex
from openbook.index.live import LiveIndex
from openbook.index.loaded import LoadedIndex

KIND = EngineKind.FILES

# Conformance, checked statically (mypy) and at import (the names exist).
BUILT: type[SearchableIndex] = LoadedIndex
EMPTY_BASE: type[SearchableIndex] = EmptyBase
LIVE: type[DocumentIndex] = LiveIndex

__all__ = ["BUILT", "EMPTY_BASE", "KIND", "LIVE"]
