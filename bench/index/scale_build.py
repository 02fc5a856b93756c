"""Build the scale benchmark's sharded, compressed files index from streamed synthetic vectors.

Each shard is a complete directory in the project's files-index format, exactly what
``openbook index shard`` writes (``openbook/index/shard.py``): ``passages.sqlite``,
``vectors.npy`` (float32, memory-mapped by the retriever, read only to re-rank candidates),
``index.faiss`` and ``manifest.json`` with checksums and the ``shard`` record, published
atomically (``openbook.storage.artifacts.publish``) at ``<run>/index/shard-<i>/<name>``, so a
retriever serves it with ``OPENBOOK_INDEX_ROOT=<run>/index/shard-<i>``. ``split_index`` cannot be
used as is: it splits a parent index whose ``vectors.npy`` would hold all 21M vectors (64.5 GB) next
to the shards' copies, twice the disk this machine has. Instead the parent's step is done once,
as ``split_index`` does it: one IVF-PQ quantizer trained (``faiss_index.build_faiss`` on a
sample of the corpus, then emptied) and reused by every shard, so each vector gets the code,
hence the score, it would have in an unsharded index, and every shard probes the same lists.

Passages are tiny (``p<row>`` / ``passage <row>``): disk and memory are the vectors'.

Resume (a state file and the partial shard under ``<run>/``): rows are generated, written to
the partial shard's ``vectors.npy``, added to its faiss index and folded into the exact top-k
(``scale_truth.RunningTopK``) in steps; after a step's vectors are flushed the ground-truth
state is saved with ``rows_done``. A resumed run re-adds the partial shard's rows already on
disk to a fresh clone of the trained quantizer (no generation, no exact search redone) and
continues; published shards are never touched again. The trained quantizer is saved once.
The run's configuration is recorded, and a resume with another one is refused.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import faiss
import numpy as np
from tqdm.auto import tqdm

from bench.index.scale_data import NOISE_RANK, SyntheticCorpus
from bench.index.scale_truth import RunningTopK
from openbook.index import faiss_index
from openbook.index.layout import PASSAGES_FILE, VECTORS_FILE
from openbook.index.manifest import MANIFEST, Manifest, checksum_fields
from openbook.index.shard import shard_spans
from openbook.index.spec import AnnParams
from openbook.index.store import PassageWriter
from openbook.storage.artifacts import publish, replace_file
from openbook.types import Passage

ENCODER = "synthetic-clustered-768"  # what the manifests name as encoder: no model exists
INDEX_NAME = "scale"
STEP_ROWS = 131_072  # rows generated, written and indexed at a time (~400 MB of float32)
SAVE_EVERY_S = 60.0  # how often the resume state is written during a shard
DISK_MARGIN = 4 << 30  # bytes left free for everyone else on the disk


@dataclass(frozen=True)
class ScaleConfig:
    """What a run builds and measures; recorded in its state, a resume must match it."""

    passages: int
    shards: int
    dim: int = 768
    seed: int = 0
    # nlist: with the exact ("flat") coarse quantizer the assignment costs passages x nlist x
    # dim multiply-adds, the build's largest term; faiss' usual 4 sqrt(N) (18k lists at 21M)
    # would take ~70x longer than 256 here (docs/benchmarks.md, "The paper's scale").
    # coarse_quantizer "hnsw" assigns through an HNSW graph of the centroids (hnsw_m, and
    # ef_search both for the assignment and as the probe's default), which makes thousands
    # of lists affordable (openbook/index/faiss_index.py).
    nlist: int = 256
    pq_m: int = 96
    nprobe: int = 8  # search-time: a finished build is re-measured at another nprobe/rerank
    rerank: int = 4
    train_size: int = 65_536  # 256 points per list: what faiss' k-means samples anyway
    queries: int = 256
    index_type: str = "ivfpq"  # or "flat": the exact source a Milvus copy is made from
    # vectors.npy's dtype. float32 is the product's layout; float16 halves the disk of a run
    # that would not fit beside everyone else's files (the loader checks the shape, not the
    # dtype; re-ranking reads either). The index, the re-ranking and the ground truth all see
    # the stored (rounded) vectors, so the benchmark stays self-consistent.
    vectors_dtype: str = "float32"
    coarse_quantizer: str = "flat"
    hnsw_m: int = 32
    ef_construction: int = 128
    ef_search: int = 128
    # the corpus's clusters (scale_data): fewer centres at a smaller N give each query's
    # cluster the size it has at a larger one (a 2M proxy of 21M: 390 centres)
    n_centres: int = 4096

    def __post_init__(self) -> None:
        if self.passages < 1 or self.shards < 1 or self.shards > self.passages:
            raise ValueError("passages: need at least one passage per shard")
        if self.index_type not in ("ivfpq", "flat"):
            raise ValueError(f"index_type: ivfpq or flat, got {self.index_type!r}")
        if self.vectors_dtype not in ("float32", "float16"):
            raise ValueError(f"vectors_dtype: float32 or float16, got {self.vectors_dtype!r}")
        if self.dim % self.pq_m:
            raise ValueError(f"pq_m={self.pq_m} must divide dim {self.dim}")
        if self.coarse_quantizer not in faiss_index.COARSE_QUANTIZERS:
            raise ValueError(f"coarse_quantizer: one of {faiss_index.COARSE_QUANTIZERS}")

    def corpus(self) -> SyntheticCorpus:
        return SyntheticCorpus(
            count=self.passages,
            dim=self.dim,
            seed=self.seed,
            n_centres=self.n_centres,
            noise_rank=min(NOISE_RANK, self.dim),
        )

    def index_params(self) -> dict[str, Any]:
        if self.index_type == "flat":
            return faiss_index.default_params("flat", self.passages, self.dim)
        return faiss_index.default_params(
            "ivfpq",
            self.passages,
            self.dim,
            AnnParams(
                nlist=min(self.nlist, self.passages),
                pq_m=self.pq_m,
                nprobe=self.nprobe,
                rerank=self.rerank,
                coarse_quantizer=self.coarse_quantizer,
                hnsw_m=self.hnsw_m,
                ef_construction=self.ef_construction,
                ef_search=self.ef_search,
            ),
        )

    def built(self) -> dict[str, Any]:
        """What the build depends on: all but the search-time fields."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k not in SEARCH_TIME_FIELDS}

    def identity(self) -> str:
        """The sha256 every shard records as its ``parent_checksum``."""
        text = json.dumps(self.built(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()


# Set per search (LoadedIndex.set_search_params), not by the build: a finished run is
# re-measured with others without building again.
SEARCH_TIME_FIELDS = ("nprobe", "rerank")


@dataclass
class BuildResult:
    shard_dirs: list[Path]
    build_s: float  # training + every shard, summed over resumed attempts
    train_s: float
    shard_s: list[float]
    truth: np.ndarray  # exact top-100 rows per query
    queries: np.ndarray


class ScaleRun:
    """The files of one run under ``root`` (state, trained quantizer, truth, shards)."""

    def __init__(self, root: Path, config: ScaleConfig) -> None:
        self.root = Path(root)
        self.config = config
        self.state_path = self.root / "state.json"
        self.trained_path = self.root / "trained.faiss"
        self.truth_path = self.root / "truth.npz"
        self.index_root = self.root / "index"
        self.root.mkdir(parents=True, exist_ok=True)
        self.state = self._load_state()

    def _load_state(self) -> dict[str, Any]:
        want = dataclasses.asdict(self.config)
        if self.state_path.exists():
            state = json.loads(self.state_path.read_text())
            for f in dataclasses.fields(ScaleConfig):  # a state older than a new field
                if f.default is not dataclasses.MISSING:
                    state["config"].setdefault(f.name, f.default)
            had = {k: v for k, v in state["config"].items() if k not in SEARCH_TIME_FIELDS}
            if had != self.config.built():
                raise ValueError(
                    f"{self.root} holds a run of {state['config']}, not {want}: "
                    "use another --work directory or remove it"
                )
            state["config"] = want  # the search-time fields of this measurement
            return state
        return {"config": want, "train_s": None, "shard_s": {}, "spent_s": {}}

    def save_state(self) -> None:
        replace_file(self.state_path, json.dumps(self.state, indent=2, sort_keys=True) + "\n")

    def shard_dir(self, i: int) -> Path:
        return self.index_root / f"shard-{i}" / INDEX_NAME

    def partial_dir(self, i: int) -> Path:
        return self.root / "partial" / f"shard-{i}" / INDEX_NAME


def bytes_needed(config: ScaleConfig) -> int:
    """Disk a whole run takes: float32 vectors, the index (PQ codes and ids, or a flat copy of
    the vectors), ~40 B of passage store per row."""
    index_bytes = 4 * config.dim if config.index_type == "flat" else config.pq_m + 8
    vector_bytes = np.dtype(config.vectors_dtype).itemsize * config.dim
    return config.passages * (vector_bytes + index_bytes + 40)


def check_disk(run: ScaleRun) -> None:
    done = sum(
        f.stat().st_size
        for d in (run.index_root, run.root / "partial")
        if d.exists()
        for f in d.rglob("*")
        if f.is_file()
    )
    need = bytes_needed(run.config) - done + DISK_MARGIN
    free = shutil.disk_usage(run.root).free
    if free < need:
        raise RuntimeError(
            f"{run.root}: {free / 2**30:.1f} GiB free, the run needs {need / 2**30:.1f} GiB more "
            f"(including {DISK_MARGIN / 2**30:.0f} GiB left for others)"
        )


def train(run: ScaleRun, progress: bool) -> faiss.Index:
    """The empty, trained IVF-PQ every shard is a copy of (saved once, reused on resume)."""
    config = run.config
    if config.index_type == "flat":
        run.state["train_s"] = 0.0
        return faiss.IndexFlatIP(config.dim)  # nothing to train
    if run.trained_path.exists():
        return faiss_index.read(run.trained_path)
    t0 = time.monotonic()
    sample = config.corpus().sample(min(config.train_size, config.passages))
    if progress:
        coarse = f"_HNSW{config.hnsw_m}" if config.coarse_quantizer == "hnsw" else ""
        print(
            f"training IVF{config.nlist}{coarse},PQ{config.pq_m} on {len(sample)} vectors",
            flush=True,
        )
    index, _ = faiss_index.build_faiss(sample, "ivfpq", config.index_params())
    index.reset()  # keep the training, drop the sample (as split_index's template does)
    faiss_index.write(index, run.trained_path)
    run.state["train_s"] = round(time.monotonic() - t0, 3)
    run.save_state()
    return index


def build(run: ScaleRun, progress: bool = True) -> BuildResult:
    """Build (or finish building) every shard of ``run``; returns where they are and the
    exact top-100 of the queries over the whole corpus."""
    config = run.config
    corpus = config.corpus()
    queries, _ = corpus.queries(config.queries)
    truth = RunningTopK(queries, 100)
    if run.truth_path.exists():
        truth.load(run.truth_path)
    check_disk(run)
    template = train(run, progress)
    params = config.index_params()
    spans = shard_spans(config.passages, config.shards)
    for i, (start, stop) in enumerate(spans):
        if run.shard_dir(i).exists():
            continue
        _build_shard(run, i, start, stop, template, params, truth, progress)
        run.state["shard_s"][str(i)] = round(run.state["spent_s"].pop(str(i)), 3)
        run.save_state()
    if truth.rows_done != config.passages:
        raise RuntimeError(f"ground truth covers {truth.rows_done} of {config.passages} rows")
    shard_s = [float(run.state["shard_s"][str(i)]) for i in range(config.shards)]
    train_s = float(run.state["train_s"] or 0.0)
    return BuildResult(
        shard_dirs=[run.shard_dir(i) for i in range(config.shards)],
        build_s=round(train_s + sum(shard_s), 3),
        train_s=train_s,
        shard_s=shard_s,
        truth=truth.rows,
        queries=queries,
    )


def _build_shard(
    run: ScaleRun,
    i: int,
    start: int,
    stop: int,
    template: faiss.Index,
    params: dict[str, Any],
    truth: RunningTopK,
    progress: bool,
) -> None:
    config = run.config
    corpus = config.corpus()
    work = run.partial_dir(i)
    work.mkdir(parents=True, exist_ok=True)
    count = stop - start
    vec_path = work / VECTORS_FILE
    if vec_path.exists() and truth.rows_done > start:
        vecs = np.load(vec_path, mmap_mode="r+")
    else:
        vecs = np.lib.format.open_memmap(
            vec_path, mode="w+", dtype=np.dtype(config.vectors_dtype), shape=(count, config.dim)
        )
    if not start <= truth.rows_done <= stop:
        raise RuntimeError(f"shard {i} [{start}, {stop}) but truth is at row {truth.rows_done}")
    index = faiss.clone_index(template)
    faiss_index.prepare_add(index, config.index_type, params)  # an hnsw graph's assignment ef
    desc = f"shard {i + 1}/{config.shards}"
    t_begin = time.monotonic()
    with tqdm(total=count, unit="psg", desc=desc, disable=not progress, mininterval=5) as bar:
        # rows of an interrupted attempt: on disk already, and in the truth
        for s in range(start, truth.rows_done, STEP_ROWS):
            e = min(s + STEP_ROWS, truth.rows_done)
            index.add(np.ascontiguousarray(vecs[s - start : e - start], dtype=np.float32))
            bar.update(e - s)
        last_save = time.monotonic()
        for s in range(truth.rows_done, stop, STEP_ROWS):
            e = min(s + STEP_ROWS, stop)
            x = corpus.rows(s, e)
            vecs[s - start : e - start] = x
            if vecs.dtype != np.float32:  # what is stored is what is indexed and searched
                x = np.asarray(vecs[s - start : e - start], dtype=np.float32)
            index.add(x)
            truth.add(x, s)
            bar.update(e - s)
            if e == stop or time.monotonic() - last_save > SAVE_EVERY_S:
                vecs.flush()
                truth.save(run.truth_path)
                _note_spent(run, i, time.monotonic() - t_begin)
                t_begin = last_save = time.monotonic()
    del vecs
    faiss_index.configure(index, config.index_type, params)
    faiss_index.write(index, work / faiss_index.INDEX_FILE)
    del index
    _write_passages(work / PASSAGES_FILE, start, stop)
    manifest = Manifest(
        name=INDEX_NAME,
        encoder=ENCODER,
        query_encoder=ENCODER,
        dim=config.dim,
        count=count,
        index_type=config.index_type,
        index_params=params,
        normalize=False,
        score_scale=1.0,  # DPR's raw inner products
        build_seconds=0.0,  # filled below; the shard's own time, resumed attempts summed
        created_at=datetime.now(UTC).isoformat(timespec="seconds"),
        input_format="synthetic",
        views=["dense"],
        shard={
            "index": i,
            "count": config.shards,
            "row_offset": start,
            "parent_count": config.passages,
            "parent_checksum": config.identity(),
        },
        **checksum_fields(work),
    )
    _note_spent(run, i, time.monotonic() - t_begin)
    manifest.build_seconds = round(run.state["spent_s"][str(i)], 3)
    final = run.shard_dir(i)
    final.parent.mkdir(parents=True, exist_ok=True)
    publish(work, final, manifests={MANIFEST: manifest.to_json()})
    shutil.rmtree(run.partial_dir(i).parent, ignore_errors=True)


def _note_spent(run: ScaleRun, i: int, seconds: float) -> None:
    spent = run.state["spent_s"]
    spent[str(i)] = spent.get(str(i), 0.0) + seconds
    run.save_state()


def _write_passages(path: Path, start: int, stop: int, batch: int = 200_000) -> None:
    writer = PassageWriter(path)
    try:
        for s in range(start, stop, batch):
            writer.add(
                Passage(id=passage_id(r), title="", text=f"passage {r}")
                for r in range(s, min(s + batch, stop))
            )
    finally:
        writer.close()


def passage_id(row: int) -> str:
    """Zero-padded, so ids sort as rows do and the store's unique index is appended to."""
    return f"p{row:08d}"


def row_of(passage_id_: str) -> int:
    return int(passage_id_[1:])


def disk_bytes(paths: list[Path]) -> int:
    return sum(f.stat().st_size for p in paths for f in Path(p).rglob("*") if f.is_file())
