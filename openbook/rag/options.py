"""Decoding options and result types of the generator API."""

from __future__ import annotations

from dataclasses import dataclass

from openbook.limits import DECODING_MODES, MAX_BEAMS, MAX_NEW_TOKENS
from openbook.rag.errors import InvalidRequest


@dataclass
class DecodingOptions:
    """How to decode one request.

    ``num_beams == 1`` means greedy decoding in every mode (as in transformers' ``generate``).
    """

    mode: str = "rag-token"
    num_beams: int = 1
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    num_return_sequences: int = 1

    def validate(self) -> None:
        """Raise :class:`InvalidRequest` naming the first out-of-range field.

        The library's own invariants, for its Python callers (types included); the services
        check requests against ``openbook.limits`` at their boundary before they get here."""
        if self.mode not in DECODING_MODES:
            raise InvalidRequest(f"mode must be one of {list(DECODING_MODES)}, got {self.mode!r}")
        _check_int("num_beams", self.num_beams, 1, MAX_BEAMS)
        _check_int("max_new_tokens", self.max_new_tokens, 1, MAX_NEW_TOKENS)
        _check_int("min_new_tokens", self.min_new_tokens, 0, self.max_new_tokens)
        _check_int("num_return_sequences", self.num_return_sequences, 1, self.num_beams)
        lp = self.length_penalty
        if (
            isinstance(lp, bool)
            or not isinstance(lp, int | float)
            or lp != lp
            or abs(lp) == float("inf")
        ):
            raise InvalidRequest(f"length_penalty must be a finite number, got {lp!r}")

    def key(self) -> tuple:
        """Hashable identity, used to group requests that can share a forward pass."""
        return (
            self.mode,
            self.num_beams,
            self.max_new_tokens,
            self.min_new_tokens,
            float(self.length_penalty),
            self.num_return_sequences,
        )


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")
    if not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be in [{lo}, {hi}], got {value}")


@dataclass
class Hypothesis:
    """One generated answer.

    ``log_prob`` is log p(y|x) marginalised over the passages: for RAG-Token the (unpenalised) sum
    over tokens of log sum_z p(z|x) p(y_i|x,z,y_<i); for RAG-Sequence log sum_z p(z|x) p(y|x,z).
    """

    text: str
    token_ids: list[int]
    log_prob: float
    # The tokens whose log-probs ``log_prob`` sums (openbook/rag/confidence.py says which)
    scored_tokens: int = 0
    doc_posterior: list[float] | None = None
    tokens: list[str] | None = None
    token_doc_posteriors: list[list[float]] | None = None
    # "stop": the model ended it (EOS or a stop string); "length": max_new_tokens ran out
    finish_reason: str = "stop"
    # exp(log_prob / scored_tokens), and the model's calibration of it (the raw value when it
    # has none); both in [0, 1], set when the request finishes (openbook/rag/confidence.py)
    raw_confidence: float = 0.0
    confidence: float = 0.0


@dataclass
class GenerationResult:
    hypotheses: list[Hypothesis]  # best first
    doc_prior: list[float]  # p(z|x) = softmax of the passage scores
