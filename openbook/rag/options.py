"""Decoding options and result types of the generator API."""

from __future__ import annotations

from dataclasses import dataclass

from openbook.validation.limits import check_decoding_of


class SearchOrSample:
    """Whether a decoding samples or searches, and so how many decoder rows it keeps: its
    samples (``num_return_sequences``) when it samples, else its beams."""

    num_beams: int
    num_return_sequences: int
    temperature: float

    @property
    def sampling(self) -> bool:
        """Whether answers are drawn at random (temperature > 0) rather than searched for."""
        return self.temperature > 0

    @property
    def rows(self) -> int:
        return self.num_return_sequences if self.sampling else self.num_beams


@dataclass
class DecodingOptions(SearchOrSample):
    """How to decode one request.

    ``num_beams == 1`` means greedy decoding in every mode (as in transformers' ``generate``).

    ``temperature > 0`` samples instead (:mod:`openbook.rag.sampling`): every answer token is
    drawn from the temperature / top-k / top-p transform of the model's distribution (RAG-Token:
    the passage marginal), with a random generator of this request's own, seeded by ``seed``
    (None: a fresh random seed), so that a seeded request gets the same answer whatever else
    its batch decodes. ``num_return_sequences`` is then the number of independent samples and
    ``num_beams`` is 1. ``temperature == 0`` is greedy / beam search, whatever ``top_p``,
    ``top_k`` and ``seed`` say.
    """

    mode: str = "rag-token"
    num_beams: int = 1
    max_new_tokens: int = 32
    min_new_tokens: int = 0
    length_penalty: float = 1.0
    num_return_sequences: int = 1
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None

    @property
    def rows_per_passage(self) -> int:
        """Decoder rows the request has per passage: its beams, or its samples."""
        return self.rows

    def validate(self) -> None:
        """Raise :class:`~openbook.errors.InvalidArgument` naming the first bad field: the
        rules of :func:`openbook.validation.limits.check_decoding`, the same the gateway and the
        generator service apply at their boundaries."""
        check_decoding_of(self.mode, self)


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
    # RAG-Token: log p(y_i|x,y_<i) = log sum_z p(z|x) p(y_i|x,z,y_<i) of each token (they sum to
    # ``log_prob``); None for RAG-Sequence, whose marginal is over whole answers, not tokens
    token_log_probs: list[float] | None = None
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
    # of the prompt tokens the model read, those whose keys/values came from a cache (a causal
    # LM's passage cache) instead of being computed: usage's cached prompt tokens
    cached_input_tokens: int = 0
