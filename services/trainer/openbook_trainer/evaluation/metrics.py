"""Evaluation metrics of the RAG paper's tasks, one canonical implementation.

* Open-domain QA: SQuAD answer normalisation, Exact Match and token F1 (Rajpurkar et al., 2016),
  each the maximum over the gold answers as in the official SQuAD v1.1 script.
* Abstractive QA / question generation: corpus BLEU (sacrebleu) and ROUGE-L F-measure
  (rouge-score), the best over the references for ROUGE-L.
* Classification (FEVER label words): accuracy after the same normalisation.
* Retrieval: recall@k, the fraction of questions with a gold passage among the top k.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, cast

# SQuAD normalisation and the answer-in-passage test live in the core (the index fits its
# hybrid fusion with them); re-exported here with the metrics built on them.
from openbook.rag.answers import has_answer, normalize_answer


def _f1_one(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    if not pred_tokens or not gold_tokens:
        return float(pred_tokens == gold_tokens)
    common = Counter(pred_tokens) & Counter(gold_tokens)
    overlap = sum(common.values())
    if overlap == 0:
        return 0.0
    precision = overlap / len(pred_tokens)
    recall = overlap / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def f1_score(prediction: str, golds: Iterable[str]) -> float:
    """Bag-of-tokens F1 against the best-matching gold answer."""
    return max((_f1_one(prediction, g) for g in golds), default=0.0)


def _check_lengths(predictions: Sequence, references: Sequence) -> None:
    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions for {len(references)} references")


def qa_scores(predictions: Sequence[str], golds: Sequence[Sequence[str]]) -> dict[str, float]:
    """Mean EM and F1 in percent (the paper's convention)."""
    _check_lengths(predictions, golds)
    if not predictions:
        return {"em": 0.0, "f1": 0.0}
    n = len(predictions)
    em = sum(exact_match(p, g) for p, g in zip(predictions, golds, strict=True))
    f1 = sum(f1_score(p, g) for p, g in zip(predictions, golds, strict=True))
    return {"em": 100.0 * em / n, "f1": 100.0 * f1 / n}


def bleu(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus BLEU (sacrebleu defaults: 13a tokenisation, exp smoothing), 0-100.

    Questions may have different numbers of references; sacrebleu wants reference *streams*, so
    shorter lists are padded with None, which it skips.
    """
    import sacrebleu

    _check_lengths(predictions, references)
    if not predictions:
        return 0.0
    width = max(len(r) for r in references)
    streams = [[r[i] if i < len(r) else None for r in references] for i in range(width)]
    # sacrebleu skips None (a question with fewer references); its annotation says str only
    return float(sacrebleu.corpus_bleu(list(predictions), cast(Any, streams)).score)


def rouge_l(predictions: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Mean ROUGE-L F-measure (best reference per prediction, stemmed), 0-100."""
    from rouge_score import rouge_scorer

    _check_lengths(predictions, references)
    if not predictions:
        return 0.0
    scorer = rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)
    total = 0.0
    for pred, refs in zip(predictions, references, strict=True):
        total += max((scorer.score(ref, pred)["rougeL"].fmeasure for ref in refs), default=0.0)
    return 100.0 * total / len(predictions)


def generation_scores(
    predictions: Sequence[str], references: Sequence[Sequence[str]]
) -> dict[str, float]:
    return {"bleu": bleu(predictions, references), "rouge_l": rouge_l(predictions, references)}


def accuracy(predictions: Sequence[str], labels: Sequence[Sequence[str] | str]) -> float:
    """Percent of predictions equal (after normalisation) to the label or one of the labels."""
    _check_lengths(predictions, labels)
    if not predictions:
        return 0.0
    hits = 0
    for pred, gold in zip(predictions, labels, strict=True):
        golds = [gold] if isinstance(gold, str) else list(gold)
        hits += int(exact_match(pred, golds))
    return 100.0 * hits / len(predictions)


def recall_at_k(
    retrieved_ids: Sequence[Sequence[str]], gold_ids: Sequence[Iterable[str]], k: int
) -> float:
    """Percent of questions with at least one gold passage id among the first ``k`` retrieved."""
    _check_lengths(retrieved_ids, gold_ids)
    if not retrieved_ids:
        return 0.0
    hits = sum(bool(set(r[:k]) & set(g)) for r, g in zip(retrieved_ids, gold_ids, strict=True))
    return 100.0 * hits / len(retrieved_ids)


def answer_recall_at_k(
    retrieved_texts: Sequence[Sequence[str]], answers: Sequence[Sequence[str]], k: int
) -> float:
    """Percent of questions with an answer string in one of the first ``k`` passages.

    The retrieval metric of DPR/RAG when no gold passage is annotated.
    """
    _check_lengths(retrieved_texts, answers)
    if not retrieved_texts:
        return 0.0
    hits = sum(
        any(has_answer(t, a) for t in texts[:k])
        for texts, a in zip(retrieved_texts, answers, strict=True)
    )
    return 100.0 * hits / len(retrieved_texts)
