"""Producing predictions (from local models or a running gateway) and scoring them."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from openbook.types import Passage
from openbook_trainer.evaluation.data import Example
from openbook_trainer.evaluation.metrics import (
    accuracy,
    answer_recall_at_k,
    exact_match,
    generation_scores,
    qa_scores,
    recall_at_k,
)

TASKS = ("qa", "generation", "classification")


class EvalError(RuntimeError):
    """The system under evaluation failed to answer; the message says which request."""


@dataclass
class Prediction:
    answer: str
    passage_ids: list[str] = field(default_factory=list)
    passage_texts: list[str] = field(default_factory=list)
    model_version: str = ""
    # the answer's confidence and the uncalibrated value (openbook/rag/confidence.py); None: a
    # system that does not report them
    confidence: float | None = None
    raw_confidence: float | None = None
    # the answer's confidence features (openbook.rag.confidence.confidence_features), what a
    # logistic calibration is fitted on; None: a system that does not report what they need
    features: dict[str, float] | None = None


def score_predictions(
    task: str, examples: Sequence[Example], predictions: Sequence[Prediction], k: int
) -> dict[str, float]:
    """Task metrics plus retrieval recall@1 / recall@k (percentages) and ``n``.

    Recall uses the examples' ``gold_ids`` when every example has them, otherwise (QA only)
    DPR's answer-string match in the retrieved passage text.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {TASKS}, got {task!r}")
    answers = [p.answer for p in predictions]
    golds = [e.answers for e in examples]
    if task == "qa":
        out = qa_scores(answers, golds)
    elif task == "generation":
        out = generation_scores(answers, golds)
    else:
        out = {"accuracy": accuracy(answers, golds)}
    if any(p.passage_ids for p in predictions):
        ks = sorted({1, k})
        if all(e.gold_ids for e in examples):
            ids = [p.passage_ids for p in predictions]
            for kk in ks:
                out[f"recall@{kk}"] = recall_at_k(ids, [e.gold_ids for e in examples], kk)
        elif task == "qa":
            texts = [p.passage_texts for p in predictions]
            for kk in ks:
                out[f"answer_recall@{kk}"] = answer_recall_at_k(texts, golds, kk)
    out["n"] = float(len(predictions))
    return out


def per_example_correct(
    examples: Sequence[Example], predictions: Sequence[Prediction]
) -> list[float]:
    """1.0 where a prediction matches (normalised exact match) one of its example's answers:
    the outcome a confidence calibration is fitted to."""
    return [exact_match(p.answer, e.answers) for e, p in zip(examples, predictions, strict=True)]


def features_of_answer(
    hypothesis: dict[str, Any], passages: Sequence[dict[str, Any]], question: str
) -> dict[str, float] | None:
    """The confidence features (:func:`openbook.rag.confidence.confidence_features`) of a
    ``/answer`` reply's hypothesis, from what the reply carries: its ``text``, ``log_prob``,
    ``raw_confidence`` (``mean_log_prob`` is its log), ``finish_reason`` and passage posterior
    (``doc_posterior``, or its last token's ``posterior``), and the passages' ``text`` and
    ``prior``; ``question``: the question asked. None when the reply lacks any of them (an
    older gateway)."""
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook.rag.confidence import LOG_PROB_FLOOR, answer_features, normalized_texts

    log_prob, raw = hypothesis.get("log_prob"), hypothesis.get("raw_confidence")
    priors = [p.get("prior") for p in passages]
    if log_prob is None or raw is None or any(v is None for v in priors):
        return None
    mean = math.log(raw) if raw > 0 else LOG_PROB_FLOOR
    # p(z|x,y): RAG-Sequence's doc_posterior, RAG-Token's posterior after the last token
    tokens = hypothesis.get("tokens") or []
    posterior = hypothesis.get("doc_posterior") or (tokens[-1]["posterior"] if tokens else None)
    return answer_features(
        text=hypothesis.get("text", ""),
        log_prob=float(log_prob),
        mean_log_prob=mean,
        finish_reason=hypothesis.get("finish_reason") or "stop",
        normalized=normalized_texts([p.get("text", "") for p in passages]),
        doc_prior=[float(v) for v in priors if v is not None],  # none is None: see above
        posterior=posterior,
        question=question,
    )


def predict_local(
    examples: Sequence[Example],
    *,
    retrieve: Callable[[list[str]], list[list[Passage]]],
    generator: Any,
    options: Any,
    batch_size: int = 16,
    progress: Callable[[int], None] | None = None,
) -> list[Prediction]:
    """Retrieve + generate in-process. ``retrieve`` maps questions to top-k passages with scores;
    ``generator`` is a :class:`openbook.rag.RagGenerator`, ``options`` its DecodingOptions."""
    # why: transformers stays out of the CLI's startup (`openbook --help` imports every command)
    from openbook.rag.confidence import confidence_features

    out: list[Prediction] = []
    version = getattr(generator, "model_version", "")
    for lo in range(0, len(examples), batch_size):
        chunk = examples[lo : lo + batch_size]
        questions = [e.question for e in chunk]
        hits = retrieve(questions)
        results = generator.generate_batch(
            [(q, h, options) for q, h in zip(questions, hits, strict=True)]
        )
        for q, h, r in zip(questions, hits, results, strict=True):
            best = r.hypotheses[0] if r.hypotheses else None
            out.append(
                Prediction(
                    best.text if best is not None else "",
                    [p.id for p in h],
                    [p.text for p in h],
                    version,
                    confidence=best.confidence if best is not None else 0.0,
                    raw_confidence=best.raw_confidence if best is not None else 0.0,
                    features=(
                        confidence_features(best, h, r.doc_prior, question=q)
                        if best is not None
                        else None
                    ),
                )
            )
        if progress is not None:
            progress(len(chunk))
    return out


def predict_http(
    examples: Sequence[Example],
    url: str,
    *,
    k: int,
    decoding: str,
    num_beams: int = 1,
    max_new_tokens: int = 32,
    index: str | None = None,
    timeout_s: float = 120.0,
    concurrency: int = 4,
    headers: dict[str, str] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Prediction]:
    """Ask a running gateway's ``POST /answer`` for every example (``concurrency`` at a time)."""
    import httpx

    endpoint = url.rstrip("/") + "/answer"

    def body(e: Example) -> dict[str, Any]:
        b: dict[str, Any] = {
            "question": e.question,
            "k": k,
            "decoding": decoding,
            "num_beams": num_beams,
            "max_new_tokens": max_new_tokens,
            # cached answers would hide a model change between two evaluations
            "use_cache": False,
        }
        if index:
            b["index"] = index
        return b

    with httpx.Client(timeout=timeout_s, headers=headers) as client:

        def ask(e: Example) -> Prediction:
            try:
                r = client.post(endpoint, json=body(e))
            except httpx.HTTPError as exc:
                raise EvalError(f"{endpoint}: example {e.id}: {exc}") from None
            if r.status_code != 200:
                raise EvalError(f"{endpoint}: example {e.id}: HTTP {r.status_code}: {r.text[:300]}")
            data = r.json()
            if progress is not None:
                progress(1)
            passages = data.get("passages", [])
            best = (data.get("hypotheses") or [{}])[0]
            # the model's answer even where the server's default threshold withheld it
            answer = best.get("text", "") if data.get("abstained") else data.get("answer", "")
            return Prediction(
                answer,
                [p["id"] for p in passages],
                [p.get("text", "") for p in passages],
                data.get("model_version", ""),
                confidence=data.get("confidence"),
                raw_confidence=best.get("raw_confidence"),
                features=features_of_answer(best, passages, e.question),
            )

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(ask, examples))
