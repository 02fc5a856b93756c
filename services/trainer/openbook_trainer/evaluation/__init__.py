"""Scoring predictions (metrics) and the ``openbook eval`` command (cli)."""

from openbook_trainer.evaluation.metrics import (
    accuracy,
    answer_recall_at_k,
    bleu,
    exact_match,
    f1_score,
    generation_scores,
    has_answer,
    normalize_answer,
    qa_scores,
    recall_at_k,
    rouge_l,
)

__all__ = [
    "accuracy",
    "answer_recall_at_k",
    "bleu",
    "exact_match",
    "f1_score",
    "generation_scores",
    "has_answer",
    "normalize_answer",
    "qa_scores",
    "recall_at_k",
    "rouge_l",
]
