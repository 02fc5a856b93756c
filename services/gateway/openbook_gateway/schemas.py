"""HTTP request and response bodies of the gateway.

Requests are checked once, here, against ``openbook.validation.limits``: the limits the retriever
and generator enforce at their own boundaries, so a request accepted here is one they accept.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import UploadFile
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from openbook.validation.limits import (
    INDEX_NAME_PATTERN,
    MAX_BATCH_DOCUMENTS,
    MAX_BEAMS,
    MAX_CHECKPOINT_CHARS,
    MAX_CONVERSATION_MESSAGES,
    MAX_DOCUMENT_ID_CHARS,
    MAX_DOCUMENT_TEXT_CHARS,
    MAX_DOCUMENT_TITLE_CHARS,
    MAX_HISTORY_MESSAGE_CHARS,
    MAX_K,
    MAX_KEY_CONCURRENT_GENERATIONS,
    MAX_KEY_REQUESTS_PER_MINUTE,
    MAX_LENGTH_PENALTY,
    MAX_NEW_TOKENS,
    MAX_QUESTION_CHARS,
    MAX_RETURN_SEQUENCES,
    MAX_SEED,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    MIN_LENGTH_PENALTY,
    MIN_SEED,
    DecodingMode,
    RetrievalMode,
    check_checkpoint_name,
    check_decoding_of,
    check_document_id,
    check_document_text,
    check_document_title,
    check_metadata,
    check_question,
)
from openbook.validation.metadata_filter import MetadataFilter, parse_filter
from openbook_gateway.api_keys import KEY_NAME_PATTERN, MAX_KEY_INDEXES, SCOPES, Scope

# Passages per answer when neither the request nor the served generator names a number (a RAG
# checkpoint's config n_docs is the generator's own default).
DEFAULT_K = 5

# Every request body is strict: "5" and true are not numbers and "yes" is not a boolean, so a
# client's mistake is a 422 naming the field rather than a silent guess. An int is still a
# valid float; 5.0 is not a valid int. NaN and ±Infinity (Python's json reads them, and 1e400
# as inf) are refused by the int types and by allow_inf_nan=False on floats.
STRICT_REQUEST = ConfigDict(extra="forbid", strict=True)


class RetrievalFilter(BaseModel):
    """The ``filter`` option of a body that retrieves (``/answer``, the ``/v1`` extra body
    fields): a base class, so every such body takes it with the same rules and description."""

    model_config = STRICT_REQUEST

    filter: dict[str, Any] | None = Field(
        None,
        description="only passages whose document's metadata matches: exact conditions, "
        '{"lang": "en"}, {"year": {"$in": [2016, 2018]}}, {"lang": {"$eq": "en"}}, and '
        '{"$and": [...]} / {"$or": [...]} of them (several keys in one object: all must hold). '
        "Built-in keys: _id (the document id) and _title. Applied inside retrieval: the k best "
        "matching passages. A key no document has matches nothing (no passages: the answer "
        "abstains); a list or object where a value belongs is a 422 naming filter",
    )

    @field_validator("filter")
    @classmethod
    def filter_is_valid(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        parse_filter(value, "filter")
        return value

    def metadata_filter(self) -> MetadataFilter | None:
        """The filter, parsed (None: none, or ``{}``)."""
        return parse_filter(self.filter, "filter")


class HistoryMessage(BaseModel):
    """An earlier turn of a conversation, as ``/answer``'s ``history`` takes it."""

    model_config = STRICT_REQUEST

    role: Literal["user", "assistant"]
    content: str = Field(
        max_length=MAX_HISTORY_MESSAGE_CHARS,
        description="its text (an abstained answer's may be empty); only its start is read",
    )


class AnswerRequest(RetrievalFilter):
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
        le=MAX_K,
        description="number of passages to retrieve and marginalise; default: the model's "
        f"n_docs ({DEFAULT_K})",
    )
    decoding: DecodingMode = "rag-token"
    num_beams: int = Field(1, ge=1, le=MAX_BEAMS, description="1 = greedy")
    max_new_tokens: int = Field(32, ge=1, le=MAX_NEW_TOKENS)
    min_new_tokens: int = Field(0, ge=0, le=MAX_NEW_TOKENS)
    num_return_sequences: int = Field(
        1,
        ge=1,
        le=MAX_RETURN_SEQUENCES,
        description="answers returned: the n best beams (<= num_beams), or, when sampling, "
        "n independent samples",
    )
    length_penalty: float = Field(
        1.0, ge=MIN_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False
    )
    temperature: float = Field(
        0.0,
        ge=0,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="0: greedy or beam search (deterministic); > 0: sample every token from "
        "the temperature-scaled distribution (RAG-Token: the passage marginal), then cut to "
        "top_k and top_p; num_beams must then be 1",
    )
    top_p: float = Field(
        1.0,
        gt=0,
        le=1,
        allow_inf_nan=False,
        description="sampling: keep the smallest set of likeliest tokens whose mass reaches "
        "top_p (1: all)",
    )
    top_k: int = Field(
        0, ge=0, le=MAX_TOP_K, description="sampling: keep the top_k likeliest tokens (0: all)"
    )
    seed: int | None = Field(
        None,
        ge=MIN_SEED,
        le=MAX_SEED,
        description="sampling: the same seed gives the same answer (with the same passages "
        "and model); none: a random one, and the answer is not cached",
    )
    index: str | None = Field(
        None, pattern=INDEX_NAME_PATTERN, description="default: the active index"
    )
    retrieval: RetrievalMode | None = Field(
        None,
        description="how passages are retrieved: 'dense' (query encoder), 'bm25', or 'hybrid' "
        "(both, fused into one fitted score); default: the index's default_retrieval ('hybrid' "
        "where it holds both views, 'dense' for the paper's DPR / RAG encoders). A mode the "
        "index has no view for is a 422 naming retrieval",
    )
    use_cache: bool = True
    min_confidence: float | None = Field(
        None,
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="abstain (empty answer, abstained true) when the answer's confidence is "
        "below this; default: the server's OPENBOOK_GATEWAY_MIN_CONFIDENCE (unset: never)",
    )
    stream: bool = Field(
        False,
        description="answer as Server-Sent Events: token events as the answer is written, then "
        "an answer event with this response's body (docs/api.md)",
    )
    history: list[HistoryMessage] | None = Field(
        None,
        max_length=MAX_CONVERSATION_MESSAGES - 1,
        description="the conversation before question, oldest first: a follow-up is retrieved "
        "and answered with the question expanded by the last user turns and the last answer "
        "(openbook_gateway.conversation; question_used in the reply says what was asked). "
        "Default: none, the question alone",
    )

    @field_validator("question")
    @classmethod
    def question_is_text(cls, value: str) -> str:
        return check_question("question", value)

    @model_validator(mode="after")
    def decoding_consistent(self) -> AnswerRequest:
        # The one rule for decoding options, the generator's and the library's too; the
        # fields' bounds above state its limits in the OpenAPI schema (and refuse a field
        # alone first), this adds how they bound each other.
        check_decoding_of(self.decoding, self)
        return self

    @property
    def sampling(self) -> bool:
        """Whether the answer is drawn at random (temperature > 0)."""
        return self.temperature > 0

    @property
    def cacheable(self) -> bool:
        """Whether the answer may be cached: a search's always, a sample's only with its seed
        (without one, asking again must draw again)."""
        return self.use_cache and (not self.sampling or self.seed is not None)


class PassageOut(BaseModel):
    id: str
    title: str
    text: str
    score: float
    # The document the passage belongs to (a live document's id; a corpus passage is its own)
    # and, for a passage of an uploaded PDF, its page (from 1): what a citation names.
    document: str | None = None
    page: int | None = None
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
    num_tokens: int | None = Field(None, description="tokens generated")
    finish_reason: str | None = Field(
        None, description="'stop' (the model ended it) or 'length' (max_new_tokens ran out)"
    )
    confidence: float = Field(
        0.0,
        description="in [0, 1]: the model's calibration of the answer (a map of "
        "raw_confidence, or a logistic model of the answer's features), or raw_confidence "
        "when it has none (openbook/rag/confidence.py)",
    )
    raw_confidence: float = Field(
        0.0,
        description="exp(log_prob / n) over the n answer tokens scored: the geometric-mean "
        "per-token probability under the passage marginal; 0 for an empty answer",
    )


class AnswerResponse(BaseModel):
    answer: str = Field(description="the best hypothesis' text; empty when abstained")
    confidence: float = Field(description="the best hypothesis' confidence, in [0, 1]")
    abstained: bool = Field(
        description="the confidence is below the request's min_confidence (or the server's "
        "default): the answer is empty; passages and hypotheses are still returned"
    )
    min_confidence: float | None = Field(
        None, description="the threshold this answer was held to (null: none)"
    )
    index: str
    index_version: int = Field(
        0,
        description="the serving index's version: its count of acknowledged document writes "
        "(a sharded index's: the sum over its shards)",
    )
    retrieval: str | None = Field(
        None,
        description="the retrieval mode that found the passages: the request's, or the index's "
        "default ('dense', 'bm25' or 'hybrid')",
    )
    model_version: str
    retriever_version: str
    decoding: DecodingMode
    passages: list[PassageOut]
    hypotheses: list[HypothesisOut]
    cached: bool
    request_id: str
    timings_ms: dict[str, float]
    prompt_tokens: int | None = Field(
        None, description="tokens the generator read: the k passage inputs together"
    )
    cached_prompt_tokens: int | None = Field(
        None,
        description="of prompt_tokens, those whose keys/values the generator's passage cache "
        "held, so that they were not computed again",
    )
    question_used: str | None = Field(
        None,
        description="the question passages were retrieved and the answer generated for: the "
        "question, expanded from the conversation's earlier turns when there are any",
    )


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
    count: int | None = Field(
        description="its passages; null to a key with a tenant filter (issue 43: the total "
        "counts every tenant's documents, and would tell one the others' volume)"
    )
    index_type: str
    loaded: bool
    active: bool
    loadable: bool = Field(
        description="it is loaded, or its directory passes the retriever's checks (manifest, "
        "files present at their recorded sizes) and its last load, if any since its files "
        "changed, succeeded; listing loads nothing"
    )
    problem: str | None = Field(
        None,
        description="why it cannot be loaded: an unreadable manifest, a missing or resized "
        "file, the error of its last load (a checksum mismatch); null when loadable",
    )
    verified: bool = Field(
        description="every file's checksum was verified: it is loaded, or loaded since its "
        "files last changed"
    )
    views: list[str] = Field(
        default_factory=list,
        description="the retrieval views it holds: 'dense', 'bm25' or both (empty when its "
        "manifest is unreadable)",
    )
    default_retrieval: str | None = Field(
        None,
        description="the retrieval mode of a request that names none: 'hybrid' where it holds "
        "both views (but 'dense' where a DPR or RAG checkpoint encodes it, the paper's "
        "retrieval), else its one view's (null when its manifest is unreadable)",
    )
    version: int = Field(
        0,
        description="its count of acknowledged document writes (0: never written to; a "
        "sharded index's: the sum over its shards)",
    )
    engine: str | None = Field(
        None,
        description="which engine holds it (the retriever's OPENBOOK_INDEX_ENGINE): 'files', "
        "a directory under the index root, or 'milvus', collections in Milvus (null from a "
        "retriever that does not say)",
    )


class IndexesResponse(BaseModel):
    active: str | None
    indexes: list[IndexOut]


class ReloadModelRequest(BaseModel):
    model_config = STRICT_REQUEST

    checkpoint: str | None = Field(
        None,
        max_length=MAX_CHECKPOINT_CHARS,
        description=(
            "a checkpoint in the services' checkpoint root (OPENBOOK_CHECKPOINT_DIR): a version "
            "such as step-000120, or an absolute path inside the root; default: the latest one"
        ),
    )

    @field_validator("checkpoint")
    @classmethod
    def checkpoint_is_a_path(cls, value: str | None) -> str | None:
        return value if value is None else check_checkpoint_name("checkpoint", value)


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
    rolled_back: str | None = Field(
        None,
        description="when some replicas refused the checkpoint: the version the ones that had "
        "switched were put back on",
    )


class ReplicasResponse(BaseModel):
    desired: dict[str, str] = Field(description="the desired model recorded in Redis")
    replicas: list[ReplicaOut]


# --- documents (routes/documents.py) --------------------------------------------------------
#
# A document's rules are openbook.validation.limits' check_document_* (the retriever's Document
# checks with the same ones); the Field bounds repeat their limits for the OpenAPI schema.

INDEX_TYPE_PATTERN = r"^[a-z0-9][a-z0-9-]{0,31}$"


class CreateIndexRequest(BaseModel):
    model_config = STRICT_REQUEST

    name: str = Field(pattern=INDEX_NAME_PATTERN)
    type: str | None = Field(
        None,
        pattern=INDEX_TYPE_PATTERN,
        description="'flat', 'hnsw', 'hnsw-sq8', 'ivfpq' or 'bm25'; default: like's type, else "
        "the retriever's default (the retriever refuses any other, a 422 naming type)",
    )
    like: str | None = Field(
        None,
        pattern=INDEX_NAME_PATTERN,
        description="an existing index whose encoders, type and parameters the new one takes",
    )


class DeleteIndexResponse(BaseModel):
    name: str


def _metadata(value: dict[str, Any] | None) -> dict[str, Any] | None:
    if value is not None:
        check_metadata("metadata", value)
    return value


class DocumentBody(BaseModel):
    """A document's content, as ``PUT /indexes/{index}/documents/{doc_id}`` takes it."""

    model_config = STRICT_REQUEST

    title: str = Field(max_length=MAX_DOCUMENT_TITLE_CHARS)
    text: str = Field(min_length=1, max_length=MAX_DOCUMENT_TEXT_CHARS)
    metadata: dict[str, Any] | None = Field(
        None,
        description="a flat map of scalars: string keys, values strings, numbers, booleans or null",
    )

    @field_validator("title")
    @classmethod
    def title_is_text(cls, value: str) -> str:
        return check_document_title("title", value)

    @field_validator("text")
    @classmethod
    def text_has_words(cls, value: str) -> str:
        return check_document_text("text", value)

    @field_validator("metadata")
    @classmethod
    def metadata_is_flat(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _metadata(value)


class BatchDocument(DocumentBody):
    """One document of a batch: its content and its id."""

    id: str = Field(min_length=1, max_length=MAX_DOCUMENT_ID_CHARS)

    @field_validator("id")
    @classmethod
    def id_is_a_path_segment(cls, value: str) -> str:
        return check_document_id("id", value)


class PutDocumentsRequest(BaseModel):
    model_config = STRICT_REQUEST

    documents: list[BatchDocument] = Field(min_length=1, max_length=MAX_BATCH_DOCUMENTS)

    @field_validator("documents")
    @classmethod
    def ids_distinct(cls, value: list[BatchDocument]) -> list[BatchDocument]:
        # One version for the batch: two versions of one document in it would leave which one
        # wins to the order of the retriever's loop.
        seen: set[str] = set()
        for at, document in enumerate(value):
            if document.id in seen:
                raise ValueError(f"documents[{at}].id {document.id!r} is already in the batch")
            seen.add(document.id)
        return value


class PutDocumentResponse(BaseModel):
    index: str
    id: str
    passages: int = Field(description="passages the document was split into")
    version: int = Field(description="the index's version once this write is applied")


class UploadForm(BaseModel):
    """One file, uploaded as one document (multipart/form-data)."""

    # The form of POST /indexes/{index}/documents as the OpenAPI document describes it
    # (multipart_body). The route parses the form itself (routes/uploads.py says why FastAPI's
    # File/Form parameters cannot) and checks each field with openbook.validation.limits' rules; its
    # fields are these, and no others.
    model_config = ConfigDict(extra="forbid")

    file: UploadFile = Field(description="plain text, Markdown, HTML or PDF (by content)")
    id: str | None = Field(
        None, max_length=MAX_DOCUMENT_ID_CHARS, description="default: sha256-<32 hex>"
    )
    title: str | None = Field(
        None,
        max_length=MAX_DOCUMENT_TITLE_CHARS,
        description="default: the document's own title, else the file's name",
    )
    metadata: str | None = Field(None, description="a JSON object of scalars")


def multipart_body(form: type[BaseModel]) -> dict[str, Any]:
    """A route's ``openapi_extra`` saying its body is ``form`` as ``multipart/form-data``, the
    schema generated from the model (for a route that reads its form itself)."""
    return {
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": form.model_json_schema()}},
        }
    }


class UploadResponse(PutDocumentResponse):
    """An uploaded file's document: the documents API's reply and what the upload found."""

    title: str = Field(
        description="the form's title, else the document's own, else the file's name"
    )
    type: str = Field(description="what the content is: text, markdown, html or pdf")
    pages: int | None = Field(None, description="a PDF's pages")
    sha256: str = Field(description="the file's SHA-256, also kept in the document's metadata")


class PutDocumentsResponse(BaseModel):
    index: str
    version: int = Field(description="the index's version once the batch is applied")
    passages: list[int] = Field(description="passages per document, in request order")


class DeleteDocumentResponse(BaseModel):
    version: int = Field(description="the index's version once the delete is applied")


class DocumentResponse(BaseModel):
    index: str
    id: str
    title: str
    text: str
    metadata: dict[str, Any]
    passage_ids: list[str]


class DocumentListResponse(BaseModel):
    index: str
    ids: list[str]
    next_cursor: str | None = Field(
        None, description="the cursor of the next page; null when this page is the last"
    )
    version: int


class KeyRateIn(BaseModel):
    """A key's limits (``openbook_gateway.key_limits``), counted across gateway replicas."""

    model_config = STRICT_REQUEST

    requests_per_minute: int | None = Field(
        None,
        ge=1,
        le=MAX_KEY_REQUESTS_PER_MINUTE,
        description="requests of any route in one minute (a window that starts with the first "
        "request); past it, 429 with Retry-After: the seconds until the window ends. Unset: "
        "no limit",
    )
    concurrent_generations: int | None = Field(
        None,
        ge=1,
        le=MAX_KEY_CONCURRENT_GENERATIONS,
        description="answers being generated at once (answer, chat, responses, MCP answer; a "
        "cached answer is none); past it, 429. Unset: no limit",
    )


class CreateKeyRequest(BaseModel):
    """``POST /admin/keys`` (issue 43; openbook_gateway.api_keys)."""

    model_config = STRICT_REQUEST

    name: str = Field(
        pattern=KEY_NAME_PATTERN,
        description="the key's name: 1 to 64 of a-z, 0-9, '_' and '-', starting with a letter "
        "or digit; shown in listings and logs, never secret",
    )
    scopes: list[Scope] = Field(
        min_length=1,
        max_length=len(SCOPES),
        description="'ask' (answers, chat, responses, embeddings, MCP reads, reading documents), "
        "'write' (documents and uploads), 'indexes:create' (creating indexes: of the key's "
        "indexes only if it is held to some), 'admin' (everything the admin token does)",
    )
    indexes: list[Annotated[str, Field(pattern=INDEX_NAME_PATTERN)]] | None = Field(
        None,
        min_length=1,
        max_length=MAX_KEY_INDEXES,
        description="the only indexes the key may name (others are 404 to it); a request "
        "naming none gets the first. Unset: every index",
    )
    filter: dict[str, Any] | None = Field(
        None,
        description="the tenant: a metadata filter (the grammar of /answer's filter) ANDed into "
        "every retrieval made with the key, which no request field can widen; documents it "
        "writes get the filter's equality fields in their metadata (a write that contradicts "
        "them is 403), documents it cannot see are 404 to it. Unset: every document",
    )
    rate: KeyRateIn | None = Field(None, description="the key's limits; unset: none")

    @field_validator("filter")
    @classmethod
    def filter_is_valid(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        parse_filter(value, "filter")
        return value or None

    @model_validator(mode="after")
    def _admin_is_everywhere(self) -> CreateKeyRequest:
        if "admin" in self.scopes and self.indexes is not None:
            raise ValueError(
                "indexes: a key with the 'admin' scope cannot be held to indexes (it could "
                "make itself a key that is not)"
            )
        if "admin" in self.scopes and self.filter:
            raise ValueError(
                "filter: a key with the 'admin' scope cannot be held to a filter (it could "
                "make itself a key that is not)"
            )
        return self


class CreatedKey(BaseModel):
    name: str
    key: str = Field(description="the secret: shown this once, kept only as a salted hash")


class KeyRateOut(BaseModel):
    requests_per_minute: int | None
    concurrent_generations: int | None


class KeyOut(BaseModel):
    name: str
    scopes: list[str]
    indexes: list[str] | None
    filter: dict[str, Any] | None = Field(None, description="the tenant's filter; null: none")
    rate: KeyRateOut | None = Field(None, description="the key's limits; null: none")
    created: float = Field(description="Unix time")
    last_used: float | None = Field(
        description="Unix time of its latest use, to within a minute; null: never used"
    )


class KeysResponse(BaseModel):
    keys: list[KeyOut]


class DeletedKey(BaseModel):
    name: str
