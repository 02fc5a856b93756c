"""Passage indexes for the RAG retriever: reading corpora, encoders, building and searching.

Dense indexes (flat / hnsw / hnsw-sq8 / ivfpq on faiss) score by inner product, as DPR/RAG do;
"bm25" is the paper's sparse ablation; a dense index also carries a BM25 view of its passages for
hybrid retrieval (``fusion.py``). Write side: an ``IndexSpec`` (what the index is) and
``BuildOptions`` (how a run builds it) given to ``build_index``, ``import_embeddings``
(precomputed vectors), ``split_index``, and ``build_slice`` / ``join_slices`` (one index built as
N slices in parallel). Read side: ``open_index``. README.md lists which module is which. Needs
``openbook[index]`` (torch, faiss, bm25s).
"""

from __future__ import annotations

from openbook.index.build import build_index
from openbook.index.encoders import DEFAULT_ENCODER, Encoder, clear_encoder_cache, load_encoder
from openbook.index.fusion import RETRIEVAL_MODES, Fusion, fit_fusion, store_fusion
from openbook.index.importer import import_embeddings
from openbook.index.join import install_shards, join_slices, merge_slices
from openbook.index.loaded import (
    LoadedIndex,
    check_index,
    check_index_files,
    open_index,
    read_index_manifest,
)
from openbook.index.manifest import IndexLoadError, Manifest
from openbook.index.parallel import IndexSet, build_slice, read_index_set
from openbook.index.passages import read_passages, split_passages
from openbook.index.shard import split_index
from openbook.index.spec import INDEX_TYPES, AnnParams, BuildOptions, IndexSpec

__all__ = [
    "AnnParams",
    "BuildOptions",
    "IndexSpec",
    "DEFAULT_ENCODER",
    "INDEX_TYPES",
    "RETRIEVAL_MODES",
    "Encoder",
    "Fusion",
    "IndexLoadError",
    "IndexSet",
    "LoadedIndex",
    "Manifest",
    "build_index",
    "build_slice",
    "check_index",
    "check_index_files",
    "clear_encoder_cache",
    "fit_fusion",
    "import_embeddings",
    "install_shards",
    "join_slices",
    "load_encoder",
    "merge_slices",
    "open_index",
    "read_index_manifest",
    "read_index_set",
    "read_passages",
    "split_index",
    "split_passages",
    "store_fusion",
]
