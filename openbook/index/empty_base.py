"""The base of a live index created empty: no passages yet, only what its first base will be.

An index cannot be built over no passages, so a live index created empty (the issue's
``POST /indexes``) has a *template* instead of a published base: a manifest (``template.json``
in the live index directory) with the type, encoders, dimension, score scale, views and fusion
its bases will have, and a count of 0. :class:`EmptyBase` answers the read API a live index
uses of its base as an index of that template with no passages would: every search finds
nothing, so the write segment alone is searched. The first compaction builds ``base-<v>`` from
the template; from then on the template is unused.

Invariants: ``len()`` is 0 and no method returns a passage; ``manifest.count`` is 0 and
``manifest.files`` is empty (nothing to verify).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from openbook.errors import InvalidArgument
from openbook.index.encoders import Encoder
from openbook.index.fusion import Candidates
from openbook.index.loaded import ManifestFacts
from openbook.index.manifest import Manifest
from openbook.index.request import SearchRequest
from openbook.index.spec import IndexSpec
from openbook.index.stages import BM25_PARAMS
from openbook.index.vectors import default_score_scale
from openbook.types import Passage

TEMPLATE_FILE = "template.json"


def template_of(like: Manifest, *, name: str, index_type: str | None = None) -> Manifest:
    """The template of an empty index like the index whose manifest is ``like`` (its
    encoders, dimension, score scale and views), of ``index_type`` (default: ``like``'s)."""
    same_type = index_type is None or index_type == like.index_type
    new_type = like.index_type if index_type is None else index_type
    if not same_type and (new_type == "bm25") != (like.index_type == "bm25"):
        raise InvalidArgument(
            f"index_type {new_type!r}: an index like {like.name!r} ({like.index_type}) "
            "must be dense too, or bm25 too"
        )
    return dataclasses.replace(
        like,
        name=name,
        count=0,
        index_type=new_type,
        index_params=dict(like.index_params) if same_type else {},
        files={},
        sizes={},
        checksum="",
        build_seconds=0.0,
        shard=None,
    )


def template_for(spec: IndexSpec, encoder: Encoder | None) -> Manifest:
    """The template of an empty index of ``spec`` (like no other index): the manifest
    ``build_index`` would write for it, but of count 0 and no files. ``encoder``: the spec's
    document encoder, loaded (its recorded name, dimension and normalisation); None for bm25."""
    if spec.dense and encoder is None:
        raise InvalidArgument(f"index_type {spec.index_type!r} needs its document encoder")
    dense = encoder if spec.dense else None
    scale = spec.score_scale if spec.score_scale is not None else default_score_scale(dense)
    return Manifest(
        name=spec.name,
        encoder=dense.name if dense else None,
        query_encoder=(spec.query_encoder or dense.name) if dense else None,
        dim=dense.dim if dense else 0,
        count=0,
        index_type=spec.index_type,
        index_params={} if dense else dict(BM25_PARAMS),
        normalize=bool(dense.normalize) if dense else False,
        score_scale=float(scale),
        max_words=spec.max_words,
        views=spec.views,
    )


class EmptyBase(ManifestFacts):
    """A base with no passages (module docstring), searched as a ``LoadedIndex`` is."""

    def __init__(self, path: Path, manifest: Manifest, *, name: str) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self.name = name
        self._encoder: Encoder | None = None
        self._encoder_lock = threading.Lock()

    def __len__(self) -> int:
        return 0

    def search(
        self,
        request: SearchRequest,
        encoder: Encoder | None = None,
        *,
        allowed: np.ndarray | None = None,
    ) -> list[list[Passage]]:
        """No passages for each query, once ``request`` is checked as a base would check it."""
        request.mode_on(self, encoder)
        return [[] for _ in range(request.n)]

    def hybrid_candidates(
        self,
        queries: Sequence[str],
        n: int,
        encoder: Encoder | None = None,
        *,
        query_vectors: np.ndarray | None = None,
        allowed: np.ndarray | None = None,
    ) -> Candidates:
        return self.no_candidates(len(queries))

    @staticmethod
    def no_candidates(queries: int) -> Candidates:
        """Candidates of ``queries`` queries with none found (no rows to search)."""
        shape = (queries, 0)
        return Candidates(
            np.zeros(shape, np.int64), np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        )

    def get_passages(self, row_ids: Sequence[int]) -> list[Passage]:
        if len(row_ids):
            raise IndexError(f"index {self.name!r} has no passages yet")
        return []

    def get_vectors(self, row_ids: Sequence[int]) -> np.ndarray:
        if len(row_ids):
            raise IndexError(f"index {self.name!r} has no passages yet")
        return np.zeros((0, self.manifest.dim), np.float32)

    def close(self) -> None:
        self._encoder = None
