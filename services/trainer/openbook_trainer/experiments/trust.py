"""Answers you can trust, measured on articles never tuned on: retrieval recall of dense, BM25
and hybrid retrieval, the reader's exact match with 95% intervals, and how well the answer's
confidence separates right from wrong answers.

Protocol (nothing here is tuned on what it measures):

* The demo's SQuAD questions are split by article exactly as the fine-tuning experiment split
  them (``finetune.split_by_article``, 10 development articles, seed 0): the shipped adapters
  and the hybrid fusion were fitted on the 30 training articles only, so every development
  question is from an article none of them saw.
* Retrieval: recall@k (the answer string in the top k) of each retrieval mode on every
  development question, and, because retrieval is cheap, a k-fold over **all 40 articles**
  for the fusion: the fusion is refitted on the other folds' articles and measured on the
  held-out fold's questions, so hybrid's gain is measured on every question, never on the
  questions its two weights were fitted on.
* Reader: every system answers the same development questions (a seeded shuffle, so a run cut
  short is a random sample), in the generator's serving precision (``dtype auto``: bf16 on a
  CPU with native bf16), greedy RAG-Token, at most 16 new tokens. EM/F1 with a 95% interval
  from a bootstrap over *articles* (questions of one article are not independent), and each
  system's paired difference to the few-shot prompt with dense retrieval, the baseline the
  shipped adapters replaced.
* Confidence (:mod:`openbook.rag.confidence`): expected calibration error, a reliability
  diagram, AUROC of right vs wrong and EM at 100/80/60/50% coverage (AUROC and EM at 50%
  with 95% intervals over articles).

Every prediction is logged as it is made (``ResultLog``), so an interrupted run resumes.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm import tqdm

from openbook.index import open_index
from openbook.index.encoders import load_adapted_encoder
from openbook.index.engine import RetrievalMode
from openbook.index.fusion import (
    DEFAULT_CANDIDATES,
    Candidates,
    Fusion,
    answer_positives,
    fit_weights,
    top_k,
)
from openbook.index.request import SearchRequest
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.rag.confidence import (
    DEFAULT_FEATURES,
    LOG_PROB_FLOOR,
    answer_features,
    normalized_texts,
    raw_confidence,
)
from openbook.rag.packed_weights import Packing
from openbook.storage.artifacts import sha256_file
from openbook.types import Passage
from openbook_trainer.calibration import fit_logistic, fit_logistic_calibration
from openbook_trainer.evaluation.metrics import has_answer
from openbook_trainer.evaluation.statistics import (
    Interval,
    auroc,
    bootstrap_ci,
    expected_calibration_error,
    measure_ci,
    paired_difference_ci,
    paired_measure_ci,
    precision_at_coverage,
    reliability_bins,
    threshold_for_coverage,
)
from openbook_trainer.experiments.finetune import split_by_article
from openbook_trainer.experiments.inputs import ExperimentInputs
from openbook_trainer.experiments.records import ResultLog, qa_row

COVERAGES = (1.0, 0.8, 0.6, 0.5)


@dataclass(frozen=True)
class ReaderSystem:
    """One configuration of the stack, as the services would serve it."""

    name: str
    generator_adapter: str | None  # a LoRA adapter dir merged into the generator; None: few-shot
    query_encoder_adapter: str | None  # merged into the index's query encoder; None: its own
    retrieval: str  # "dense" | "bm25" | "hybrid"
    # another system's name: this one's EM is also reported as a paired difference to its
    compare_with: str | None = None
    # "int8": the generator's LM head in int8, as OPENBOOK_GENERATOR_LM_HEAD=int8 serves it
    lm_head: str = "model"
    # the generator's weights packed as OPENBOOK_GENERATOR_PACKED_WEIGHTS serves them
    packing: Packing = Packing.AUTO


SHIPPED = "both adapters, hybrid (tuned dense + BM25)"


def default_systems(
    adapters: Path,
    candidate: Path | None = None,
    int8_head: bool = False,
    unpacked: bool = False,
) -> list[ReaderSystem]:
    """The shipped default and the systems it is judged against; with ``candidate`` (a folder
    in ``adapters``' layout, e.g. ``openbook experiments retrain``'s export) also that
    candidate, with ``int8_head`` the shipped default with its LM head in int8, and with
    ``unpacked`` the shipped default with its weights not packed
    (``OPENBOOK_GENERATOR_PACKED_WEIGHTS=off``: the model's own modules, in bf16 or float32,
    whichever ``auto`` serves on this CPU; their products round differently on some processors:
    float32 through MKL, bf16 on AMX), each compared with the shipped default question by
    question."""
    gen = str(adapters / "gemma-3-270m-squad")
    qenc = str(adapters / "minilm-squad-query")
    systems = [
        ReaderSystem("few-shot prompt, dense", None, None, "dense"),
        ReaderSystem("both adapters, tuned dense (shipped until now)", gen, qenc, "dense"),
        ReaderSystem(SHIPPED, gen, qenc, "hybrid"),
        ReaderSystem("few-shot prompt, hybrid (tuned dense + BM25)", None, qenc, "hybrid"),
    ]
    if candidate is not None:
        systems.append(
            ReaderSystem(
                "retrained adapter, hybrid (candidate)",
                str(candidate / "gemma-3-270m-squad"),
                str(candidate / "minilm-squad-query"),
                "hybrid",
                compare_with=SHIPPED,
            )
        )
    if int8_head:
        systems.append(
            ReaderSystem(
                f"{SHIPPED}, int8 LM head",
                gen,
                qenc,
                "hybrid",
                compare_with=SHIPPED,
                lm_head="int8",
            )
        )
    if unpacked:
        systems.append(
            ReaderSystem(
                f"{SHIPPED}, weights not packed",
                gen,
                qenc,
                "hybrid",
                compare_with=SHIPPED,
                packing=Packing.OFF,
            )
        )
    return systems


@dataclass
class TrustConfig(ExperimentInputs):
    out: Path
    systems: list[ReaderSystem]
    index: str = "wiki-2018"  # an index with both views
    dev_articles: int = 10
    seed: int = 0
    dev_examples: int = 0  # 0: every development question
    k: int = 5
    recall_ks: tuple[int, ...] = (1, 5, 20)
    folds: int = 10  # for the fusion's k-fold over all articles; 0 skips it
    max_new_tokens: int = 16
    batch_size: int = 8
    dtype: str = "auto"


@dataclass
class TrustResult:
    config: dict
    dev_articles: list[str]
    questions: int = 0
    recall: dict[str, dict[str, dict]] = field(default_factory=dict)  # mode -> k -> interval
    recall_kfold: dict[str, dict[str, dict]] = field(default_factory=dict)
    fusion_folds: list[dict] = field(default_factory=list)
    recall_gain: dict[str, dict] = field(default_factory=dict)  # k -> hybrid - best single
    recall_gain_kfold: dict[str, dict] = field(default_factory=dict)
    readers: dict[str, dict] = field(default_factory=dict)  # system -> metrics


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line]


def development_questions(config: TrustConfig) -> tuple[list[str], list[dict], list[dict]]:
    """(development titles, training questions, development questions in a seeded order)."""
    rows = sorted(_rows(config.questions), key=lambda r: r["id"])
    _, dev_titles = split_by_article(config.questions, config.dev_articles, config.seed)
    dev_set = set(dev_titles)
    train = [r for r in rows if r["title"] not in dev_set]
    dev = [r for r in rows if r["title"] in dev_set]
    random.Random(config.seed).shuffle(dev)
    if config.dev_examples:
        dev = dev[: config.dev_examples]
    return dev_titles, train, dev


def _found(hits: Sequence[Passage], answers: Sequence[str], k: int) -> float:
    return float(any(has_answer(f"{p.title} {p.text}", answers) for p in hits[:k]))


def recall_table(
    hits: list[list[Passage]], questions: list[dict], ks: Sequence[int]
) -> dict[str, dict]:
    groups = [q["title"] for q in questions]
    return {
        str(k): bootstrap_ci(
            [_found(h, q["answers"], k) for h, q in zip(hits, questions, strict=True)], groups
        ).as_dict()
        for k in ks
    }


def _encoder(adapter: str | None):
    return load_adapted_encoder(adapter) if adapter else None


def _tuned_query_encoder(config: TrustConfig) -> str | None:
    """The query encoder adapter the systems serve (the first one named)."""
    return next((s.query_encoder_adapter for s in config.systems if s.query_encoder_adapter), None)


def hybrid_gain(
    hits: dict[str, list[list[Passage]]], questions: list[dict], ks: Sequence[int]
) -> dict[str, dict]:
    """Per k, recall of hybrid minus that of the better single view (chosen per k on these
    questions, which favours the single view), paired over the questions."""
    groups = [q["title"] for q in questions]
    hybrid = next(label for label in hits if label.startswith("hybrid"))
    singles = [label for label in hits if label != hybrid and "index's" not in label]
    out = {}
    for k in ks:
        found = {
            label: [_found(h, q["answers"], k) for h, q in zip(hits[label], questions, strict=True)]
            for label in (hybrid, *singles)
        }
        best = max(singles, key=lambda label: sum(found[label]))
        out[str(k)] = {
            "versus": best,
            **paired_difference_ci(found[hybrid], found[best], groups).as_dict(),
        }
    return out


def measure_retrieval(config: TrustConfig, index, dev: list[dict], result: TrustResult) -> None:
    """Recall of each mode on the development questions (the shipped fusion, fitted on the
    training articles), with the tuned query encoder for the dense part."""
    qenc = _encoder(_tuned_query_encoder(config))
    questions = [q["question"] for q in dev]
    depth = max(config.recall_ks)
    hits: dict[str, list[list[Passage]]] = {}
    for label, encoder, mode in (
        ("dense (index's query encoder)", None, "dense"),
        ("dense (tuned query encoder)", qenc, "dense"),
        ("bm25", None, "bm25"),
        ("hybrid (tuned query encoder + bm25)", qenc, "hybrid"),
    ):
        if mode not in index.views and not (mode == "hybrid" and len(index.views) == 2):
            continue
        hits[label] = index.search(
            SearchRequest(questions, k=depth, retrieval=RetrievalMode(mode)), encoder=encoder
        )
        result.recall[label] = recall_table(hits[label], dev, config.recall_ks)
    if any(label.startswith("hybrid") for label in hits):
        result.recall_gain = hybrid_gain(hits, dev, config.recall_ks)


def measure_fusion_kfold(config: TrustConfig, index, result: TrustResult) -> None:
    """Hybrid recall on every question of every article, each fold's fusion fitted on the
    other folds' articles (dense and BM25 alone need no fit: measured on the same questions).

    The candidates (both views' top N, both features) do not depend on the fusion, so they
    are computed once for every question; each fold fits its two weights
    (``fusion.fit_weights``, what ``fit_fusion`` runs) on the other folds' candidates and
    ranks its own with them (``fusion.top_k``, what hybrid search runs)."""
    if config.folds < 2 or len(index.views) < 2:
        return
    rows = sorted(_rows(config.questions), key=lambda r: r["id"])
    titles = sorted({r["title"] for r in rows})
    random.Random(config.seed).shuffle(titles)
    fold_of = {t: i % config.folds for i, t in enumerate(titles)}
    folds = np.array([fold_of[r["title"]] for r in rows])
    qenc = _encoder(_tuned_query_encoder(config))
    depth = max(config.recall_ks)
    cands = index.hybrid_candidates(
        [r["question"] for r in rows], max(depth, DEFAULT_CANDIDATES), encoder=qenc
    )
    positive = answer_positives(index, cands, [r["answers"] for r in rows])
    start = Fusion.default(index.manifest.score_scale)
    ranked = np.full((len(rows), depth), -1, dtype=np.int64)
    for fold in tqdm(range(config.folds), desc="fusion k-fold", unit="fold"):
        train, test = folds != fold, folds == fold
        fit = fit_weights(
            cands.dense[train],
            cands.bm25[train],
            positive[train],
            cands.valid[train],
            init=(start.dense_weight, start.bm25_weight),
        )
        fusion = Fusion(fit.dense_weight, fit.bm25_weight)
        result.fusion_folds.append(
            {
                "fold": fold,
                "questions": int(test.sum()),
                "dense_weight": fit.dense_weight,
                "bm25_weight": fit.bm25_weight,
            }
        )
        sub = Candidates(cands.rows[test], cands.dense[test], cands.bm25[test])
        ranked[test] = top_k(fusion, sub, depth)[1]
    flat = sorted({int(r) for r in ranked.ravel() if r >= 0})
    by_row = dict(zip(flat, index.get_passages(flat), strict=True))
    questions = [r["question"] for r in rows]
    hits = {
        "dense (tuned query encoder)": index.search(
            SearchRequest(questions, k=depth, retrieval=RetrievalMode.DENSE), encoder=qenc
        ),
        "bm25": index.search(SearchRequest(questions, k=depth, retrieval=RetrievalMode.BM25)),
        "hybrid (fusion fitted on the other folds)": [
            [by_row[int(r)] for r in row if r >= 0] for row in ranked
        ],
    }
    for label, found in hits.items():
        result.recall_kfold[label] = recall_table(found, rows, config.recall_ks)
    result.recall_gain_kfold = hybrid_gain(hits, rows, config.recall_ks)


def confidence_of(row: dict) -> float:
    return raw_confidence(row["log_prob"], row["num_tokens"])


def _answer_rows(
    system: ReaderSystem,
    config: TrustConfig,
    index,
    dev: list[dict],
    log: ResultLog,
) -> list[dict]:
    """Every development question answered by ``system`` (logged; a rerun resumes)."""
    generator: RagGenerator | None = None
    options = DecodingOptions(mode="rag-token", max_new_tokens=config.max_new_tokens)
    version = f"{Path(config.generator).name}+{adapter_version(system.generator_adapter)}"
    if system.lm_head != "model":
        # "rescored": the int8 head scores its near-best tokens again exactly (int8_head.py);
        # answers logged by the int8 product alone are not this head's
        version += f"+{system.lm_head}-rescored-head"
    if system.packing is not Packing.AUTO:
        # the rounding depends on the packing (float32; bf16 on AMX): its answers logged apart
        version += f"+packed-{system.packing}"
    if config.dtype != "auto":
        # a forced precision rounds otherwise than what auto serves here: logged apart
        version += f"+{config.dtype}"
    keys = [f"{system.name}|{version}|{q['id']}" for q in dev]
    todo = [i for i, key in enumerate(keys) if log.get(key) is None]
    if todo:
        generator = RagGenerator.load(config.generator, dtype=config.dtype)
        if system.generator_adapter:
            generator.apply_adapter(Path(system.generator_adapter), Path(config.generator))
        if system.lm_head == "int8":
            generator.backend.quantize_head()  # after the merge, as the service does
        # then the weights packed as the service packs them
        generator.pack_weights(system.packing)
        encoder = _encoder(system.query_encoder_adapter)
        with tqdm(total=len(keys), initial=len(keys) - len(todo), desc=system.name) as bar:
            for start in range(0, len(todo), config.batch_size):
                batch = [dev[i] for i in todo[start : start + config.batch_size]]
                passages = index.search(
                    SearchRequest(
                        [q["question"] for q in batch],
                        k=config.k,
                        retrieval=RetrievalMode(system.retrieval),
                    ),
                    encoder=encoder,
                )
                results = generator.generate_batch(
                    [(q["question"], p, options) for q, p in zip(batch, passages, strict=True)]
                )
                for q, res in zip(batch, results, strict=True):
                    assert isinstance(res, GenerationResult)  # gave_up is None: none abandoned
                    best = res.hypotheses[0]
                    row = qa_row(q, best.text)
                    row.update(
                        title=q["title"],
                        log_prob=best.log_prob,
                        num_tokens=len(best.token_ids),
                        finish_reason=best.finish_reason,
                        # the decoder's own signals, for confidence features beyond the mean
                        token_log_probs=best.token_log_probs,
                        token_doc_posteriors=best.token_doc_posteriors,
                    )
                    log.add(f"{system.name}|{version}|{q['id']}", row)
                bar.update(len(batch))
    return [log.get(key) for key in keys]  # type: ignore[misc]


def adapter_version(adapter: str | None) -> str:
    """The adapter's folder name and the start of its weights' sha256: a retrained adapter
    under the same name never reuses another's logged answers."""
    if adapter is None:
        return "none"
    weights = Path(adapter) / "adapter_model.safetensors"
    digest = sha256_file(weights)[:12] if weights.is_file() else "missing"
    return f"{Path(adapter).name}@{digest}"


# Signals of the decoder beyond the shipped calibration's features (:data:`DEFAULT_FEATURES`),
# measured here, not served: does adding one separate right from wrong answers better on
# articles the calibration never saw? (docs/results.md reports the answer.)
DECODER_SIGNALS = ("min_token_log_prob", "first_token_log_prob", "posterior_entropy")
# The features this ablation once added to the calibration's (docs/results.md): the ablation
# also measures the calibration without each.
ADDED_FEATURES = ("posterior_with_answer", "question_near_answer")


def logged_posterior(row: dict) -> list[float] | None:
    """p(z|x,y) of a logged RAG-Token answer: the passage posterior after its last token
    (None for a row logged without posteriors, or an answer with no token)."""
    posteriors = row.get("token_doc_posteriors") or []
    return list(posteriors[-1]) if posteriors else None


def decoder_signals(row: dict) -> dict[str, float]:
    """:data:`DECODER_SIGNALS` of one logged answer: the weakest and the first token's
    log p(y_i|x,y_<i) under the RAG marginal (RAG-Token's ``token_log_probs``, floored at
    :data:`LOG_PROB_FLOOR`), and the entropy (nats) of its final passage posterior p(z|x,y).
    An answer logged without them (an older log, an empty answer) gets the floor and 0."""
    token_lp = [max(LOG_PROB_FLOOR, v) for v in row.get("token_log_probs") or []]
    final = logged_posterior(row) or []
    return {
        "min_token_log_prob": min(token_lp, default=LOG_PROB_FLOOR),
        "first_token_log_prob": token_lp[0] if token_lp else LOG_PROB_FLOOR,
        "posterior_entropy": -sum(p * math.log(p) for p in final if p > 0),
    }


def answer_feature_rows(
    system: ReaderSystem, config: TrustConfig, index, rows: list[dict]
) -> list[dict[str, float]]:
    """Each answer's calibration features (:func:`openbook.rag.confidence.answer_features`),
    from its logged values and its passages retrieved again (retrieval is deterministic) with
    the prior the generator computes from them, p(z|x) = softmax of the passage scores; and its
    :func:`decoder_signals` beside them."""
    encoder = _encoder(system.query_encoder_adapter)
    passages = index.search(
        SearchRequest(
            [r["question"] for r in rows], k=config.k, retrieval=RetrievalMode(system.retrieval)
        ),
        encoder=encoder,
    )
    out = []
    for row, hits in zip(rows, passages, strict=True):
        scores = np.array([p.score for p in hits], dtype=np.float64)
        prior = np.exp(scores - scores.max())
        prior /= prior.sum()
        raw = confidence_of(row)
        features = answer_features(
            text=row["answer"],
            log_prob=row["log_prob"],
            mean_log_prob=math.log(raw) if raw > 0 else LOG_PROB_FLOOR,
            finish_reason=row["finish_reason"],
            normalized=normalized_texts(hits),
            doc_prior=prior.tolist(),
            posterior=logged_posterior(row),
            question=row["question"],
        )
        out.append({**features, **decoder_signals(row)})
    return out


def cross_fitted_confidence(
    features: list[dict[str, float]],
    rows: list[dict],
    names: Sequence[str] = DEFAULT_FEATURES,
) -> list[float]:
    """Each answer's confidence under a logistic calibration over ``names`` fitted on the
    *other* articles' answers (leave one article out): how the calibration does on an article
    it never saw."""
    x = np.array([[f[n] for n in names] for f in features], dtype=np.float64)
    x = x.reshape(len(rows), len(names))
    titles = np.array([r["title"] for r in rows])
    em = np.array([r["em"] for r in rows], dtype=np.float64)
    out = np.zeros(len(rows))
    for held in sorted(set(titles)):
        test = titles == held
        correct = em[~test]
        if len(set(correct.tolist())) < 2:  # nothing to separate: the base rate is the best guess
            out[test] = correct.mean() if correct.size else 0.0
            continue
        bias, weights = fit_logistic(x[~test], correct)
        out[test] = 1.0 / (1.0 + np.exp(-(bias + x[test] @ np.asarray(weights))))
    return out.tolist()


def signal_ablation(features: list[dict[str, float]], rows: list[dict]) -> dict[str, dict]:
    """Leave-one-article-out AUROC of the calibration's features (:data:`DEFAULT_FEATURES`),
    of them without each of :data:`ADDED_FEATURES`, with each decoder signal added, and with all:
    each as ``{"auroc": interval, "vs_features": paired difference}`` (95% intervals over
    articles; the difference to the calibration's features on the same answers)."""
    articles = [r["title"] for r in rows]
    em = [r["em"] for r in rows]
    base = list(DEFAULT_FEATURES)
    sets = {
        "calibration's features": base,
        **{f"without {a}": [n for n in base if n != a] for a in ADDED_FEATURES},
        **{f"+ {s}": [*base, s] for s in DECODER_SIGNALS},
        "+ all three": [*base, *DECODER_SIGNALS],
    }
    reference = cross_fitted_confidence(features, rows, base)
    out = {}
    for label, names in sets.items():
        # the reference is the first set's confidence: fitted once, not again
        conf = reference if names is base else cross_fitted_confidence(features, rows, names)
        out[label] = {
            "auroc": measure_ci(auroc, conf, em, articles).as_dict(),
            "vs_features": paired_measure_ci(auroc, conf, reference, em, articles).as_dict(),
        }
    return out


def _em_at_half(conf: Sequence[float], em: Sequence[float]) -> float:
    return precision_at_coverage(conf, em, 0.5)


def confidence_metrics(conf: list[float], rows: list[dict]) -> dict:
    em = [r["em"] for r in rows]
    articles = [r["title"] for r in rows]
    return {
        "ece": expected_calibration_error(conf, em),
        "auroc": auroc(conf, em),
        # the two targets, with 95% intervals over articles
        "auroc_interval": measure_ci(auroc, conf, em, articles).as_dict(),
        "em_at_half_interval": measure_ci(_em_at_half, conf, em, articles).as_dict(),
        "em_at_coverage": {str(c): precision_at_coverage(conf, em, c) for c in COVERAGES},
        "threshold_at_coverage": {str(c): threshold_for_coverage(conf, c) for c in COVERAGES},
        "reliability": [asdict(b) for b in reliability_bins(conf, em)],
    }


def save_calibration(
    system: ReaderSystem, features: list[dict[str, float]], rows: list[dict], out: Path
) -> Path | None:
    """The logistic calibration of ``system`` fitted on all its development answers, written to
    ``out/calibration/<system>/`` (to ship beside its generator: docs/results.md); None when
    its answers are all right or all wrong (nothing to fit)."""
    if len({r["em"] for r in rows}) < 2:
        return None
    calibration = fit_logistic_calibration(
        features,
        [r["em"] for r in rows],
        fitted_on={
            "system": system.name,
            "questions": len(rows),
            "articles": sorted({r["title"] for r in rows}),
            "protocol": "openbook experiments trust: the development articles' answers",
        },
    )
    slug = "".join(c if c.isalnum() else "-" for c in system.name.lower()).strip("-")
    directory = out / "calibration" / slug
    directory.mkdir(parents=True, exist_ok=True)
    return calibration.save(directory)


def reader_metrics(rows: list[dict], baseline: list[dict] | None) -> dict:
    groups = [r["title"] for r in rows]
    em = [r["em"] for r in rows]
    conf = [confidence_of(r) for r in rows]
    out: dict = {
        "questions": len(rows),
        "em": bootstrap_ci(em, groups).as_dict(),
        "f1": bootstrap_ci([r["f1"] for r in rows], groups).as_dict(),
        **confidence_metrics(conf, rows),
    }
    if baseline is not None:
        out["em_vs_baseline"] = paired_difference_ci(
            em, [r["em"] for r in baseline], groups
        ).as_dict()
    return out


def run_trust(
    config: TrustConfig, *, readers: bool = True
) -> tuple[TrustResult, dict[str, list[dict]]]:
    """The measurements, and each system's prediction rows (for the pictures)."""
    dev_titles, _, dev = development_questions(config)
    result = TrustResult(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        dev_articles=dev_titles,
        questions=len(dev),
    )
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    by_system: dict[str, list[dict]] = {}
    with open_index(Path(config.index_root) / config.index, verify=False) as index:
        measure_retrieval(config, index, dev, result)
        measure_fusion_kfold(config, index, result)
        if readers:
            log = ResultLog(out / "predictions.jsonl")
            baseline: list[dict] | None = None
            for system in config.systems:
                rows = _answer_rows(system, config, index, dev, log)
                by_system[system.name] = rows
                result.readers[system.name] = metrics = reader_metrics(rows, baseline)
                baseline = baseline or rows
                other = by_system.get(system.compare_with or "")
                if other is not None:
                    metrics["em_vs_other"] = {
                        "versus": system.compare_with,
                        **paired_difference_ci(
                            [r["em"] for r in rows],
                            [r["em"] for r in other],
                            [r["title"] for r in rows],
                        ).as_dict(),
                        # the same answer text, question by question
                        "identical": sum(
                            a["answer"] == b["answer"] for a, b in zip(rows, other, strict=True)
                        )
                        / len(rows),
                    }
                features = answer_feature_rows(system, config, index, rows)
                calibrated = cross_fitted_confidence(features, rows)
                metrics["calibrated"] = confidence_metrics(calibrated, rows)
                if len({r["em"] for r in rows}) == 2:  # AUROC needs right and wrong answers
                    metrics["signal_ablation"] = signal_ablation(features, rows)
                for row, c in zip(rows, calibrated, strict=True):
                    row["calibrated_confidence"] = c  # for the pictures; not logged
                save_calibration(system, features, rows, out)
    (out / "result.json").write_text(json.dumps(asdict(result), indent=2) + "\n")
    return result, by_system


def _interval(d: dict, scale: float = 100.0, digits: int = 1) -> str:
    return Interval(d["mean"], d["low"], d["high"]).text(scale, digits)


def _recall_table(
    recall: dict[str, dict[str, dict]], gain: dict[str, dict], ks: list[str]
) -> list[str]:
    """A Markdown table of recall@k per retrieval mode, then hybrid's gain (a blank line first)."""
    lines = [
        "",
        "| retrieval | " + " | ".join(f"k={k}" for k in ks) + " |",
        "|---|" + "---|" * len(ks),
    ]
    for label, by_k in recall.items():
        lines.append(f"| {label} | " + " | ".join(_interval(by_k[k]) for k in ks) + " |")
    return lines + _gain_row(gain, ks)


def _gain_row(gain: dict[str, dict], ks: list[str]) -> list[str]:
    if not gain:
        return []
    cells = " | ".join(f"{_interval(gain[k])} (vs {gain[k]['versus'].split(' ')[0]})" for k in ks)
    return [f"| hybrid − the better single view (paired) | {cells} |"]


def markdown(result: TrustResult, pictures: dict[str, str] | None = None) -> str:
    c = result.config
    ks = [str(k) for k in c["recall_ks"]]
    lines = [
        f"{result.questions} questions of the {len(result.dev_articles)} development articles "
        f"(never trained or fitted on): {', '.join(result.dev_articles)}. Index "
        f"`{c['index']}`; 95% intervals from a bootstrap over articles.",
        "",
        "Answer found in the top k passages (%):",
        *_recall_table(result.recall, result.recall_gain, ks),
    ]
    if result.recall_kfold:
        n = sum(f["questions"] for f in result.fusion_folds)
        lines += [
            "",
            f"{c['folds']}-fold over all articles ({n} questions; each fold's fusion fitted on "
            "the other folds' articles):",
            *_recall_table(result.recall_kfold, result.recall_gain_kfold, ks),
        ]
    if result.readers:
        lines += [
            "",
            f"| system | questions | EM | F1 | EM − {next(iter(result.readers))} (paired) |",
            "|---|---|---|---|---|",
        ]
        for name, m in result.readers.items():
            diff = _interval(m["em_vs_baseline"]) if "em_vs_baseline" in m else "—"
            lines.append(
                f"| {name} | {m['questions']} | {_interval(m['em'])} | {_interval(m['f1'])} | "
                f"{diff} |"
            )
        lines += [
            f"\nPaired difference of {name} to {m['em_vs_other']['versus']}: EM "
            f"{_interval(m['em_vs_other'])} (95% interval over articles); the same answer "
            f"on {100 * m['em_vs_other'].get('identical', float('nan')):.1f}% of the questions."
            for name, m in result.readers.items()
            if "em_vs_other" in m
        ]
    if result.readers:
        lines += [
            "",
            "Confidence: raw (exp of the mean token log-probability under the RAG marginal) "
            "and calibrated (the logistic calibration over the answer's features, each "
            "article's answers scored by a calibration fitted on the other articles' — "
            "leave one article out):",
            "",
            "| system | confidence | AUROC | ECE | "
            + " | ".join(f"EM at {int(cv * 100)}%" for cv in COVERAGES)
            + " | EM at 50% (95% interval) | threshold for 50% |",
            "|---|---|---|---|" + "---|" * len(COVERAGES) + "---|---|",
        ]
        for name, m in result.readers.items():
            for kind, cm in (("raw", m), ("calibrated", m.get("calibrated"))):
                if cm is None:
                    continue
                cov = " | ".join(f"{100 * cm['em_at_coverage'][str(cv)]:.1f}" for cv in COVERAGES)
                lines.append(
                    f"| {name} | {kind} | {_interval(cm['auroc_interval'], 1, 3)} | "
                    f"{cm['ece']:.3f} | {cov} | {_interval(cm['em_at_half_interval'])} | "
                    f"{cm['threshold_at_coverage']['0.5']:.3f} |"
                )
    ablations = {
        n: m["signal_ablation"] for n, m in result.readers.items() if "signal_ablation" in m
    }
    if ablations:
        lines += [
            "",
            "AUROC of the calibrated confidence over other features (leave one article out; "
            "95% intervals over articles, and the paired difference to the calibration's "
            "features): without each feature added since the first calibration ("
            + ", ".join(f"`{a}`" for a in ADDED_FEATURES)
            + "), and with the decoder's own signals added "
            "(the weakest and the first answer token's log-probability under the RAG marginal, "
            "the entropy of the final passage posterior p(z|x,y)):",
            "",
            "| system | features | AUROC | − calibration's features (paired) |",
            "|---|---|---|---|",
        ]
        for name, ablation in ablations.items():
            for label, m in ablation.items():
                diff = (
                    "—" if label == "calibration's features" else _interval(m["vs_features"], 1, 3)
                )
                lines.append(f"| {name} | {label} | {_interval(m['auroc'], 1, 3)} | {diff} |")
    for title, path in (pictures or {}).items():
        lines += ["", f"![{title}]({path})"]
    return "\n".join(lines)


def plot_confidence(result: TrustResult, out_dir: Path) -> dict[str, Path]:
    """A reliability diagram and an EM-vs-coverage curve per system (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths: dict[str, Path] = {}
    if not result.readers:
        return paths
    fig, ax = plt.subplots(figsize=(5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", linestyle=":", label="perfectly calibrated")
    for name, m in result.readers.items():
        for kind, cm, style in (("raw", m, "--"), ("calibrated", m.get("calibrated"), "-")):
            if cm is None:
                continue
            bins = [b for b in cm["reliability"] if b["count"]]
            ax.plot(
                [b["confidence"] for b in bins],
                [b["accuracy"] for b in bins],
                marker="o",
                linestyle=style,
                label=f"{name}, {kind} (ECE {cm['ece']:.3f})",
            )
    paths["reliability"] = _save_plot(
        fig,
        ax,
        "Reliability on the development articles",
        ("confidence (bin mean)", "exact match (bin share)"),
        out_dir / "trust_reliability.png",
    )
    return paths


def plot_coverage(
    result: TrustResult, rows_of: Callable[[str], list[dict]], out_dir: Path
) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not result.readers:
        return None
    fig, ax = plt.subplots(figsize=(5, 4))
    grid = [i / 20 for i in range(2, 21)]
    for name in result.readers:
        rows = rows_of(name)
        em = [r["em"] for r in rows]
        kinds = [("raw", [confidence_of(r) for r in rows], "--")]
        if all("calibrated_confidence" in r for r in rows):
            kinds.append(("calibrated", [r["calibrated_confidence"] for r in rows], "-"))
        for kind, conf, style in kinds:
            ax.plot(
                [100 * g for g in grid],
                [100 * precision_at_coverage(conf, em, g) for g in grid],
                marker=".",
                linestyle=style,
                label=f"{name}, {kind}",
            )
    return _save_plot(
        fig,
        ax,
        "Abstaining on the least confident answers",
        ("coverage: answers kept (%)", "EM of the answers kept (%)"),
        out_dir / "trust_coverage.png",
    )


def _save_plot(fig, ax, title: str, labels: tuple[str, str], path: Path) -> Path:
    """Title, axis labels, legend and grid as both pictures have them; saved and closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
