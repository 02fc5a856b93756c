"""HTTP request and response bodies of the gateway."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator, model_validator

Decoding = Literal["rag-token", "rag-sequence-thorough", "rag-sequence-fast"]

# The same limit the services enforce; the gateway checks first so clients get a 422 naming
# the field before any service is called.
MAX_QUESTION_CHARS = 2000
INDEX_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


class AnswerRequest(BaseModel):
    model_config = {"extra": "forbid"}

    question: str = Field(min_length=1, max_length=MAX_QUESTION_CHARS)
    k: int = Field(5, ge=1, le=100, description="number of passages to retrieve and marginalise")
    decoding: Decoding = "rag-token"
    num_beams: int = Field(1, ge=1, le=16, description="1 = greedy")
    max_new_tokens: int = Field(32, ge=1, le=512)
    min_new_tokens: int = Field(0, ge=0, le=512)
    num_return_sequences: int = Field(1, ge=1, le=16)
    length_penalty: float = Field(1.0, ge=-10.0, le=10.0)
    index: str | None = Field(
        None, pattern=INDEX_NAME_PATTERN, description="default: the active index"
    )
    use_cache: bool = True

    @field_validator("question")
    @classmethod
    def question_not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("question must not be blank")
        return value

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
    model_config = {"extra": "forbid"}

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
    model_config = {"extra": "forbid"}

    checkpoint: str | None = Field(
        None,
        max_length=4096,
        description="checkpoint directory (as the services see it); default: the latest one",
    )


class ReloadModelResponse(BaseModel):
    generator: str
    retriever: str
