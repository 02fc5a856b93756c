"""Hybrid retrieval: one prior p(z|x) from an index's dense and BM25 views of the same passages.

Read side (``fit_fusion`` rewrites only the manifest's ``fusion``).

An index built with both views (``Manifest.views == ["dense", "bm25"]``) answers a query in one
of :data:`RETRIEVAL_MODES`. ``hybrid`` (the default where both views exist) works as follows:

* Candidates: the union of the dense top-N and the BM25 top-N, N = ``max(k, candidates)``
  (:attr:`Fusion.candidates`, 50 by default), so a passage either view ranks highly is scored.
* Features, exact for every candidate whichever view found it: ``d = q(x)·d(z)``, the raw inner
  product with the stored vector (``vectors.npy``, not the approximate faiss score), and
  ``b = BM25(x, z)`` (bm25s' own scores, :meth:`openbook.index.bm25.BM25Searcher.score_rows`).
* Fused score ``s(z, x) = w_d·d + w_b·b``; the top k by ``s`` are returned with
  ``Passage.score = s``, and the generator's prior is ``p(z|x) = softmax_k(s)`` exactly as for
  a dense index (whose score is ``score_scale·d``). The two weights set both the mix and the
  temperature: a log-linear model over the candidates, not a rank fusion (RRF's 1/(60+rank)
  has no meaning as a logit).
* Fit (:func:`fit_fusion`): maximise, over training questions, the marginal log-likelihood of
  the candidates that contain an answer, ``log sum_{z has answer} softmax(s)_z`` over the
  candidate set (questions with no answer-bearing candidate carry no signal and are skipped).
  Two parameters, fitted with L-BFGS on standardised features; the result goes to the
  manifest's ``fusion`` (:func:`store_fusion`), with what it was fitted on.
* Unfitted (:meth:`Fusion.default`): ``w_d = score_scale`` and ``w_b = 1``, i.e. each view's
  own served score as a logit, summed: p(z|x) ∝ p_dense(z|x)·p_bm25(z|x) on the candidates, a
  product of the two priors each view serves alone. Both are in "logit units" already (the
  dense scale is chosen so that softmax over it is a useful prior, ``vectors.default_score_scale``;
  BM25 scores are served raw as logits by bm25 indexes), so neither swamps the other.

Joint training keeps training the query encoder through the dense part of ``s``
(``openbook_trainer.retrieval.HybridRetrieval``): ``∂s/∂q = w_d·d(z)``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from openbook.errors import InvalidArgument
from openbook.rag.answers import joined_tokens, normalize_answer, tokens_have_answer
from openbook.validation.jsonl import json_object

if TYPE_CHECKING:
    from openbook.index.encoders import Encoder
    from openbook.index.loaded import LoadedIndex
    from openbook.index.manifest import Manifest

RETRIEVAL_MODES = ("dense", "bm25", "hybrid")
DEFAULT_CANDIDATES = 50
DEFAULT_BM25_WEIGHT = 1.0


@dataclass(frozen=True)
class Fusion:
    """The fused score ``s = dense_weight·(q·d) + bm25_weight·bm25`` over ``candidates`` per
    view. ``fitted_on`` / ``log_likelihood`` are None for the unfitted default."""

    dense_weight: float
    bm25_weight: float
    candidates: int = DEFAULT_CANDIDATES
    # {"questions": n used, "source": path or label, "sha256": of the question file}
    fitted_on: dict[str, Any] | None = None
    log_likelihood: float | None = None  # mean per question, at the fitted weights

    def __post_init__(self) -> None:
        for name in ("dense_weight", "bm25_weight"):
            v = getattr(self, name)
            if type(v) not in (int, float) or not math.isfinite(v):
                raise InvalidArgument(f"{name} must be a finite number, got {v!r}")
        if type(self.candidates) is not int or self.candidates < 1:
            raise InvalidArgument(
                f"candidates must be a whole number >= 1, got {self.candidates!r}"
            )
        if self.fitted_on is not None and not isinstance(self.fitted_on, dict):
            raise InvalidArgument(f"fitted_on must be an object, got {self.fitted_on!r}")
        ll = self.log_likelihood
        if ll is not None and (type(ll) not in (int, float) or not math.isfinite(ll)):
            raise InvalidArgument(f"log_likelihood must be a finite number, got {ll!r}")

    @classmethod
    def default(cls, score_scale: float, candidates: int = DEFAULT_CANDIDATES) -> Fusion:
        """The unfitted fusion (module docstring): each view's served score, summed."""
        return cls(float(score_scale), DEFAULT_BM25_WEIGHT, candidates)

    @property
    def fitted(self) -> bool:
        return self.fitted_on is not None

    def score(self, dense: np.ndarray, bm25: np.ndarray) -> np.ndarray:
        """``s = w_d·d + w_b·b`` elementwise (float32)."""
        d, b = np.asarray(dense, np.float64), np.asarray(bm25, np.float64)
        return (self.dense_weight * d + self.bm25_weight * b).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dense_weight": float(self.dense_weight),
            "bm25_weight": float(self.bm25_weight),
            "candidates": self.candidates,
        }
        if self.fitted_on is not None:
            out["fitted_on"] = self.fitted_on
        if self.log_likelihood is not None:
            out["log_likelihood"] = float(self.log_likelihood)
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Fusion:
        """The fusion of a manifest's ``fusion`` field; InvalidArgument naming what is wrong."""
        if not isinstance(data, dict):
            raise InvalidArgument(f"expected an object, got {data!r}")
        known = {"dense_weight", "bm25_weight", "candidates", "fitted_on", "log_likelihood"}
        if missing := {"dense_weight", "bm25_weight"} - data.keys():
            raise InvalidArgument(f"missing {', '.join(sorted(missing))}")
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Candidates:
    """Per query, the union of both views' top N with both features (row -1: padding).

    rows  (Q, M) int64   index rows, -1 where a query has fewer than M candidates
    dense (Q, M) float32 q(x)·d(z), the raw inner product (0 at padding)
    bm25  (Q, M) float32 the BM25 score (0 at padding, and for documents sharing no term)
    """

    rows: np.ndarray
    dense: np.ndarray
    bm25: np.ndarray

    @property
    def valid(self) -> np.ndarray:
        return self.rows >= 0


def union_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise union of two -1 padded ``(Q, N)`` row arrays: ``(Q, M)``, -1 padded, a's
    rows first in their order, then b's that a lacks."""
    merged = []
    for ra, rb in zip(a, b, strict=True):
        seen: dict[int, None] = {}
        for r in (*ra.tolist(), *rb.tolist()):
            if r >= 0:
                seen.setdefault(int(r), None)
        merged.append(list(seen))
    width = max((len(m) for m in merged), default=0)
    out = np.full((len(merged), width), -1, dtype=np.int64)
    for i, m in enumerate(merged):
        out[i, : len(m)] = m
    return out


def top_k_columns(fusion: Fusion, cands: Candidates, k: int) -> np.ndarray:
    """Which candidates make the fused top k: ``(Q, min(k, M))`` column indices into
    ``cands``, best first (padding columns, if any, last)."""
    s = np.where(cands.valid, fusion.score(cands.dense, cands.bm25), -np.inf)
    return np.argsort(-s, axis=1, kind="stable")[:, :k]


def top_k(fusion: Fusion, cands: Candidates, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, rows), ``(Q, k)`` best first by the fused score; -1 rows pad (score -inf)."""
    s = fusion.score(cands.dense, cands.bm25)
    s = np.where(cands.valid, s, -np.inf).astype(np.float32)
    order = top_k_columns(fusion, cands, k)
    scores = np.take_along_axis(s, order, axis=1)
    rows = np.take_along_axis(cands.rows, order, axis=1)
    rows = np.where(np.isfinite(scores), rows, -1)
    if scores.shape[1] < k:  # fewer candidates than k
        pad = k - scores.shape[1]
        scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        rows = np.pad(rows, ((0, 0), (0, pad)), constant_values=-1)
    return scores, rows


# ----------------------------------------------------------------------------- fitting


@dataclass(frozen=True)
class FitResult:
    dense_weight: float
    bm25_weight: float
    log_likelihood: float  # mean per question at the fitted weights
    initial_log_likelihood: float  # mean per question at the starting weights
    questions: int  # questions used (with an answer among their candidates)


def marginal_log_likelihood(
    weights: tuple[float, float],
    dense: np.ndarray,
    bm25: np.ndarray,
    positive: np.ndarray,
    valid: np.ndarray,
) -> np.ndarray:
    """Per question ``log sum_{z positive} softmax(s)_z`` over its valid candidates, ``(Q,)``
    (float64; -inf where a question has no positive candidate)."""
    s = weights[0] * dense.astype(np.float64) + weights[1] * bm25.astype(np.float64)
    all_ = np.where(valid, s, -np.inf)
    pos = np.where(valid & positive, s, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        return _logsumexp(pos) - _logsumexp(all_)


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = np.max(x, axis=1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    return np.log(np.sum(np.exp(x - m), axis=1)) + m[:, 0]


def fit_weights(
    dense: np.ndarray,
    bm25: np.ndarray,
    positive: np.ndarray,
    valid: np.ndarray,
    init: tuple[float, float] = (1.0, 1.0),
    max_iter: int = 200,
    prior: float = 1.0,
) -> FitResult:
    """Maximise the mean marginal log-likelihood of the positive candidates over (w_d, w_b).

    All arrays ``(Q, M)``. Questions without a positive candidate are dropped. The optimiser
    (torch L-BFGS, strong Wolfe line search, float64) works on weights multiplied by each
    feature's standard deviation over the valid candidates (θ), so one step size suits both
    features whatever their units (cosine in [-1, 1], BM25 in tens).

    ``prior``: a Gaussian prior on θ centred on ``init`` with precision ``prior`` (a MAP fit:
    ``prior/2·|θ - θ_init|²`` added to the summed negative log-likelihood). It is worth one
    question or so: negligible with hundreds, but where the training questions are separable
    (every answer-bearing candidate can be ranked above the rest) the likelihood alone grows
    without bound as the temperature goes to 0, and the prior keeps the weights finite.
    ``log_likelihood`` reports the likelihood alone.
    """
    import torch

    positive = positive & valid
    keep = positive.any(axis=1)
    if not keep.any():
        raise InvalidArgument("no question has an answer among its candidates: nothing to fit")
    dense, bm25, positive, valid = dense[keep], bm25[keep], positive[keep], valid[keep]
    sd = [float(np.std(f[valid])) or 1.0 for f in (dense, bm25)]
    feats = torch.from_numpy(np.stack([dense / sd[0], bm25 / sd[1]], axis=-1).astype(np.float64))
    v, p = torch.from_numpy(valid), torch.from_numpy(positive)
    theta0 = torch.tensor([init[0] * sd[0], init[1] * sd[1]], dtype=torch.float64)
    theta = theta0.clone().requires_grad_(True)
    neg_inf = torch.tensor(-math.inf, dtype=torch.float64)
    n = int(keep.sum())

    def nll() -> torch.Tensor:
        s = feats @ theta  # (Q, M)
        ll = torch.logsumexp(torch.where(p, s, neg_inf), 1) - torch.logsumexp(
            torch.where(v, s, neg_inf), 1
        )
        return -ll.mean()

    def loss_fn() -> torch.Tensor:
        return nll() + prior / (2 * n) * torch.sum((theta - theta0) ** 2)

    opt = torch.optim.LBFGS(
        [theta], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe", tolerance_grad=1e-9
    )

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    with torch.no_grad():
        initial = -float(nll())
    opt.step(closure)
    with torch.no_grad():
        final = -float(nll())
    w = theta.detach().numpy()
    wd, wb = float(w[0] / sd[0]), float(w[1] / sd[1])
    if final < initial or not (math.isfinite(wd) and math.isfinite(wb)):
        wd, wb, final = float(init[0]), float(init[1]), initial  # never worse than the start
    return FitResult(wd, wb, final, initial, n)


@dataclass(frozen=True)
class Question:
    question: str
    answers: tuple[str, ...]


def read_questions(path: Path, exclude_titles: Iterable[str] = ()) -> tuple[list[Question], str]:
    """Questions of a jsonl file (``question``, ``answers`` and optionally ``title``), leaving
    out those whose ``title`` is in ``exclude_titles`` (e.g. held-out dev articles); and the
    file's sha256. InvalidArgument naming the line for a malformed row."""
    path = Path(path)
    raw = path.read_bytes()
    excluded = set(exclude_titles)
    out = []
    for n, line in enumerate(raw.decode().splitlines(), 1):
        if not line.strip():
            continue
        row = json_object(line, f"{path}:{n}")
        q, answers = row.get("question"), row.get("answers")
        if not isinstance(q, str) or not q.strip():
            raise InvalidArgument(f"{path}:{n}: question must be a non-empty string")
        if not isinstance(answers, list) or not all(isinstance(a, str) for a in answers):
            raise InvalidArgument(f"{path}:{n}: answers must be a list of strings")
        if row.get("title") in excluded:
            continue
        out.append(Question(q, tuple(answers)))
    return out, hashlib.sha256(raw).hexdigest()


def answer_positives(
    index: LoadedIndex,
    cands: Candidates,
    answers: Sequence[Sequence[str]],
    tokens: dict[int, str] | None = None,
) -> np.ndarray:
    """``(Q, M)`` bool: which candidates of query i contain one of ``answers[i]`` in their
    title + text (:func:`openbook.rag.answers.has_answer`); padding is never positive.

    ``tokens``: row -> its normalised title + text tokens (``joined_tokens``), filled here and
    reusable across calls (a passage is a candidate of many questions; normalising it once per
    row instead of once per question and candidate is the same test at a fraction of the cost).
    """
    tokens = {} if tokens is None else tokens
    positive = np.zeros(cands.rows.shape, dtype=bool)
    new = sorted({int(r) for r in cands.rows.ravel() if r >= 0} - tokens.keys())
    for r, p in zip(new, index.get_passages(new), strict=True):
        tokens[r] = joined_tokens(normalize_answer(f"{p.title} {p.text}").split())
    for i, golds in enumerate(answers):
        gold_tokens = [normalize_answer(a).split() for a in golds]
        for j, r in enumerate(cands.rows[i]):
            if r >= 0:
                positive[i, j] = tokens_have_answer(tokens[int(r)], gold_tokens)
    return positive


def fit_fusion(
    index: LoadedIndex,
    questions: Sequence[Question],
    *,
    candidates: int = DEFAULT_CANDIDATES,
    encoder: Encoder | None = None,
    source: str = "",
    sha256: str | None = None,
    batch_size: int = 256,
    fitted_on: dict[str, Any] | None = None,
    query_vectors: np.ndarray | None = None,
) -> Fusion:
    """Fit the fusion of ``index`` (both views) on ``questions`` (module docstring).

    The candidates of each question are the union of both views' top ``candidates``; a
    candidate is positive when an answer string occurs in its title + text
    (:func:`openbook.rag.answers.has_answer`, DPR's test on SQuAD-normalised tokens). Starts from
    the unfitted default, so the fit never scores worse than it on these questions.
    ``fitted_on``: more to record about the questions (e.g. the titles held out).
    ``query_vectors``: ``(len(questions), dim)``, the questions already encoded by the encoder
    that serves the index (fitting several indexes of one encoder encodes them once).
    """
    if not {"dense", "bm25"} <= set(index.views):
        raise InvalidArgument(
            f"index {index.name!r} has views {index.views}: fitting a fusion needs dense and bm25"
        )
    if not questions:
        raise InvalidArgument("no questions to fit on")
    feats: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
    passage_tokens: dict[int, str] = {}
    for start in range(0, len(questions), batch_size):
        batch = questions[start : start + batch_size]
        texts = [q.question for q in batch]
        vectors = None if query_vectors is None else query_vectors[start : start + batch_size]
        cands = index.hybrid_candidates(texts, candidates, encoder=encoder, query_vectors=vectors)
        positive = answer_positives(index, cands, [q.answers for q in batch], passage_tokens)
        feats.append((cands.dense, cands.bm25, positive, cands.valid))
    width = max(f[0].shape[1] for f in feats)

    def cat(j: int, fill: Any) -> np.ndarray:
        return np.concatenate(
            [
                np.pad(f[j], ((0, 0), (0, width - f[j].shape[1])), constant_values=fill)
                for f in feats
            ]
        )

    start_fusion = Fusion.default(index.manifest.score_scale, candidates)
    res = fit_weights(
        cat(0, 0.0),
        cat(1, 0.0),
        cat(2, False),
        cat(3, False),
        init=(start_fusion.dense_weight, start_fusion.bm25_weight),
    )
    return Fusion(
        dense_weight=res.dense_weight,
        bm25_weight=res.bm25_weight,
        candidates=candidates,
        fitted_on={
            **(fitted_on or {}),
            "questions": res.questions,
            "source": source,
            "sha256": sha256,
        },
        log_likelihood=res.log_likelihood,
    )


def store_fusion(index_dir: Path, fusion: Fusion | None) -> Manifest:
    """Record ``fusion`` (None: remove it) in the manifest of the index at ``index_dir``.

    Only manifest.json is rewritten (atomically): its checksums cover the index's files, not
    the manifest, so the index stays verified. A retriever serving the index picks the new
    fusion up when it reloads it (hot swap).
    """
    # why: an import cycle (openbook.index.loaded and .manifest import this module)
    from openbook.index.loaded import read_index_manifest
    from openbook.index.manifest import MANIFEST

    index_dir = Path(index_dir)
    m = read_index_manifest(index_dir)
    if fusion is not None and not {"dense", "bm25"} <= set(m.views):
        raise InvalidArgument(
            f"index {m.name!r} has views {m.views}: a fusion needs dense and bm25"
        )
    new = dataclasses.replace(m, fusion=fusion.to_dict() if fusion is not None else None)
    new.to_file(index_dir / MANIFEST)
    return new
