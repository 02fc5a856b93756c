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
Geometric-mean probabilities are not probabilities of being right. A :class:`Calibration` is a
monotone piecewise-linear map from raw confidence to the probability that the answer is
correct, fitted on training questions with :func:`fit_calibration` (isotonic regression by
pooled adjacent violators) and stored beside the model as ``confidence_calibration.json``
(:data:`CALIBRATION_FILE`) in the generator directory or in a generator adapter's directory
(the adapter's wins: it is the model that was fitted). It is read and validated when the model
loads (:func:`load_calibration`); a bad file stops the load with an error naming it.

Every hypothesis carries both: ``raw_confidence`` (always the definition above) and
``confidence`` (the calibrated value when the model has a calibration, else the raw one).
Abstention thresholds apply to ``confidence``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from openbook.rag.errors import ModelLoadError

CALIBRATION_FILE = "confidence_calibration.json"
CALIBRATION_KIND = "piecewise-linear"


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
        """Raise ``ValueError`` naming the first broken invariant."""
        if len(self.x) != len(self.y):
            raise ValueError(f"x and y differ in length ({len(self.x)} vs {len(self.y)})")
        if not self.x:
            raise ValueError("at least one knot is needed")
        for name, values in (("x", self.x), ("y", self.y)):
            for i, v in enumerate(values):
                if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                    raise ValueError(f"{name}[{i}] must be a number in [0, 1], got {v!r}")
        for i in range(1, len(self.x)):
            if not self.x[i] > self.x[i - 1]:
                raise ValueError(
                    f"x must be strictly increasing: x[{i}] = {self.x[i]} follows {self.x[i - 1]}"
                )
            if self.y[i] < self.y[i - 1]:
                raise ValueError(
                    f"y must be non-decreasing: y[{i}] = {self.y[i]} follows {self.y[i - 1]}"
                )

    def __call__(self, raw: float) -> float:
        """The calibrated confidence of a raw one."""
        return float(np.interp(raw, self.x, self.y))

    def to_json(self) -> dict:
        return {
            "kind": CALIBRATION_KIND,
            "x": list(self.x),
            "y": list(self.y),
            "fitted_on": self.fitted_on,
        }

    @classmethod
    def from_json(cls, data: object) -> Calibration:
        """Raise ``ValueError`` for anything but a valid calibration object."""
        if not isinstance(data, dict):
            raise ValueError("expected a JSON object")
        if data.get("kind") != CALIBRATION_KIND:
            raise ValueError(f"kind must be {CALIBRATION_KIND!r}, got {data.get('kind')!r}")
        x, y = data.get("x"), data.get("y")
        if not isinstance(x, list) or not isinstance(y, list):
            raise ValueError("x and y must be lists of numbers")
        fitted_on = data.get("fitted_on", 0)
        if isinstance(fitted_on, bool) or not isinstance(fitted_on, int) or fitted_on < 0:
            raise ValueError(f"fitted_on must be a non-negative integer, got {fitted_on!r}")
        calibration = cls(tuple(x), tuple(y), fitted_on)
        calibration.validate()
        return calibration

    def save(self, directory: str | Path) -> Path:
        """Write :data:`CALIBRATION_FILE` into ``directory``; returns its path."""
        path = Path(directory) / CALIBRATION_FILE
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path


def load_calibration(directory: str | Path) -> Calibration | None:
    """The calibration stored in ``directory``, or None when it has none.

    Raises :class:`ModelLoadError` naming the file when it is unreadable or invalid: a model
    whose calibration is broken must not serve uncalibrated confidences silently."""
    path = Path(directory) / CALIBRATION_FILE
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text(), parse_constant=_no_constant)
        return Calibration.from_json(data)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"invalid confidence calibration {path}: {e}") from None


def _no_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number")


def fit_calibration(raw: Sequence[float], correct: Sequence[bool | float]) -> Calibration:
    """Isotonic regression of ``correct`` (1/0, or a score in [0, 1]) on ``raw`` confidence by
    pooled adjacent violators: the non-decreasing step function closest to the outcomes in
    squared error. Its knots are the first and last raw value of each pooled block, at the
    block's mean outcome, so the map is flat within a block and linear between blocks.

    Raises ``ValueError`` for empty or mismatched inputs or values outside [0, 1]."""
    xs = np.asarray(raw, dtype=np.float64)
    ys = np.asarray(correct, dtype=np.float64)
    if xs.ndim != 1 or xs.shape != ys.shape or xs.size == 0:
        raise ValueError("raw and correct must be non-empty sequences of the same length")
    for name, values in (("raw", xs), ("correct", ys)):
        if not np.all(np.isfinite(values)) or values.min() < 0 or values.max() > 1:
            raise ValueError(f"{name} must hold numbers in [0, 1]")
    # equal raw values form one point of weight = their count
    ux, inverse, counts = np.unique(xs, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ys)
    # blocks: [mean, weight, first point, last point]; merge while the last two decrease
    blocks: list[list[float]] = []
    for i in range(ux.size):
        blocks.append([sums[i] / counts[i], float(counts[i]), i, i])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, _, last = blocks.pop()
            m1, w1, first, _ = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, first, last])
    kx: list[float] = []
    ky: list[float] = []
    for mean, _, first, last in blocks:
        for i in (first, last) if last != first else (first,):
            kx.append(float(ux[int(i)]))
            ky.append(min(1.0, max(0.0, float(mean))))
    calibration = Calibration(tuple(kx), tuple(ky), int(xs.size))
    calibration.validate()
    return calibration


def confidences(
    log_prob: float, scored_tokens: int, calibration: Calibration | None
) -> tuple[float, float]:
    """(raw_confidence, confidence) of one hypothesis under ``calibration`` (None: raw)."""
    raw = raw_confidence(log_prob, scored_tokens)
    return raw, (raw if calibration is None else calibration(raw))
