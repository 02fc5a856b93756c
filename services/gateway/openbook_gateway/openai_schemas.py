"""Request body of the OpenAI-compatible ``POST /v1/chat/completions``, checked once, here.

It accepts OpenAI's fields, refusing those whose meaning openbook cannot honour (tools,
log-probs, penalties, images, ...) with a 400 that names the field, and openbook's own options as
extra body fields (``k``, ``decoding``, ``index``, ``num_beams``, ``min_confidence``,
``filter``, ...; the official clients send them with ``extra_body``).
:func:`to_answer_request` turns it into the :class:`~openbook_gateway.schemas.AnswerRequest`
the answer pipeline runs; every limit is the one ``/answer`` enforces
(``openbook.validation.limits``).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openbook.validation import limits
from openbook_gateway.conversation import Turn, recent
from openbook_gateway.schemas import AnswerRequest, RetrievalFilter

# Messages in one conversation: the last user message is the question, the user and assistant
# messages before it the conversation it follows (openbook_gateway.conversation reads the
# last few of them).
MAX_MESSAGES = limits.MAX_CONVERSATION_MESSAGES
MAX_STOP_SEQUENCES = 4  # as OpenAI
MAX_STOP_CHARS = 64
# Prefix of the model ids that name an index: "openbook/<index>". "openbook": the active index.
MODEL = "openbook"

STRICT = ConfigDict(extra="forbid", strict=True)


class OpenAIRequestError(ValueError):
    """A request openbook refuses: a 400 (404 for an unknown model) naming ``param``."""

    def __init__(
        self,
        message: str,
        param: str | None,
        code: str | None = None,
        status: int = 400,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.param = param
        self.code = code
        self.status = status
        self.headers = headers  # a 429's Retry-After


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    # extra="allow": assistant messages of a history carry fields (tool_calls, refusal,
    # annotations, ...) that openbook does not read
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str


class SamplingParams(BaseModel):
    """OpenAI's sampling fields and openbook's ``top_k``, shared by every ``/v1`` route that
    generates (chat completions, responses): their bounds are ``openbook.validation.limits``' (a
    value out of range is a 400 naming it), :meth:`sampling_fields` hands them to the
    :class:`~openbook_gateway.schemas.AnswerRequest`, whose ``check_decoding`` is the one rule.

    ``temperature`` unset or 0 keeps greedy / beam search (OpenAI's own default is 1, but a
    client that sends nothing gets openbook's deterministic answer, as before sampling
    existed); ``top_p``, ``top_k`` and ``seed`` change nothing then. Clients' defaults
    (OpenAI's ``temperature=1``, llama-index's 0.1, LangChain's) all sample.
    """

    model_config = STRICT

    temperature: float | None = Field(None, ge=0, le=limits.MAX_TEMPERATURE, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    # not OpenAI's: an extra body field, as vLLM and llama.cpp take it
    top_k: int | None = Field(None, ge=0, le=limits.MAX_TOP_K)
    seed: int | None = Field(None, ge=limits.MIN_SEED, le=limits.MAX_SEED)

    @property
    def sampling(self) -> bool:
        return bool(self.temperature)

    def sampling_fields(self) -> dict[str, Any]:
        """The AnswerRequest fields these ask for (none at temperature 0 or unset)."""
        if not self.sampling:
            return {}
        fields: dict[str, Any] = {"temperature": self.temperature, "seed": self.seed}
        if self.top_p is not None:
            fields["top_p"] = self.top_p
        if self.top_k is not None:
            fields["top_k"] = self.top_k
        return fields


class ChatCompletionRequest(SamplingParams, RetrievalFilter):
    """``filter`` (an extra body field) comes from :class:`RetrievalFilter`, as on
    ``/answer``: another OpenAI-style body that retrieves takes it by the same base class."""

    model_config = STRICT

    model: str = Field(min_length=1, max_length=256)
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=limits.MAX_RETURN_SEQUENCES)
    max_tokens: int | None = Field(None, ge=1, le=limits.MAX_NEW_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=limits.MAX_NEW_TOKENS)
    stop: str | list[str] | None = None
    # temperature, top_p, top_k, seed: SamplingParams
    frequency_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    presence_penalty: float | None = Field(None, ge=-2, le=2, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None

    # openbook's options (extra body fields)
    k: int | None = Field(None, ge=1, le=limits.MAX_K)
    decoding: limits.DecodingMode = "rag-token"
    num_beams: int | None = Field(None, ge=1, le=limits.MAX_BEAMS)
    min_new_tokens: int = Field(0, ge=0, le=limits.MAX_NEW_TOKENS)
    length_penalty: float = Field(
        1.0, ge=limits.MIN_LENGTH_PENALTY, le=limits.MAX_LENGTH_PENALTY, allow_inf_nan=False
    )
    index: str | None = Field(None, pattern=limits.INDEX_NAME_PATTERN)
    retrieval: limits.RetrievalMode | None = None  # None: the index's default_retrieval
    use_cache: bool = True
    # Abstain below this confidence (as /answer's min_confidence; default: the server's)
    min_confidence: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    # Append [1], [2], ... (1-based positions in ``citations``) to each answer: the passages the
    # answer was drawn from (see docs/api.md).
    citation_markers: bool = True

    def check_supported(self) -> None:
        """Raise :class:`OpenAIRequestError` for what openbook cannot honour."""
        refuse_penalties(self)
        if self.logprobs or self.top_logprobs:
            raise OpenAIRequestError(
                "logprobs are not returned: openbook gives the passage posterior of every "
                "token instead (the 'openbook' field of the reply)",
                "logprobs" if self.logprobs else "top_logprobs",
                "unsupported_parameter",
            )
        if self.logit_bias:
            raise OpenAIRequestError(
                "logit_bias is not supported", "logit_bias", "unsupported_parameter"
            )
        for name in ("tools", "functions", "tool_choice", "function_call"):
            if getattr(self, name) not in (None, [], "none"):
                raise OpenAIRequestError(
                    f"{name}: openbook answers from retrieved passages and calls no tools",
                    name,
                    "unsupported_parameter",
                )
        if self.response_format is not None and self.response_format.type != "text":
            raise OpenAIRequestError(
                f"response_format {self.response_format.type!r} is not supported: only 'text'",
                "response_format",
                "unsupported_parameter",
            )
        if self.modalities not in (None, ["text"]):
            raise OpenAIRequestError(
                "modalities: only ['text']", "modalities", "unsupported_parameter"
            )
        if self.stream_options is not None and not self.stream:
            raise OpenAIRequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if (
            self.max_tokens is not None
            and self.max_completion_tokens is not None
            and self.max_tokens != self.max_completion_tokens
        ):
            raise OpenAIRequestError(
                "max_tokens and max_completion_tokens disagree: send one", "max_tokens"
            )
        if self.sampling and self.num_beams not in (None, 1):
            raise OpenAIRequestError(
                f"num_beams must be 1 when sampling (temperature {self.temperature} > 0): "
                f"beam search does not sample; n={self.n} gives n independent samples",
                "num_beams",
            )
        if not self.sampling and self.num_beams is not None and self.num_beams < self.n:
            raise OpenAIRequestError(
                f"n={self.n} answers need num_beams >= n (got {self.num_beams})", "n"
            )
        self.stop_sequences()

    def stop_sequences(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise OpenAIRequestError(f"stop: at most {MAX_STOP_SEQUENCES} sequences", "stop")
        for i, stop in enumerate(stops):
            if not 0 < len(stop) <= MAX_STOP_CHARS:
                raise OpenAIRequestError(
                    f"stop[{i}]: between 1 and {MAX_STOP_CHARS} characters", "stop"
                )
        return stops

    def question(self) -> tuple[str, int]:
        """The last user message's text, and its position in ``messages``."""
        for i in range(len(self.messages) - 1, -1, -1):
            message = self.messages[i]
            if message.role != "user":
                continue
            content = question_text(message.content, f"messages[{i}].content", ("text",))
            if not content or not content.strip():
                raise OpenAIRequestError(
                    f"messages[{i}].content: the question (the last user message) is empty",
                    f"messages[{i}].content",
                )
            return content, i
        raise OpenAIRequestError(
            "messages: no user message; the last user message is the question", "messages"
        )

    def history(self, before: int) -> list[Turn]:
        """The conversation before ``messages[before]`` (the question) that a follow-up may
        refer to: its user and assistant messages' text (text parts joined, other parts
        skipped: an earlier turn is context, not input to refuse), the recent ones only
        (:func:`~openbook_gateway.conversation.recent`)."""
        turns = []
        for message in self.messages[:before]:
            if message.role in ("user", "assistant"):
                turns.append(Turn(message.role, text_of(message.content)))
        return recent(turns)


class Part(Protocol):
    """A part of a message's content (a chat message's or a Responses input item's)."""

    type: str
    text: str | None


def text_of(content: str | Sequence[Part] | None) -> str:
    """An earlier turn's text: its text parts joined, other parts skipped."""
    if isinstance(content, str) or content is None:
        return content or ""
    return "\n".join(part.text for part in content if part.text is not None)


def question_text(
    content: str | Sequence[Part] | None, param: str, text_types: Collection[str]
) -> str | None:
    """The question's text: its parts joined, a part not of ``text_types`` (or without text)
    refused as ``param[j]``."""
    if isinstance(content, str) or content is None:
        return content
    for j, part in enumerate(content):
        if part.type not in text_types or part.text is None:
            raise OpenAIRequestError(
                f"{param}[{j}]: only text parts are supported (got {part.type!r})",
                f"{param}[{j}]",
                "unsupported_content",
            )
    return "\n".join(part.text or "" for part in content)


def refuse_penalties(body: ChatCompletionRequest) -> None:
    """Frequency and presence penalties are not applied: only 0 (or unset) is accepted."""
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0):
            raise OpenAIRequestError(
                f"{name} is not supported: send 0 or leave it out", name, "unsupported_value"
            )


# AnswerRequest fields as this API names them, for errors that come from AnswerRequest.
_PARAM = {
    "question": "messages",
    "max_new_tokens": "max_tokens",
    "num_return_sequences": "n",
}


def to_answer_request(body: ChatCompletionRequest, index: str | None) -> AnswerRequest:
    """The ``/answer`` request this chat completion asks for, on ``index`` (None: active).

    ``n`` > 1 answers are the n best hypotheses of beam search (``num_beams`` defaults to n),
    or, when sampling, n independent samples (``num_beams`` 1). The user and assistant
    messages before the question are its ``history`` (the recent ones: a follow-up is
    expanded from them, :mod:`openbook_gateway.conversation`).
    """
    question, at = body.question()
    history = [{"role": t.role, "content": t.text} for t in body.history(at)]
    beams = body.num_beams or (1 if body.sampling else body.n)
    fields = {
        "question": question,
        "k": body.k,
        "decoding": body.decoding,
        "num_beams": beams,
        "max_new_tokens": body.max_completion_tokens or body.max_tokens or 32,
        "min_new_tokens": body.min_new_tokens,
        "num_return_sequences": body.n,
        "length_penalty": body.length_penalty,
        "index": index,
        "retrieval": body.retrieval,
        "filter": body.filter,
        "use_cache": body.use_cache,
        "min_confidence": body.min_confidence,
        "stream": body.stream,
        "history": history or None,
        **body.sampling_fields(),
    }
    try:
        return AnswerRequest.model_validate(fields)
    except ValidationError as exc:
        error = exc.errors()[0]
        message = error["msg"].removeprefix("Value error, ")
        field = str(error["loc"][0]) if error["loc"] else ""
        if not field:  # a rule across fields (check_decoding): its message starts with the field
            named = message.split(" ", 1)[0]
            field = named if named in AnswerRequest.model_fields else ""
        param = _PARAM.get(field, field)
        if field == "question":
            param = f"messages[{at}].content"
        raise OpenAIRequestError(f"{param}: {message}", param) from None
