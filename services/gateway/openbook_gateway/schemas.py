"""HTTP request and response bodies of the gateway."""

from __future__ import annotations

import unicodedata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

Decoding = Literal["rag-token", "rag-sequence-thorough", "rag-sequence-fast"]

# The same limit the services enforce; the gateway checks first so clients get a 422 naming
# the field before any service is called.
MAX_QUESTION_CHARS = 2000
INDEX_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
# Passages per answer when neither the request nor the served generator names a number (a RAG
# checkpoint's config n_docs is the generator's own default).
DEFAULT_K = 5

# Every request body is strict: "5" and true are not numbers and "yes" is not a boolean, so a
# client's mistake is a 422 naming the field rather than a silent guess. An int is still a
# valid float; 5.0 is not a valid int. NaN and ±Infinity (Python's json reads them, and 1e400
# as inf) are refused by the int types and by allow_inf_nan=False on floats.
STRICT_REQUEST = ConfigDict(extra="forbid", strict=True)

# The control characters a question may hold: people paste multi-line text.
QUESTION_CONTROLS = "\t\n\r"
CONTROL_NAMES = {"\t": "tab", "\n": "newline", "\r": "carriage return"}
# Characters that show nothing: a question made only of these is blank.
INVISIBLE = frozenset({"Cc", "Cf", "Zs", "Zl", "Zp"})


def refuse_controls(field: str, value: str, allowed: str = "") -> str:
    """Return ``value``, or raise ValueError naming ``field`` and its first control character
    that is not in ``allowed``.

    NUL cuts strings short in C code, logs and paths; other control characters mean nothing
    to a tokenizer. Refused here, each is a 422 naming the field instead of a surprise further
    down. (Lone surrogates never get this far: pydantic refuses them as invalid strings.)
    """
    for at, char in enumerate(value):
        if unicodedata.category(char) != "Cc" or char in allowed:
            continue
        where = f"U+{ord(char):04X} at index {at}"
        if char == "\x00":
            raise ValueError(f"{field} must not contain NUL characters ({where})")
        if allowed:
            where += "; allowed: " + ", ".join(CONTROL_NAMES.get(c, repr(c)) for c in allowed)
        raise ValueError(f"{field} must not contain control characters ({where})")
    return value


class AnswerRequest(BaseModel):
    model_config = STRICT_REQUEST

    question: str = Field(
        min_length=1,
        max_length=MAX_QUESTION_CHARS,
        description="visible text; tab, newline and carriage return are the only control "
        "characters allowed",
    )
    k: int | None = Field(
        None,
        ge=1,
        le=100,
        description="number of passages to retrieve and marginalise; default: the model's "
        f"n_docs ({DEFAULT_K})",
    )
    decoding: Decoding = "rag-token"
    num_beams: int = Field(1, ge=1, le=16, description="1 = greedy")
    max_new_tokens: int = Field(32, ge=1, le=512)
    min_new_tokens: int = Field(0, ge=0, le=512)
    num_return_sequences: int = Field(1, ge=1, le=16)
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0, allow_inf_nan=False)
    index: str | None = Field(
        None, pattern=INDEX_NAME_PATTERN, description="default: the active index"
    )
    use_cache: bool = True

    @field_validator("question")
    @classmethod
    def question_is_text(cls, value: str) -> str:
        if all(ch.isspace() or unicodedata.category(ch) in INVISIBLE for ch in value):
            raise ValueError(
                "question must not be blank: it holds only whitespace, control or format characters"
            )
        return refuse_controls("question", value, QUESTION_CONTROLS)

    @model_validator(mode="after")
    def decoding_consistent(self) -> AnswerRequest:
        # The generator checks these too; checking here names the field before any call.
        if self.min_new_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_new_tokens ({self.min_new_tokens}) must not exceed "
                f"max_new_tokens ({self.max_new_tokens})"
            )
        if self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences ({self.num_return_sequences}) must not exceed "
                f"num_beams ({self.num_beams})"
            )
        return self


class PassageOut(BaseModel):
    id: str
    title: str
    text: str
    score: float
    prior: float | None = None
    posterior: float | None = None


class TokenPosteriorOut(BaseModel):
    token: str
    posterior: list[float]


class HypothesisOut(BaseModel):
    text: str
    log_prob: float
    doc_posterior: list[float] | None = None
    tokens: list[TokenPosteriorOut] | None = None


class AnswerResponse(BaseModel):
    answer: str
    index: str
    model_version: str
    retriever_version: str
    decoding: Decoding
    passages: list[PassageOut]
    hypotheses: list[HypothesisOut]
    cached: bool
    request_id: str
    timings_ms: dict[str, float]


class SwapIndexRequest(BaseModel):
    model_config = STRICT_REQUEST

    index: str = Field(pattern=INDEX_NAME_PATTERN)


class SwapIndexResponse(BaseModel):
    previous: str | None
    active: str


class IndexOut(BaseModel):
    name: str
    encoder: str
    dim: int
    count: int
    index_type: str
    loaded: bool
    active: bool


class IndexesResponse(BaseModel):
    active: str | None
    indexes: list[IndexOut]


class ReloadModelRequest(BaseModel):
    model_config = STRICT_REQUEST

    checkpoint: str | None = Field(
        None,
        max_length=4096,
        description=(
            "a checkpoint in the services' checkpoint root (OPENBOOK_CHECKPOINT_DIR): a version "
            "such as step-000120, or an absolute path inside the root; default: the latest one"
        ),
    )

    @field_validator("checkpoint")
    @classmethod
    def checkpoint_is_a_path(cls, value: str | None) -> str | None:
        # No path holds NUL or a control character that a client would mean to send.
        return value if value is None else refuse_controls("checkpoint", value)


class ReplicaOut(BaseModel):
    service: str
    replica: str = Field(description="the replica's id: host, pid and a random suffix")
    version: str = Field(description="the model version it serves now")
    state: str = Field(
        description="of the latest reload: 'converged', 'failed' (old model kept) or 'loading'"
    )
    error: str | None = Field(None, description="why the replica refused the checkpoint")


class ReloadModelResponse(BaseModel):
    generator: str = Field(description="the version the generator replicas serve ('' if mixed)")
    retriever: str = Field(description="the version the retriever replicas serve ('' if mixed)")
    checkpoint: str | None = Field(
        None, description="the checkpoint the replicas were told to load (relative to the root)"
    )
    request: str | None = Field(None, description="the id of this reload in shared state")
    replicas: list[ReplicaOut] | None = Field(
        None, description="each replica's result; null without Redis (one replica per service)"
    )


class ReplicasResponse(BaseModel):
    desired: dict[str, str] = Field(description="the desired model recorded in Redis")
    replicas: list[ReplicaOut]
