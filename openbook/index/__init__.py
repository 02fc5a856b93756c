"""Passage indexes for the RAG retriever: reading corpora, encoders, building and searching.

Dense indexes (flat / hnsw / hnsw-sq8 / ivfpq on faiss) score by inner product, as DPR/RAG do;
"bm25" is the paper's sparse ablation. See ``build_index``, ``import_embeddings`` (precomputed
vectors), ``open_index`` and ``split_index``.

Names are imported on first use (PEP 562): the gateway imports ``openbook.index.shard`` for
``merge_results`` and should not load torch, faiss and bm25s to get it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from openbook.index.build import INDEX_TYPES, build_index
    from openbook.index.encoders import (
        DEFAULT_ENCODER,
        Encoder,
        clear_encoder_cache,
        load_encoder,
    )
    from openbook.index.importer import import_embeddings
    from openbook.index.loaded import LoadedIndex, open_index
    from openbook.index.manifest import IndexLoadError, Manifest
    from openbook.index.passages import read_passages, split_passages
    from openbook.index.shard import merge_results, split_index

    IndexError_ = IndexLoadError

_EXPORTS = {
    "INDEX_TYPES": "build",
    "build_index": "build",
    "DEFAULT_ENCODER": "encoders",
    "Encoder": "encoders",
    "clear_encoder_cache": "encoders",
    "load_encoder": "encoders",
    "import_embeddings": "importer",
    "LoadedIndex": "loaded",
    "open_index": "loaded",
    "IndexLoadError": "manifest",
    "Manifest": "manifest",
    "read_passages": "passages",
    "split_passages": "passages",
    "merge_results": "shard",
    "split_index": "shard",
}
_ALIASES = {"IndexError_": "IndexLoadError"}  # the name used in the original API sketch


__all__ = [  # a literal list, so linters see what the TYPE_CHECKING imports are for
    "DEFAULT_ENCODER",
    "INDEX_TYPES",
    "Encoder",
    "IndexError_",
    "IndexLoadError",
    "LoadedIndex",
    "Manifest",
    "build_index",
    "clear_encoder_cache",
    "import_embeddings",
    "load_encoder",
    "merge_results",
    "open_index",
    "read_passages",
    "split_index",
    "split_passages",
]


def __getattr__(name: str) -> Any:
    target = _ALIASES.get(name, name)
    module = _EXPORTS.get(target)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), target)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
