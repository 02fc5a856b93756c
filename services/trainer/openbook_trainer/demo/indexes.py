"""Build the demo indexes (``wiki-2016``, ``wiki-2018`` and their BM25 variants).

``wiki-<year>`` = the SQuAD paragraphs + the leaders passages of that snapshot, split into
100-word passages by ``openbook.index.build_index``; dense ones use the default encoder
(all-MiniLM-L6-v2) with a flat inner-product index and carry a BM25 view of the same passages
too, for hybrid retrieval (the default retrieval of such an index). Their fusion is fitted on
the SQuAD questions of the *training* articles only: the split of the fine-tuning experiment
(``experiments.finetune.split_by_article(questions, 10, seed 0)``), so the dev articles that
experiment and the demo evaluate on never inform the fused prior. ``wiki-<year>-bm25`` stay:
the RAG paper's BM25 ablation as an index of its own.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from openbook.index import (
    DEFAULT_ENCODER,
    build_index,
    fit_fusion,
    open_index,
    read_index_manifest,
    store_fusion,
)
from openbook.index.encoders import load_adapted_encoder
from openbook.index.fusion import read_questions
from openbook.index.spec import BuildOptions, IndexSpec
from openbook.rag.adapters import AdapterMismatch
from openbook_trainer.demo.data import DEMO_SNAPSHOTS, SQUAD_QUESTIONS, Snapshot, missing_files
from openbook_trainer.demo.models import DEFAULT_QUERY_ADAPTER
from openbook_trainer.experiments.finetune import split_by_article

# The fine-tuning experiment's split (experiments/finetune.py, FinetuneConfig's defaults).
FUSION_DEV_ARTICLES = 10
FUSION_SEED = 0


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def index_is_complete(path: Path, snapshot: Snapshot) -> bool:
    """True if ``path`` opens as a valid index of the snapshot's name and type."""
    if not path.is_dir():
        return False
    try:
        loaded = open_index(path)
    except Exception:  # any failure to open means: rebuild it
        return False
    manifest = loaded.manifest
    loaded.close()
    # A dense demo index built before hybrid retrieval has no bm25 view: rebuild it.
    views = ["bm25"] if snapshot.index_type == "bm25" else ["dense", "bm25"]
    return (
        manifest.name == snapshot.name
        and manifest.index_type == snapshot.index_type
        and manifest.views == views
    )


# (query encoder's name, question file's sha256) -> the questions' vectors: the demo's dense
# indexes share an encoder, so their fits encode the same questions once.
QuestionVectors = dict[tuple[str, str], np.ndarray]


def fit_demo_fusion(
    path: Path, data_dir: Path, question_vectors: QuestionVectors | None = None
) -> bool:
    """Fit the hybrid fusion of the dense demo index at ``path`` on the SQuAD questions of
    the training articles (module docstring) and record it in its manifest. False (nothing
    done) where the questions have too few articles to hold out the dev ones.
    ``question_vectors``: encodings of earlier fits, reused and added to."""
    questions = Path(data_dir) / SQUAD_QUESTIONS
    try:
        _, dev_titles = split_by_article(questions, FUSION_DEV_ARTICLES, FUSION_SEED)
    except ValueError:  # too few articles (a cut-down copy of the data)
        return False
    qs, sha = read_questions(questions, exclude_titles=dev_titles)
    with open_index(path, verify=False) as index:
        encoder = _served_query_encoder(index, Path(data_dir))
        served = encoder or index.query_encoder
        key = (served.name, sha)
        vectors = None if question_vectors is None else question_vectors.get(key)
        if vectors is None:
            vectors = served.encode([q.question for q in qs])
            if question_vectors is not None:
                question_vectors[key] = vectors
        fusion = fit_fusion(
            index,
            qs,
            encoder=encoder,
            source=f"{SQUAD_QUESTIONS} (training articles: split_by_article("
            f"{FUSION_DEV_ARTICLES}, seed {FUSION_SEED}))",
            sha256=sha,
            fitted_on={
                "excluded_titles": dev_titles,
                "query_encoder": (
                    f"adapters/{DEFAULT_QUERY_ADAPTER}"
                    if encoder is not None
                    else "the index's own"
                ),
            },
            query_vectors=vectors,
        )
    store_fusion(path, fusion)
    return True


def _served_query_encoder(index, data_dir: Path):
    """The query encoder the default stack searches this index with: the shipped query encoder
    adapter (compose's OPENBOOK_RETRIEVER_QUERY_ENCODER_ADAPTER default) where it is in the
    data and fits the index, else None (the index's own). The fusion's dense weight is fitted
    on the inner products of the encoder that will serve them."""
    adapter = data_dir / "adapters" / DEFAULT_QUERY_ADAPTER
    if not adapter.is_dir():
        return None
    try:
        encoder = load_adapted_encoder(adapter)
        index.check_encoder(encoder)
    except (AdapterMismatch, ValueError):
        return None
    return encoder


def _fusion_missing(path: Path, snapshot: Snapshot) -> bool:
    return snapshot.index_type != "bm25" and read_index_manifest(path).fusion is None


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
    wanted = set(names) if names is not None else None
    snapshots = [s for s in DEMO_SNAPSHOTS if wanted is None or s.name in wanted]
    if wanted is not None and (unknown := wanted - {s.name for s in snapshots}):
        raise ValueError(f"unknown demo index(es): {sorted(unknown)}")
    index_root = Path(index_root)
    data_dir = Path(data_dir)
    built: list[str] = []
    question_vectors: QuestionVectors = {}
    # The snapshots share most of their passages (the SQuAD paragraphs): each dense one takes
    # the vectors of those the others already hold instead of encoding them again.
    dense_dirs = [index_root / s.name for s in DEMO_SNAPSHOTS if s.index_type != "bm25"]
    for snap in snapshots:
        out_dir = index_root / snap.name
        if index_is_complete(out_dir, snap):
            _log(progress, f"index {snap.name}: already built at {out_dir}")
            if _fusion_missing(out_dir, snap):  # e.g. interrupted between build and fit
                _fit(out_dir, data_dir, snap, progress, question_vectors)
            continue
        if missing := missing_files(data_dir, snap.inputs):
            raise FileNotFoundError(f"demo data missing: {', '.join(map(str, missing))}")
        kind = "BM25" if snap.index_type == "bm25" else f"dense ({snap.index_type})"
        _log(progress, f"index {snap.name}: building {kind} into {out_dir}")
        start = time.monotonic()
        manifest = build_index(
            [data_dir / f for f in snap.inputs],
            out_dir,
            IndexSpec(
                name=snap.name,
                index_type=snap.index_type,
                encoder=encoder if encoder and snap.index_type != "bm25" else DEFAULT_ENCODER,
            ),
            BuildOptions(
                input_format="auto",
                progress=progress,
                overwrite=out_dir.exists(),
                reuse_vectors_from=tuple(d for d in dense_dirs if d != out_dir),
            ),
        )
        _log(
            progress,
            f"index {snap.name}: {manifest.count} passages in {time.monotonic() - start:.0f} s",
        )
        if snap.index_type != "bm25":
            _fit(out_dir, data_dir, snap, progress, question_vectors)
        built.append(snap.name)
    return built


def _fit(
    out_dir: Path,
    data_dir: Path,
    snap: Snapshot,
    progress: bool,
    question_vectors: QuestionVectors,
) -> None:
    if missing_files(data_dir, (SQUAD_QUESTIONS,)):
        _log(progress, f"index {snap.name}: no {SQUAD_QUESTIONS}; hybrid uses the default fusion")
        return
    if fit_demo_fusion(out_dir, data_dir, question_vectors):
        _log(progress, f"index {snap.name}: hybrid fusion fitted on the training articles")
    else:
        _log(progress, f"index {snap.name}: too few articles to fit; default fusion")
