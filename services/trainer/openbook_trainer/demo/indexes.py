"""Build the demo indexes (``wiki-2016``, ``wiki-2018`` and their BM25 variants).

``wiki-<year>`` = the SQuAD paragraphs + the leaders passages of that snapshot, split into
100-word passages by ``openbook.index.build_index``; dense ones use the default encoder
(all-MiniLM-L6-v2) with a flat inner-product index.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path

from openbook_trainer.demo.data import DEMO_SNAPSHOTS, Snapshot, missing_files


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def index_is_complete(path: Path, snapshot: Snapshot) -> bool:
    """True if ``path`` opens as a valid index of the snapshot's name and type."""
    from openbook.index import open_index

    if not path.is_dir():
        return False
    try:
        loaded = open_index(path)
    except Exception:  # any failure to open means: rebuild it
        return False
    manifest = loaded.manifest
    return manifest.name == snapshot.name and manifest.index_type == snapshot.index_type


def prepare_demo_indexes(
    index_root: Path,
    data_dir: Path,
    progress: bool = True,
    *,
    names: Iterable[str] | None = None,
    encoder: str | None = None,
) -> list[str]:
    """Build the demo indexes missing under ``index_root/<name>/``; return the names built.

    Complete indexes are skipped; an incomplete or corrupt one is rebuilt. ``names`` restricts
    the set (default: all four), ``encoder`` overrides the default dense encoder.
    """
    from openbook.index import build_index

    wanted = set(names) if names is not None else None
    snapshots = [s for s in DEMO_SNAPSHOTS if wanted is None or s.name in wanted]
    if wanted is not None and (unknown := wanted - {s.name for s in snapshots}):
        raise ValueError(f"unknown demo index(es): {sorted(unknown)}")
    index_root = Path(index_root)
    data_dir = Path(data_dir)
    built: list[str] = []
    for snap in snapshots:
        out_dir = index_root / snap.name
        if index_is_complete(out_dir, snap):
            _log(progress, f"index {snap.name}: already built at {out_dir}")
            continue
        if missing := missing_files(data_dir, snap.inputs):
            raise FileNotFoundError(f"demo data missing: {', '.join(map(str, missing))}")
        kind = "BM25" if snap.index_type == "bm25" else f"dense ({snap.index_type})"
        _log(progress, f"index {snap.name}: building {kind} into {out_dir}")
        start = time.monotonic()
        kwargs = {"encoder": encoder} if encoder and snap.index_type != "bm25" else {}
        manifest = build_index(
            [data_dir / f for f in snap.inputs],
            out_dir,
            name=snap.name,
            index_type=snap.index_type,
            input_format="auto",
            progress=progress,
            overwrite=out_dir.exists(),
            **kwargs,
        )
        _log(
            progress,
            f"index {snap.name}: {manifest.count} passages in {time.monotonic() - start:.0f} s",
        )
        built.append(snap.name)
    return built
