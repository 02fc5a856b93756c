"""Dense indexes on faiss: exact flat, HNSW (as RAG/DPR), and two compressed variants.

Shared: the write side builds it, the read side searches it.

All types rank and score by inner product (DPR/RAG's similarity).

HNSW and inner product. DPR (whose index RAG uses) built faiss HNSW on L2 with the "MIPS to
L2" augmentation (Bachrach et al., 2014; DPR's ``DenseHNSWFlatIndexer``), because faiss' HNSW
had no inner-product metric then: every document gets an extra coordinate ``sqrt(phi - |x|^2)``
with ``phi = max |x|^2``, so all augmented documents have norm ``phi``; a query gets a 0 there.
Then ``|q' - x'|^2 = |q|^2 + phi - 2 q.x``: L2 order equals inner-product order and
``q.x = (|q|^2 + phi - dist) / 2`` recovers the score. That transform is available here as
``hnsw_transform="mips_to_l2"``. The default is ``"none"``: current faiss builds HNSW graphs
directly with METRIC_INNER_PRODUCT, and in our measurements that is markedly better
(recall@10 on 32-d vectors with spread norms, M=16, efSearch=64: 1.00 native vs 0.45
augmented; the augmentation squeezes all documents onto one sphere where the extra, nearly
constant coordinate dominates distances). For L2-normalised encoders (MiniLM) the two agree.
IVF-PQ supports inner product natively too.

IVF-PQ's coarse quantizer (``coarse_quantizer``): which of the ``nlist`` lists a vector goes to
is an argmax of its inner product with the lists' centroids. ``"flat"`` (the default) scores
every centroid exactly (nlist x dim multiply-adds per vector added or query asked); ``"hnsw"``
puts the trained centroids in an HNSW graph (``IndexHNSWFlat``, ``hnsw_m`` / ``ef_construction``)
(faiss' ``IVF<nlist>_HNSW<M>`` quantizer), which makes many lists affordable: at 21M passages
the flat assignment to 8,192 lists costs ~1.3e14 multiply-adds, the graph's a few hundred dot
products per vector. A vector added goes to the graph's best centroid found with ``ef_search``
candidates (``prepare_add``); a query's probe asks the graph for ``nprobe`` centroids with
``max(ef_search, nprobe)`` candidates (``configure``: faiss' HNSW returns fewer than k results
when efSearch < k). k-means assigns through the graph too, as faiss' factory index does.
The graph is approximate where it matters: on the 21M benchmark corpus, 4,096 centroids at
efSearch 16 put 31% of vectors in another list than the exact quantizer would (3% at 256,
which costs about what the exact quantizer does); keep ``"flat"`` up to several thousand
lists (``bench/index/coarse_assignment.py``, docs/benchmarks.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import faiss
import numpy as np

from openbook.errors import InternalError, InvalidArgument
from openbook.index import arrays

if TYPE_CHECKING:
    from openbook.index.spec import AnnParams

DENSE_TYPES = ("flat", "hnsw", "hnsw-sq8", "ivfpq")
INDEX_FILE = "index.faiss"
HNSW_TRANSFORMS = ("none", "mips_to_l2")
COARSE_QUANTIZERS = ("flat", "hnsw")  # ivfpq's (module docstring)
_ADD_BATCH = 20_000


def default_params(
    index_type: str, count: int, dim: int, ann: AnnParams | None = None
) -> dict[str, Any]:
    """The manifest's ``index_params`` of a ``count``-vector ``index_type`` index of ``dim``
    dimensions built with ``ann`` (None: the defaults); ``ivfpq``'s ``nlist`` and ``pq_m``,
    when unset, are chosen from ``count`` and ``dim``."""
    if ann is None:
        # why: spec imports this module's names, so this one cannot be imported at its top
        from openbook.index.spec import AnnParams

        ann = AnnParams()
    if index_type == "flat":
        return {"metric": "inner_product"}
    if index_type in ("hnsw", "hnsw-sq8"):
        return {
            "metric": "inner_product",
            "transform": ann.hnsw_transform,
            "hnsw_m": ann.hnsw_m,
            "ef_construction": ann.ef_construction,
            "ef_search": ann.ef_search,
            "rerank": ann.rerank,
        }
    if index_type == "ivfpq":
        nlist, pq_m = ann.nlist, ann.pq_m
        if nlist is None:
            # ~4 sqrt(N) lists is faiss' usual advice; keep >= 39 training points per list.
            nlist = max(1, min(int(4 * math.sqrt(max(count, 1))), count // 39))
        if pq_m is None:
            pq_m = _largest_divisor_at_most(dim, max(1, dim // 8))
        elif dim % pq_m:
            raise InvalidArgument(f"pq_m={pq_m} must divide the vector dim {dim}")
        # PQ needs >= 2**nbits training points per sub-quantizer; shrink codebooks on tiny corpora.
        nbits = max(1, min(8, int(math.log2(max(count, 2)))))
        params = {
            "metric": "inner_product",
            "nlist": nlist,
            "pq_m": pq_m,
            "nbits": nbits,
            "nprobe": min(ann.nprobe, nlist),
            "rerank": ann.rerank,
            "coarse_quantizer": ann.coarse_quantizer,
        }
        if ann.coarse_quantizer == "hnsw":
            params.update(
                hnsw_m=ann.hnsw_m, ef_construction=ann.ef_construction, ef_search=ann.ef_search
            )
        return params
    raise InvalidArgument(f"unknown dense index type {index_type!r}; expected one of {DENSE_TYPES}")


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, limit + 1) if n % d == 0)


def augment_documents(x: np.ndarray, phi: float) -> np.ndarray:
    norms = np.einsum("ij,ij->i", x, x)
    aux = np.sqrt(np.maximum(phi - norms, 0.0)).astype(np.float32)
    return np.hstack([x.astype(np.float32, copy=False), aux[:, None]])


def augment_queries(q: np.ndarray) -> np.ndarray:
    return np.hstack([q.astype(np.float32, copy=False), np.zeros((len(q), 1), np.float32)])


def max_sq_norm(vectors: np.ndarray, batch: int = 100_000) -> float:
    phi = 0.0
    for s in range(0, len(vectors), batch):
        chunk = np.asarray(vectors[s : s + batch], dtype=np.float32)
        phi = max(phi, float(np.einsum("ij,ij->i", chunk, chunk).max(initial=0.0)))
    return phi


def _training_sample(vectors: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    if len(vectors) <= n:
        return np.ascontiguousarray(vectors, dtype=np.float32)
    rows = np.sort(np.random.default_rng(seed).choice(len(vectors), n, replace=False))
    return np.ascontiguousarray(vectors[rows], dtype=np.float32)


def build_faiss(
    vectors: np.ndarray,
    index_type: str,
    params: dict[str, Any],
    on_progress: Callable[[int], None] | None = None,
) -> tuple[faiss.Index, dict[str, Any]]:
    """Build an index over ``vectors`` (may be a memmap). Returns it and the final params."""
    dim = vectors.shape[1]
    params = dict(params)
    transform: Callable[[np.ndarray], np.ndarray] = lambda x: x  # noqa: E731
    if index_type == "flat":
        index: faiss.Index = faiss.IndexFlatIP(dim)
    elif index_type in ("hnsw", "hnsw-sq8"):
        d, metric = dim, faiss.METRIC_INNER_PRODUCT
        if _augmented(index_type, params):
            phi = max_sq_norm(vectors)
            params["phi"] = phi
            transform = lambda x: augment_documents(x, phi)  # noqa: E731
            d, metric = dim + 1, faiss.METRIC_L2
        if index_type == "hnsw":
            index = faiss.IndexHNSWFlat(d, params["hnsw_m"], metric)
        else:
            # faiss's stubs type the quantizer as a ScalarQuantizer; SWIG takes its QT_ constant
            sq8 = cast(Any, faiss.ScalarQuantizer.QT_8bit)
            index = faiss.IndexHNSWSQ(d, sq8, params["hnsw_m"], metric)
            index.train(transform(_training_sample(vectors, 200_000)))
        index.hnsw.efConstruction = params["ef_construction"]
    elif index_type == "ivfpq":
        quantizer = _coarse_quantizer(dim, params)
        index = faiss.IndexIVFPQ(
            quantizer,
            dim,
            params["nlist"],
            params["pq_m"],
            params["nbits"],
            faiss.METRIC_INNER_PRODUCT,
        )
        index.train(_training_sample(vectors, min(max(256 * params["nlist"], 10_000), 1_000_000)))
    else:
        raise InvalidArgument(f"unknown dense index type {index_type!r}")
    prepare_add(index, index_type, params)
    _add(index, vectors, transform, on_progress)
    configure(index, index_type, params)
    return index, params


def _coarse_quantizer(dim: int, params: dict[str, Any]) -> faiss.Index:
    """ivfpq's quantizer, empty: exact (``IndexFlatIP``) or an HNSW graph over the centroids
    (module docstring). Manifests written before ``coarse_quantizer`` existed are flat."""
    kind = params.get("coarse_quantizer", "flat")
    if kind == "flat":
        return faiss.IndexFlatIP(dim)
    if kind == "hnsw":
        graph = faiss.IndexHNSWFlat(dim, int(params["hnsw_m"]), faiss.METRIC_INNER_PRODUCT)
        graph.hnsw.efConstruction = int(params["ef_construction"])
        graph.hnsw.efSearch = int(params["ef_search"])
        return graph
    raise InvalidArgument(
        f"coarse_quantizer: unknown {kind!r}; expected one of {COARSE_QUANTIZERS}"
    )


def _add(
    index: faiss.Index,
    vectors: np.ndarray,
    transform: Callable[[np.ndarray], np.ndarray],
    on_progress: Callable[[int], None] | None,
) -> None:
    for s in range(0, len(vectors), _ADD_BATCH):
        chunk = np.ascontiguousarray(vectors[s : s + _ADD_BATCH], dtype=np.float32)
        index.add(transform(chunk))
        if on_progress:
            on_progress(len(chunk))


def fill_trained(
    template: faiss.Index,
    vectors: np.ndarray,
    index_type: str,
    params: dict[str, Any],
    on_progress: Callable[[int], None] | None = None,
) -> faiss.Index:
    """A copy of the empty, trained ``template`` holding ``vectors``.

    Shards of a compressed index (ivfpq, hnsw-sq8) reuse their parent's quantizer this way
    (``template`` = the parent's index after ``reset()``): every vector gets the code, hence the
    score, it has in the parent, and an ivfpq shard probes the same lists as its parent.
    ``params`` are the parent's, including ``phi`` for the MIPS->L2 transform (the parent's
    max norm bounds every shard's).
    """
    if template.ntotal or not template.is_trained:
        raise InvalidArgument("template index must be trained and empty")
    index = faiss.clone_index(template)
    transform: Callable[[np.ndarray], np.ndarray] = lambda x: x  # noqa: E731
    if _augmented(index_type, params):
        phi = float(params["phi"])
        transform = lambda x: augment_documents(x, phi)  # noqa: E731
    prepare_add(index, index_type, params)
    _add(index, vectors, transform, on_progress)
    configure(index, index_type, params)
    return index


def configure(index: faiss.Index, index_type: str, params: dict[str, Any]) -> None:
    """Apply search-time parameters (ef_search / nprobe)."""
    if index_type in ("hnsw", "hnsw-sq8"):
        # an index of these types is an IndexHNSW (faiss.read_index returns the subclass)
        cast(faiss.IndexHNSW, index).hnsw.efSearch = int(params["ef_search"])
    elif index_type == "ivfpq":
        ivf = faiss.extract_index_ivf(index)
        ivf.nprobe = int(params["nprobe"])
        if params.get("coarse_quantizer", "flat") == "hnsw":
            _coarse_graph(index).hnsw.efSearch = max(int(params["ef_search"]), ivf.nprobe)


def prepare_add(index: faiss.Index, index_type: str, params: dict[str, Any]) -> None:
    """Before adding vectors: an hnsw coarse quantizer assigns each to the best centroid it
    finds with ``ef_search`` candidates (``configure`` sets the probe's, for search)."""
    if index_type == "ivfpq" and params.get("coarse_quantizer", "flat") == "hnsw":
        _coarse_graph(index).hnsw.efSearch = int(params["ef_search"])


def _coarse_graph(index: faiss.Index) -> faiss.IndexHNSW:
    return cast(faiss.IndexHNSW, faiss.downcast_index(faiss.extract_index_ivf(index).quantizer))


def _augmented(index_type: str, params: dict[str, Any]) -> bool:
    return index_type in ("hnsw", "hnsw-sq8") and params.get("transform") == "mips_to_l2"


def index_dim(index: faiss.Index, index_type: str, params: dict[str, Any]) -> int:
    """The document-vector dim an index serves (undoing the +1 augmentation)."""
    return index.d - 1 if _augmented(index_type, params) else index.d


def search(
    index: faiss.Index,
    index_type: str,
    params: dict[str, Any],
    queries: np.ndarray,
    k: int,
    search_params: faiss.SearchParameters | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Top-k rows and inner-product scores; rows are -1 where fewer than k exist.
    ``search_params``: faiss' per-call parameters (an ID selector: ``filtering.py``)."""
    q = np.ascontiguousarray(queries, dtype=np.float32)
    if search_params is not None:
        kw: dict[str, Any] = {"params": search_params}
    else:
        kw = {}
    if _augmented(index_type, params):
        dist, rows = index.search(augment_queries(q), k, **kw)
        qn = np.einsum("ij,ij->i", q, q)[:, None]
        scores = (qn + float(params["phi"]) - dist) / 2.0
        return scores.astype(np.float32), rows
    scores, rows = index.search(q, k, **kw)
    return scores, rows


def rerank_exact(
    q: np.ndarray, rows: np.ndarray, vectors: np.ndarray, k: int
) -> tuple[np.ndarray, np.ndarray]:
    """Re-score candidate ``rows`` (-1 padded) by exact inner product against ``vectors``.

    Lets a compressed index (ivfpq, hnsw-sq8) fetch ``k * factor`` candidates cheaply and
    then order them exactly, using the float vectors every index keeps in ``vectors.npy``
    (read row by row from the file: :func:`gather_rows`).
    """
    out_rows = np.full((len(q), k), -1, dtype=np.int64)
    out_scores = np.zeros((len(q), k), dtype=np.float32)
    valid = rows[rows >= 0]
    if not len(valid):
        return out_scores, out_rows
    unique = np.unique(valid)
    gathered = gather_rows(vectors, unique)
    for i in range(len(q)):
        cand = np.unique(rows[i][rows[i] >= 0])  # in row order, as before the gather
        if not len(cand):
            continue
        exact = gathered[np.searchsorted(unique, cand)] @ q[i]
        best = np.argsort(-exact, kind="stable")[:k]
        out_rows[i, : len(best)] = cand[best]
        out_scores[i, : len(best)] = exact[best]
    return out_scores, out_rows


def gather_rows(vectors: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``vectors[rows]`` as float32 ``(len(rows), dim)``.

    For a ``vectors.npy`` opened by :func:`openbook.index.arrays.open_array` (what
    :class:`~openbook.index.loaded.LoadedIndex` serves) the rows are read from the file with
    ``pread``, not through the map. Re-ranking reads k x rerank scattered rows per query:
    through the map, each row is a page fault that waits for the disk before the next is
    asked, and every page read stays mapped in the process (with the kernel's fault-around,
    16 cached pages per fault), so a shard's RSS grows towards the size of its vectors while
    its own memory does not (a 21M shard: 15 GB of mapped file pages beside 1.4 GB of its
    own). Here every row's read is announced first (``posix_fadvise`` WILLNEED: the device gets
    them all at once), then each is copied in from the file the map was opened on (its name
    may be gone: a swap or an adoption moved the directory): the page cache stays the
    kernel's (shared, reclaimable), the process maps none of it; a row asked for twice is read
    once. Any other array is indexed in memory."""
    rows = np.asarray(rows, dtype=np.int64)
    where = arrays.file_of(vectors)
    if (
        where is None
        or vectors.ndim != 2
        or vectors.strides != (vectors.shape[1] * vectors.itemsize, vectors.itemsize)
        or not hasattr(os, "preadv")
    ):
        return np.asarray(vectors[rows], dtype=np.float32)
    fd, first = where
    row_bytes = int(vectors.strides[0])
    unique, inverse = np.unique(rows, return_inverse=True)
    out = np.empty((len(unique), vectors.shape[1]), dtype=vectors.dtype)
    if hasattr(os, "posix_fadvise"):
        for r in unique.tolist():
            os.posix_fadvise(fd, first + r * row_bytes, row_bytes, os.POSIX_FADV_WILLNEED)
    view = out.reshape(-1).view(np.uint8).data
    for i, r in enumerate(unique.tolist()):
        got = os.preadv(fd, [view[i * row_bytes : (i + 1) * row_bytes]], first + r * row_bytes)
        if got != row_bytes:
            raise InternalError(f"vectors row {r}: read {got} of {row_bytes} bytes")
    return out[inverse.reshape(-1)].astype(np.float32, copy=False)


def write(index: faiss.Index, path: Path) -> None:
    tmp = Path(path).with_suffix(".tmp")
    faiss.write_index(index, str(tmp))
    tmp.replace(path)


def read(path: Path) -> faiss.Index:
    return faiss.read_index(str(path))
