"""manifest.json: what an index is, how it was built, and checksums of every file in it.

Shared: the write side writes it, the read side verifies it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openbook.index.fusion import Fusion
from openbook.storage.artifacts import checksum_files, replace_file

FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class IndexLoadError(ValueError):
    """An index directory is missing, incomplete, corrupted or inconsistent."""


@dataclass
class Manifest:
    name: str
    encoder: str | None  # None for bm25
    query_encoder: str | None
    dim: int  # 0 for bm25
    count: int
    index_type: str
    index_params: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # relative path -> sha256
    sizes: dict[str, int] = field(default_factory=dict)  # relative path -> bytes
    checksum: str = ""  # sha256 over the sorted (path, sha256) pairs
    normalize: bool = False
    # Scores returned are score_scale x inner product: the generator's document prior is
    # softmax(scores), and cosine similarities (normalised encoders) are too close together for
    # a useful prior without a scale (see vectors.default_score_scale). Absent in older manifests.
    score_scale: float = 1.0
    build_seconds: float = 0.0
    created_at: str = ""
    input_format: str = "auto"
    max_words: int = 100
    format_version: int = FORMAT_VERSION
    # Set on shards written by ``split_index``; absent (None) for an unsharded index:
    # {"index": i, "count": n_shards, "row_offset": first parent row, "parent_count": rows in
    #  the parent, "parent_checksum": the parent manifest's checksum}. A slice of a parallel
    # build (``parallel.build_slice``) has no parent index: its ``parent_checksum`` is the
    # sha256 of ``build``, the identity of the whole logical index, which it carries too.
    # A live shard's compacted base (``compaction.build_base``) adds "live_version": the write
    # it holds up to; its rows are its own then (``row_offset``/``parent_count`` describe the
    # shard as it was split, no longer its rows).
    shard: dict[str, Any] | None = None
    # The retrieval views the directory holds (``VIEWS`` order): ("dense",), ("bm25",) or
    # ("dense", "bm25") for a dense index that carries a BM25 view of the same passages in
    # ``bm25/`` (hybrid retrieval, ``fusion.py``). Absent in older manifests: derived from
    # ``index_type`` (see ``default_views``), so they load unchanged.
    views: list[str] = field(default_factory=list)
    # The fitted hybrid fusion (``fusion.Fusion.to_dict``): weights, candidates, what it was
    # fitted on. None: not fitted (an index with both views then uses ``Fusion.default``).
    fusion: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.views:
            self.views = default_views(self.index_type)

    @property
    def dense(self) -> bool:
        return self.index_type != "bm25"

    @property
    def default_retrieval(self) -> str:
        """What a request naming no ``retrieval`` gets: "hybrid" where both views exist, except
        on an index encoded by a DPR or RAG checkpoint, which gets the paper's retriever, dense
        (Lewis et al. retrieve by MIPS alone: serving facebook/rag-*-nq any other way changes its
        passages and answers); such an index serves hybrid only when a request asks for it.
        With one view, that view."""
        if len(self.views) == 1:
            return self.views[0]
        if any(is_dpr_checkpoint(e) for e in (self.query_encoder, self.encoder) if e):
            return "dense"
        return "hybrid"

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if data["shard"] is None:
            del data["shard"]  # unsharded manifests stay as they were before sharding existed
        if data["fusion"] is None:
            del data["fusion"]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    def to_file(self, path: Path) -> None:
        """Write (or atomically replace) ``path``; a new index is published with its manifest
        by :func:`openbook.storage.artifacts.publish` instead."""
        replace_file(Path(path), self.to_json())

    @classmethod
    def from_file(cls, path: Path) -> Manifest:
        path = Path(path)
        if not path.is_file():
            raise IndexLoadError(f"{path.parent}: {MANIFEST} missing")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise IndexLoadError(f"{path}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise IndexLoadError(f"{path}: expected a JSON object")
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise IndexLoadError(
                f"{path}: format_version {version!r} not supported (expected {FORMAT_VERSION})"
            )
        known = {f.name for f in dataclasses.fields(cls)}
        required = {
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - data.keys())
        if missing:
            raise IndexLoadError(f"{path}: missing field(s) {', '.join(missing)}")
        _check_shard(path, data.get("shard"), data["count"])
        if problem := score_scale_problem(data.get("score_scale", 1.0)):
            raise IndexLoadError(f"{path}: {problem}")
        if problem := views_problem(data.get("views"), data["index_type"]):
            raise IndexLoadError(f"{path}: {problem}")
        if data.get("fusion") is not None:
            try:
                Fusion.from_dict(data["fusion"])
            except ValueError as e:
                raise IndexLoadError(f"{path}: fusion: {e}") from None
        return cls(**{k: v for k, v in data.items() if k in known})


VIEWS = ("dense", "bm25")


@functools.lru_cache(maxsize=256)
def is_dpr_checkpoint(name_or_path: str) -> bool:
    """Whether ``name_or_path`` is a local DPR or RAG checkpoint (its config's ``model_type``):
    the paper's encoders, whose roles (question / context) and retrieval (dense MIPS) are fixed."""
    config = Path(name_or_path).expanduser() / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") in ("dpr", "rag")
    except (OSError, ValueError, AttributeError):
        return False


def default_views(index_type: str) -> list[str]:
    """The views of a manifest that records none (written before hybrid indexes existed)."""
    return ["bm25"] if index_type == "bm25" else ["dense"]


def views_problem(views: Any, index_type: Any) -> str | None:
    """Why ``views`` cannot be the views of an ``index_type`` index, or None (absent: ok)."""
    if views is None:
        return None
    dense = index_type != "bm25"
    allowed = ([["dense"], ["dense", "bm25"]]) if dense else [["bm25"]]
    if views not in allowed:
        return f"views {views!r} do not fit index_type {index_type!r}; expected one of {allowed}"
    return None


def score_scale_problem(value: Any) -> str | None:
    """Why ``value`` cannot be a manifest's ``score_scale`` (a finite number > 0), or None."""
    if type(value) in (int, float) and math.isfinite(value) and value > 0:
        return None
    return f"score_scale must be a positive number, got {value!r}"


_SHARD_INTS = ("index", "count", "row_offset", "parent_count")


def _check_shard(path: Path, shard: Any, count: Any) -> None:
    if shard is None:
        return
    ok = (
        isinstance(shard, dict)
        and all(type(shard.get(k)) is int for k in _SHARD_INTS)
        and isinstance(shard.get("parent_checksum"), str)
        and 0 <= shard["index"] < shard["count"]
        and type(count) is int
        and 0 <= shard["row_offset"] <= shard["parent_count"]
        and (
            shard["row_offset"] + count <= shard["parent_count"]
            if "live_version" not in shard
            else type(shard["live_version"]) is int and shard["live_version"] >= 0
        )
    )
    if not ok:
        raise IndexLoadError(f"{path}: invalid shard field {shard!r}")


def combined_checksum(files: dict[str, str]) -> str:
    h = hashlib.sha256()
    for rel in sorted(files):
        h.update(f"{rel}\0{files[rel]}\n".encode())
    return h.hexdigest()


def checksum_fields(root: Path) -> dict[str, Any]:
    """The manifest fields that checksum the files under ``root`` (the manifest itself left
    out): ``files`` (sha256), ``sizes`` and their ``checksum``."""
    digests = checksum_files(root, exclude={MANIFEST})
    files = {rel: d.sha256 for rel, d in digests.items()}
    return {
        "files": files,
        "sizes": {rel: d.size for rel, d in digests.items()},
        "checksum": combined_checksum(files),
    }
