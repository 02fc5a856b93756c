"""How confident the model is in an answer: the one definition every service and client uses.

Raw confidence
--------------
``raw_confidence = exp(log_prob / n)``: the geometric-mean per-token probability of the answer
under the RAG marginal, where ``log_prob`` is :attr:`Hypothesis.log_prob` (log p(y|x)
marginalised over the passages) and ``n`` is :attr:`Hypothesis.scored_tokens`, the number of
answer tokens whose log-probabilities ``log_prob`` sums. Which tokens those are follows how the
decoders score an answer (so that the normalisation divides by exactly the terms summed):

* RAG-Token (:mod:`openbook.rag.rag_token`): every generated token, the forced BOS of BART-style
  models, EOS and the tokens of a stop string included: ``n = len(token_ids)``.
* RAG-Sequence thorough (:mod:`openbook.rag.rag_sequence`, scored as transformers' ``get_nll``):
  every generated token that is not the padding id, less the first one when every candidate
  starts with BOS (``exclude_bos_score``); EOS counts, unless the model pads with its EOS id
  (causal LMs often do), which the scoring then masks too.
* RAG-Sequence fast: every generated token, less the first under the same BOS rule.

The value lies in [0, 1]: a ``log_prob`` above 0 (transformers' RAG-Sequence score drops the
prior of a candidate whose second token is padding) is taken as 0; an answer with no scored
token (empty) or an impossible one (``log_prob`` -inf or NaN) gets 0, never a division by zero.

Calibration
-----------
Geometric-mean probabilities are not probabilities of being right. A calibration maps an
answer to the probability that it is correct, fitted on training questions, and is stored
beside the model as ``confidence_calibration.json`` (:data:`CALIBRATION_FILE`) in the
generator directory or in a generator adapter's directory (the adapter's wins: it is the model
that was fitted). It is read and validated when the model loads (:func:`load_calibration`); a
bad file stops the load with an error naming it. Two kinds exist, told apart by the file's
``"kind"`` (:data:`AnyCalibration` is either):

* ``"piecewise-linear"`` (:class:`Calibration`): a monotone piecewise-linear map of raw
  confidence, fitted by isotonic regression. Being monotone, it makes confidences
  probabilities but cannot rank right answers above wrong ones any better than raw confidence
  does (same AUROC).
* ``"logistic"`` (:class:`LogisticCalibration`): ``sigmoid(bias + sum_i w_i * f_i)`` over
  named features of the answer (:func:`confidence_features`), fitted by L2-penalised logistic
  regression. It uses what the generator knows beyond the answer's probability: how peaked
  the passage prior is, whether the answer is written in the passages and how much prior and
  posterior mass those carry, and whether ``max_new_tokens`` cut the answer; so it can
  separate right from wrong answers better than any map of raw confidence. The engine
  computes the features only for a model whose calibration reads them (``needs_features``).

This module applies a fitted file; fitting is an offline job, the trainer's
(``openbook_trainer.calibration``, with scikit-learn), which writes the same files.

Features
--------
:func:`confidence_features` computes every feature from one hypothesis, the request's passages
(in the order the generator read them) and the document prior p(z|x) over them:

* ``log_prob``: log p(y|x), clipped to [-50, 0] (-inf or NaN: -50);
* ``mean_log_prob``: ``log_prob / scored_tokens`` clipped to [-50, 0], -50 for an answer with
  no scored token (or a non-finite ``log_prob``): ``exp(mean_log_prob) == raw_confidence``
  wherever ``raw_confidence >= exp(-50)``, so a client that sees only ``raw_confidence``
  recovers it (:func:`answer_features`);
* ``max_prior``: max_z p(z|x), the prior of the top passage (0 with no passage);
* ``answer_in_top_passage``: 1.0 when the SQuAD-normalised answer
  (:func:`openbook.rag.answers.normalize_answer`) is non-empty and a substring of the normalised
  text of the passage with the highest prior (the first one on ties), else 0.0;
* ``prior_with_answer``: the sum of p(z|x) over the passages whose normalised text contains
  the normalised (non-empty) answer, in [0, 1];
* ``cut_by_length``: 1.0 when the answer's ``finish_reason`` is ``"length"``, else 0.0;
* ``posterior_with_answer``: the same sum over the passage *posterior* p(z|x,y), the passages
  the answer was written from (:func:`answer_posterior`: RAG-Sequence's ``doc_posterior``,
  RAG-Token's posterior after the last token; the prior where a hypothesis has neither), in
  [0, 1]. Added after ``openbook experiments trust`` measured it on held-out articles
  (docs/results.md): the model leaning on passages that do not hold its answer is a sign the
  answer is made up;
* ``question_near_answer``: the largest share of the question's content words (its
  SQuAD-normalised words less :data:`QUESTION_STOPWORDS`, English function words) found within
  :data:`NEAR_ANSWER_WORDS` words of an occurrence of the normalised answer in a passage, in
  [0, 1]; 0 when no passage holds the answer or the question has no content word. A check from
  outside the model: an answer found next to what was asked about is more often the right one
  (measured in docs/results.md, like the feature above).

A passage's text is its ``text`` (not its title). :func:`calibrate_row` applies any calibration
to a row of these features (a piecewise-linear one reads ``exp(mean_log_prob)``), so a fitted
calibration can be scored on logged rows without a model.

Every hypothesis carries both: ``raw_confidence`` (always the definition above) and
``confidence`` (the calibrated value when the model has a calibration, else the raw one).
Abstention thresholds apply to ``confidence``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from openbook.errors import InvalidArgument
from openbook.rag.answers import normalize_answer
from openbook.rag.errors import ModelLoadError

if TYPE_CHECKING:
    from openbook.rag.options import Hypothesis
    from openbook.types import Passage

CALIBRATION_FILE = "confidence_calibration.json"
CALIBRATION_KIND = "piecewise-linear"
LOGISTIC_KIND = "logistic"
CALIBRATION_KINDS = (LOGISTIC_KIND, CALIBRATION_KIND)

# The floor of the log-probability features: an impossible or empty answer sits here, and a
# few extreme answers cannot dominate a fitted weight.
LOG_PROB_FLOOR = -50.0

# Every feature confidence_features computes, in the order a default logistic fit uses them
# (module docstring says what each is).
FEATURES = (
    "log_prob",
    "mean_log_prob",
    "max_prior",
    "answer_in_top_passage",
    "prior_with_answer",
    "cut_by_length",
    "posterior_with_answer",
    "question_near_answer",
)
DEFAULT_FEATURES = FEATURES

# question_near_answer: how near (in words, either side) the question's words must be to the
# answer, and the words that say nothing about what is asked (English: the demo's language; in
# another language they simply count as content words)
NEAR_ANSWER_WORDS = 20
_STOPWORDS = """a an the of in on at to for by with from and or is are was were be been being
what which who whom whose when where why how did do does that this these those it its as into
than then there their they he she his her i you we not no"""
QUESTION_STOPWORDS = frozenset(_STOPWORDS.split())


def raw_confidence(log_prob: float, scored_tokens: int) -> float:
    """exp(log_prob / scored_tokens) in [0, 1] (module docstring); 0 when nothing was scored."""
    if scored_tokens <= 0 or not math.isfinite(log_prob):
        return 0.0
    return math.exp(min(log_prob, 0.0) / scored_tokens)


@dataclass(frozen=True)
class Calibration:
    """A monotone map [0, 1] -> [0, 1]: linear between knots ``(x[i], y[i])``, flat beyond the
    first and last knot.

    Invariants (checked by :meth:`validate`): at least one knot, ``x`` strictly increasing,
    ``y`` non-decreasing, every value finite and in [0, 1].
    """

    x: tuple[float, ...]
    y: tuple[float, ...]
    fitted_on: int = 0  # questions it was fitted on (information only)

    def validate(self) -> None:
        """Raise :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) naming the field
        of the first broken invariant."""
        if len(self.x) != len(self.y):
            raise InvalidArgument(f"x and y differ in length ({len(self.x)} vs {len(self.y)})")
        if not self.x:
            raise InvalidArgument("x and y: at least one knot is needed")
        for name, values in (("x", self.x), ("y", self.y)):
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                    raise InvalidArgument(f"{name}[{i}] must be a number in [0, 1], got {v!r}")
        for i in range(1, len(self.x)):
            if not self.x[i] > self.x[i - 1]:
                raise InvalidArgument(
                    f"x must be strictly increasing: x[{i}] = {self.x[i]} follows {self.x[i - 1]}"
                )
            if self.y[i] < self.y[i - 1]:
                raise InvalidArgument(
                    f"y must be non-decreasing: y[{i}] = {self.y[i]} follows {self.y[i - 1]}"
                )

    # a piecewise-linear map reads raw confidence only
    needs_features = False

    def __call__(self, raw: float) -> float:
        """The calibrated confidence of a raw one."""
        return float(np.interp(raw, self.x, self.y))

    def to_json(self) -> dict:
        return _as_json(CALIBRATION_KIND, self)

    @classmethod
    def from_json(cls, data: object) -> Calibration:
        """Raise :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) naming the field,
        for anything but a valid calibration object."""
        data = _object_of_kind(data, CALIBRATION_KIND)
        x, y = data.get("x"), data.get("y")
        if not isinstance(x, list) or not isinstance(y, list):
            raise InvalidArgument("x and y must be lists of numbers")
        fitted_on = data.get("fitted_on", 0)
        if isinstance(fitted_on, bool) or not isinstance(fitted_on, int) or fitted_on < 0:
            raise InvalidArgument(f"fitted_on must be a non-negative integer, got {fitted_on!r}")
        calibration = cls(tuple(x), tuple(y), fitted_on)
        calibration.validate()
        return calibration

    def save(self, directory: str | Path) -> Path:
        """Write :data:`CALIBRATION_FILE` into ``directory``; returns its path."""
        return _save(self.to_json(), directory)


@dataclass(frozen=True)
class LogisticCalibration:
    """``confidence = sigmoid(bias + sum_i weights[i] * f[features[i]])`` over an answer's
    named features (:func:`confidence_features`).

    Invariants (checked by :meth:`validate`): ``features`` are distinct names of
    :data:`FEATURES`; ``weights`` has one finite number per feature; ``bias`` is finite.
    ``fitted_on`` is free-form provenance (questions, data, model), stored as it is.
    """

    features: tuple[str, ...]
    weights: tuple[float, ...]
    bias: float
    fitted_on: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # the engine computes an answer's features only for a calibration that reads them
    needs_features = True

    def validate(self) -> None:
        """Raise :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) naming the field
        of the first broken invariant."""
        for i, name in enumerate(self.features):
            if not isinstance(name, str) or name not in FEATURES:
                raise InvalidArgument(
                    f"features[{i}] must be one of {', '.join(FEATURES)}, got {name!r}"
                )
        if len(set(self.features)) != len(self.features):
            raise InvalidArgument(f"features must be distinct, got {list(self.features)}")
        if len(self.weights) != len(self.features):
            raise InvalidArgument(
                f"features and weights differ in length ({len(self.features)} vs "
                f"{len(self.weights)})"
            )
        for i, w in enumerate(self.weights):
            if not _finite_number(w):
                raise InvalidArgument(f"weights[{i}] must be a finite number, got {w!r}")
        if not _finite_number(self.bias):
            raise InvalidArgument(f"bias must be a finite number, got {self.bias!r}")

    def __call__(self, features: Mapping[str, float]) -> float:
        """The calibrated confidence of an answer with these features (a row of
        :func:`confidence_features`; extra names are ignored, a missing one is a KeyError)."""
        z = self.bias + sum(
            w * float(features[n]) for n, w in zip(self.features, self.weights, strict=True)
        )
        return _sigmoid(z)

    def to_json(self) -> dict:
        return _as_json(LOGISTIC_KIND, self)

    @classmethod
    def from_json(cls, data: object) -> LogisticCalibration:
        """Raise :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) naming the field,
        for anything but a valid logistic calibration object."""
        data = _object_of_kind(data, LOGISTIC_KIND)
        features, weights = data.get("features"), data.get("weights")
        if not isinstance(features, list) or not isinstance(weights, list):
            raise InvalidArgument("features and weights must be lists")
        if "bias" not in data:
            raise InvalidArgument("bias is missing")
        fitted_on = data.get("fitted_on", {})
        if not isinstance(fitted_on, dict):
            raise InvalidArgument(f"fitted_on must be a JSON object, got {fitted_on!r}")
        calibration = cls(tuple(features), tuple(weights), data["bias"], fitted_on)
        calibration.validate()
        return cls(
            calibration.features,
            tuple(float(w) for w in calibration.weights),
            float(calibration.bias),
            fitted_on,
        )

    def save(self, directory: str | Path) -> Path:
        """Write :data:`CALIBRATION_FILE` into ``directory``; returns its path."""
        return _save(self.to_json(), directory)


# Either kind: what a model carries and the engine applies.
AnyCalibration = Calibration | LogisticCalibration


def calibration_from_json(data: object) -> AnyCalibration:
    """The calibration of either kind in ``data`` (by its ``"kind"``);
    :class:`~openbook.errors.InvalidArgument` (a ``ValueError``) when it is not a valid one."""
    if not isinstance(data, dict):
        raise InvalidArgument("expected a JSON object")
    kind = data.get("kind")
    if kind == LOGISTIC_KIND:
        return LogisticCalibration.from_json(data)
    if kind == CALIBRATION_KIND:
        return Calibration.from_json(data)
    raise InvalidArgument(
        f"kind must be one of {', '.join(map(repr, CALIBRATION_KINDS))}, got {kind!r}"
    )


def _object_of_kind(data: object, kind: str) -> dict[str, Any]:
    """``data``, a JSON object whose ``"kind"`` is ``kind``; ``InvalidArgument`` otherwise."""
    if not isinstance(data, dict):
        raise InvalidArgument("expected a JSON object")
    if data.get("kind") != kind:
        raise InvalidArgument(f"kind must be {kind!r}, got {data.get('kind')!r}")
    return data


def _as_json(kind: str, calibration: AnyCalibration) -> dict[str, Any]:
    """``calibration`` as a JSON object: its ``kind``, then its fields in order (tuples as
    lists)."""
    data: dict[str, Any] = {"kind": kind}
    for f in fields(calibration):
        value = getattr(calibration, f.name)
        data[f.name] = list(value) if isinstance(value, tuple | list) else value
    return data


def _save(data: dict[str, Any], directory: str | Path) -> Path:
    path = Path(directory) / CALIBRATION_FILE
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def _finite_number(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _sigmoid(z: float) -> float:
    # the two branches keep exp from overflowing for large |z|
    if z >= 0:
        return 1.0 / (1.0 + math.exp(-z))
    e = math.exp(z)
    return e / (1.0 + e)


def load_calibration(directory: str | Path) -> AnyCalibration | None:
    """The calibration (either kind) stored in ``directory``, or None when it has none.

    Raises :class:`ModelLoadError` naming the file when it is unreadable or invalid: a model
    whose calibration is broken must not serve uncalibrated confidences silently."""
    path = Path(directory) / CALIBRATION_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
        return calibration_from_json(data)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"invalid confidence calibration {path}: {e}") from None


def _no_constant(name: str) -> float:
    raise InvalidArgument(f"{name} is not a number")


def mean_log_prob(log_prob: float, scored_tokens: int) -> float:
    """``log_prob / scored_tokens`` clipped to [:data:`LOG_PROB_FLOOR`, 0]; the floor for an
    answer with no scored token or a non-finite ``log_prob``. Its exp is
    :func:`raw_confidence` (above the floor)."""
    if scored_tokens <= 0 or not math.isfinite(log_prob):
        return LOG_PROB_FLOOR
    return min(0.0, max(LOG_PROB_FLOOR, log_prob / scored_tokens))


def normalized_texts(passages: Sequence[Passage | str]) -> list[str]:
    """The SQuAD-normalised text of each passage (a :class:`Passage`'s ``text``, or a string):
    what :func:`confidence_features` looks for the answer in. Compute it once per request
    and pass it to every hypothesis' features."""
    return [normalize_answer(p if isinstance(p, str) else p.text) for p in passages]


def answer_posterior(hypothesis: Hypothesis) -> list[float] | None:
    """p(z|x,y) of a hypothesis' passages: RAG-Sequence's ``doc_posterior``, RAG-Token's
    posterior after its last token (``token_doc_posteriors[-1]``), or None (neither: e.g. an
    answer with no token)."""
    if hypothesis.doc_posterior is not None:
        return list(hypothesis.doc_posterior)
    if hypothesis.token_doc_posteriors:
        return list(hypothesis.token_doc_posteriors[-1])
    return None


def question_near_answer(question: str, answer: str, normalized: Sequence[str]) -> float:
    """The ``question_near_answer`` feature (module docstring): ``normalized`` are the passages'
    :func:`normalized_texts`."""
    asked = {w for w in normalize_answer(question).split() if w not in QUESTION_STOPWORDS}
    words = normalize_answer(answer).split()
    n = len(words)
    if not asked or not n:
        return 0.0
    best = 0
    for text in normalized:
        tokens = text.split()
        for i in range(len(tokens) - n + 1):
            if tokens[i : i + n] == words:
                near = tokens[max(0, i - NEAR_ANSWER_WORDS) : i + n + NEAR_ANSWER_WORDS]
                best = max(best, len(asked.intersection(near)))
    return best / len(asked)


def confidence_features(
    hypothesis: Hypothesis,
    passages: Sequence[Passage | str],
    doc_prior: Sequence[float],
    *,
    question: str = "",
    normalized: Sequence[str] | None = None,
) -> dict[str, float]:
    """The features (:data:`FEATURES`, module docstring) of one hypothesis of a request whose
    passages, in the generator's order, had the prior ``doc_prior`` (p(z|x), one per passage).

    ``passages``: the request's passages (or their texts); ``question``: the request's question
    (empty: ``question_near_answer`` is 0); ``normalized``: the passages'
    :func:`normalized_texts` when already computed (then ``passages`` is not read again)."""
    return answer_features(
        text=hypothesis.text,
        log_prob=hypothesis.log_prob,
        mean_log_prob=mean_log_prob(hypothesis.log_prob, hypothesis.scored_tokens),
        finish_reason=hypothesis.finish_reason,
        normalized=normalized if normalized is not None else normalized_texts(passages),
        doc_prior=doc_prior,
        posterior=answer_posterior(hypothesis),
        question=question,
    )


def answer_features(
    *,
    text: str,
    log_prob: float,
    mean_log_prob: float,
    finish_reason: str,
    normalized: Sequence[str],
    doc_prior: Sequence[float],
    posterior: Sequence[float] | None = None,
    question: str = "",
) -> dict[str, float]:
    """:func:`confidence_features` from plain values: what a client of ``/answer`` has (its
    ``mean_log_prob`` is ``log(raw_confidence)``, or :data:`LOG_PROB_FLOOR` for 0).
    ``normalized``: the passages' :func:`normalized_texts`; ``posterior``: p(z|x,y) over them
    (:func:`answer_posterior`; None: the prior stands in); ``question``: the request's (empty:
    ``question_near_answer`` is 0). Raises ``InvalidArgument`` (a ``ValueError``) when
    ``normalized``, ``doc_prior`` and ``posterior`` differ in length."""
    if len(normalized) != len(doc_prior):
        raise InvalidArgument(
            f"passages and doc_prior differ in length ({len(normalized)} vs {len(doc_prior)})"
        )
    if posterior is not None and len(posterior) != len(doc_prior):
        raise InvalidArgument(
            f"posterior and doc_prior differ in length ({len(posterior)} vs {len(doc_prior)})"
        )
    prior = [float(p) for p in doc_prior]
    post = [float(p) for p in posterior] if posterior is not None else prior
    answer = normalize_answer(text)
    holds = [bool(answer) and answer in t for t in normalized]
    top = max(range(len(prior)), key=prior.__getitem__) if prior else None
    lp = min(0.0, max(LOG_PROB_FLOOR, log_prob)) if math.isfinite(log_prob) else LOG_PROB_FLOOR
    mlp = mean_log_prob if math.isfinite(mean_log_prob) else LOG_PROB_FLOOR
    return {
        "log_prob": lp,
        "mean_log_prob": min(0.0, max(LOG_PROB_FLOOR, mlp)),
        "max_prior": prior[top] if top is not None else 0.0,
        "answer_in_top_passage": 1.0 if top is not None and holds[top] else 0.0,
        "prior_with_answer": min(
            1.0, sum((p for p, h in zip(prior, holds, strict=True) if h), 0.0)
        ),
        "cut_by_length": 1.0 if finish_reason == "length" else 0.0,
        "posterior_with_answer": min(
            1.0, max(0.0, sum((p for p, h in zip(post, holds, strict=True) if h), 0.0))
        ),
        "question_near_answer": question_near_answer(question, text, normalized),
    }


def calibrate_row(calibration: AnyCalibration, features: Mapping[str, float]) -> float:
    """The confidence ``calibration`` gives an answer with these features (a row of
    :func:`confidence_features`, e.g. logged by ``openbook eval``): a logistic calibration
    reads its features, a piecewise-linear one ``exp(mean_log_prob)`` (raw confidence)."""
    if isinstance(calibration, LogisticCalibration):
        return calibration(features)
    mlp = float(features["mean_log_prob"])
    return calibration(math.exp(mlp) if mlp > LOG_PROB_FLOOR else 0.0)


def confidences(
    log_prob: float,
    scored_tokens: int,
    calibration: AnyCalibration | None,
    features: Mapping[str, float] | None = None,
) -> tuple[float, float]:
    """(raw_confidence, confidence) of one hypothesis under ``calibration`` (None: raw).
    A logistic calibration needs the hypothesis' ``features`` (:func:`confidence_features`)."""
    raw = raw_confidence(log_prob, scored_tokens)
    if calibration is None:
        return raw, raw
    if isinstance(calibration, LogisticCalibration):
        if features is None:
            raise InvalidArgument("features: a logistic calibration needs the answer's features")
        return raw, calibration(features)
    return raw, calibration(raw)
