"""What an index is (:class:`IndexSpec`) and how one run builds it (:class:`BuildOptions`).

Write side. Every way of writing an index (``build_index``, ``build_slice``,
``import_embeddings``, a merge of slices) takes one ``IndexSpec`` and one ``BuildOptions``
instead of two dozen keyword arguments.

Invariants:

* Both are frozen and validated once, in ``__post_init__``: an object that exists is valid,
  so nothing downstream re-checks it. A bad field raises
  :class:`openbook.errors.InvalidArgument` (a ``ValueError``) whose message starts with the
  field's name.
* The spec holds only what the published index records about itself (its manifest), so
  :meth:`IndexSpec.from_manifest` recovers it from an existing index: building the same
  passages with that spec gives an index with the same type, parameters, encoders, score
  scale, passage splitting and views. ``BuildOptions`` (batch size, device, precision, ...)
  change how fast a build runs, never what it builds (precision changes the vectors' low bits
  only).
* ``score_scale=None`` means "the encoder's default" (``vectors.default_score_scale``); a spec
  read from a manifest always has the recorded number.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openbook.errors import InvalidArgument
from openbook.index.encoders import DEFAULT_ENCODER, PRECISIONS
from openbook.index.faiss_index import COARSE_QUANTIZERS, DENSE_TYPES, HNSW_TRANSFORMS
from openbook.index.manifest import Manifest, score_scale_problem
from openbook.index.passages import FORMATS

INDEX_TYPES = (*DENSE_TYPES, "bm25")


def _at_least(field_name: str, value: Any, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise InvalidArgument(f"{field_name} must be an integer >= {minimum}, got {value!r}")


def _one_of(field_name: str, value: Any, choices: tuple[str, ...], what: str = "") -> None:
    """``value`` must be one of ``choices``; the error says it is an unknown ``what``."""
    if value not in choices:
        unknown = f"unknown {what} {value!r}" if what else f"unknown {value!r}"
        raise InvalidArgument(f"{field_name}: {unknown}; expected one of {choices}")


@dataclass(frozen=True)
class AnnParams:
    """The approximate-search parameters of a dense index (faiss). Each type reads its own:
    ``hnsw`` / ``hnsw-sq8`` the ``hnsw_*`` and ``ef_*`` ones, ``ivfpq`` ``nlist`` / ``pq_m`` /
    ``nprobe`` (None: chosen from the corpus size and dim) and ``coarse_quantizer`` (``flat``, or
    ``hnsw``: the centroids in an HNSW graph of ``hnsw_m`` / ``ef_construction``, searched with
    ``ef_search``: many lists at an affordable assignment), both ``rerank``; ``flat`` none."""

    hnsw_m: int = 32
    ef_construction: int = 128
    ef_search: int = 128
    hnsw_transform: str = "none"  # or "mips_to_l2" (faiss_index's docstring says why not)
    nlist: int | None = None
    pq_m: int | None = None
    nprobe: int = 16
    rerank: int = 0  # re-rank k*rerank candidates exactly; 0: off
    coarse_quantizer: str = "flat"  # ivfpq's list assignment: exact, or "hnsw" (faiss_index)

    def __post_init__(self) -> None:
        _at_least("hnsw_m", self.hnsw_m, 2)
        _at_least("ef_construction", self.ef_construction, 1)
        _at_least("ef_search", self.ef_search, 1)
        _one_of("hnsw_transform", self.hnsw_transform, HNSW_TRANSFORMS)
        if self.nlist is not None:
            _at_least("nlist", self.nlist, 1)
        if self.pq_m is not None:
            _at_least("pq_m", self.pq_m, 1)
        _at_least("nprobe", self.nprobe, 1)
        _at_least("rerank", self.rerank, 0)
        _one_of("coarse_quantizer", self.coarse_quantizer, COARSE_QUANTIZERS)

    @classmethod
    def from_index_params(cls, index_type: str, params: dict[str, Any]) -> AnnParams:
        """The parameters a manifest's ``index_params`` were built with. ``ivfpq`` keeps the
        ``nlist`` and ``pq_m`` it was trained with, whatever the size of the next corpus."""
        if index_type in ("hnsw", "hnsw-sq8"):
            return cls(
                hnsw_m=params.get("hnsw_m", 32),
                ef_construction=params.get("ef_construction", 128),
                ef_search=params.get("ef_search", 128),
                hnsw_transform=params.get("transform", "none"),
                rerank=params.get("rerank", 0),
            )
        if index_type == "ivfpq":
            coarse = params.get("coarse_quantizer", "flat")  # older manifests: flat
            graph = (
                {
                    "hnsw_m": params.get("hnsw_m", 32),
                    "ef_construction": params.get("ef_construction", 128),
                    "ef_search": params.get("ef_search", 128),
                }
                if coarse == "hnsw"
                else {}
            )
            return cls(
                nlist=params.get("nlist"),
                pq_m=params.get("pq_m"),
                nprobe=params.get("nprobe", 16),
                rerank=params.get("rerank", 0),
                coarse_quantizer=coarse,
                **graph,
            )
        return cls()  # flat and bm25 have no tunable parameters


@dataclass(frozen=True)
class IndexSpec:
    """What an index is: its name and type, the encoders of a dense index, how its scores are
    scaled, how passages are split, whether a dense index carries a BM25 view, and its
    approximate-search parameters (module docstring)."""

    name: str
    index_type: str = "flat"
    encoder: str = DEFAULT_ENCODER  # the document encoder (a dense index's)
    query_encoder: str | None = None  # None: the document encoder
    score_scale: float | None = None  # None: the encoder's default (20 cosine, else 1)
    max_words: int = 100  # words per passage when splitting longer texts
    bm25: bool = True  # a dense index also gets a BM25 view (hybrid retrieval)
    ann: AnnParams = field(default_factory=AnnParams)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise InvalidArgument("name: an index name must not be empty")
        _one_of("index_type", self.index_type, INDEX_TYPES, "index type")
        if not isinstance(self.encoder, str) or not self.encoder.strip():
            raise InvalidArgument("encoder: name the document encoder")
        if self.query_encoder is not None and (
            not isinstance(self.query_encoder, str) or not self.query_encoder.strip()
        ):
            raise InvalidArgument("query_encoder: empty (None means the document encoder)")
        if self.score_scale is not None and (problem := score_scale_problem(self.score_scale)):
            raise InvalidArgument(problem)  # starts with "score_scale"
        _at_least("max_words", self.max_words, 1)
        if not isinstance(self.bm25, bool):
            raise InvalidArgument(f"bm25 must be true or false, got {self.bm25!r}")
        if not isinstance(self.ann, AnnParams):
            raise InvalidArgument(f"ann must be an AnnParams, got {type(self.ann).__name__}")
        if self.ann.coarse_quantizer != "flat" and self.index_type != "ivfpq":
            raise InvalidArgument(
                f"coarse_quantizer: {self.ann.coarse_quantizer!r} is an ivfpq option; a "
                f"{self.index_type} index has no inverted lists"
            )

    @property
    def dense(self) -> bool:
        return self.index_type != "bm25"

    @property
    def views(self) -> list[str]:
        """The manifest's ``views`` of an index built from this spec."""
        if not self.dense:
            return ["bm25"]
        return ["dense", "bm25"] if self.bm25 else ["dense"]

    @classmethod
    def from_manifest(cls, manifest: Manifest) -> IndexSpec:
        """The spec of the index ``manifest`` describes (e.g. to build another one like it).

        A bm25 index records no encoder: its spec has the default one, which it never uses.
        """
        query_encoder = manifest.query_encoder
        if query_encoder == manifest.encoder:
            query_encoder = None
        return cls(
            name=manifest.name,
            index_type=manifest.index_type,
            encoder=manifest.encoder or DEFAULT_ENCODER,
            query_encoder=query_encoder,
            score_scale=float(manifest.score_scale),
            max_words=manifest.max_words,
            bm25="bm25" in manifest.views,
            ann=AnnParams.from_index_params(manifest.index_type, manifest.index_params),
        )


@dataclass(frozen=True)
class BuildOptions:
    """How one run builds an index: none of it is recorded as part of what the index is,
    except ``input_format`` (which the manifest notes for reference)."""

    batch_size: int = 64  # passages per encoder batch (an import: vectors read at a time)
    shard_size: int = 50_000  # passages per resumable embedding shard
    device: str | None = None  # where the document encoder runs; None: the CPU
    precision: str = "auto"  # encoders.resolve_precision: float32 on CPU, bf16/fp16 on CUDA
    progress: bool = True  # progress bars
    overwrite: bool = False  # replace an existing index at the output directory
    input_format: str = "auto"  # passages.FORMATS
    # Dense indexes of the same document encoder whose vectors are taken for identical
    # passages instead of encoding them again (vectors.VectorDonors checks they still match).
    reuse_vectors_from: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        _at_least("batch_size", self.batch_size, 1)
        _at_least("shard_size", self.shard_size, 1)
        if self.device is not None and (not isinstance(self.device, str) or not self.device):
            raise InvalidArgument(f"device must be a device name or None, got {self.device!r}")
        _one_of("precision", self.precision, PRECISIONS, "precision")
        _one_of("input_format", self.input_format, FORMATS, "input format")
