"""Request bodies of ``POST /v1/responses`` and ``POST /v1/embeddings``, checked once, here.

A Responses request is a chat completion under other names (``input`` for ``messages``,
``max_output_tokens`` for ``max_tokens``): :meth:`ResponsesRequest.to_chat_request` turns it
into the :class:`~openbook_gateway.openai_schemas.ChatCompletionRequest` it asks for, so that
every rule of the chat completions API (the bounds of its fields, the sampling parameters it
accepts, openbook's extra body fields, the limits ``/answer`` enforces) is defined once, there,
and applies here unchanged. Its errors are renamed to this API's parameters on the way out.

The conversation a response follows is the user and assistant messages of ``input`` before
its question, after those of the response ``previous_response_id`` names (its stored state,
:mod:`openbook_gateway.stored_responses`): the chat completion gets them as its earlier
messages, and reads them as it reads its own (:mod:`openbook_gateway.conversation`).

What the Responses API adds that openbook cannot honour (tools, reasoning, a stored
conversation object, background runs, JSON output) is refused with a 400 naming the field;
what it adds that changes nothing here (``instructions``, ``metadata``, ``truncation``) is
accepted and not read, as a chat completion's system messages are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openbook.validation.limits import MAX_QUERIES, MAX_QUESTION_CHARS
from openbook_gateway.conversation import Turn, recent
from openbook_gateway.openai_schemas import (
    MAX_MESSAGES,
    MODEL,
    STRICT,
    ChatCompletionRequest,
    ChatMessage,
    OpenAIRequestError,
    question_text,
    text_of,
)

# The text of ``instructions`` (accepted, not read: openbook answers from passages).
MAX_INSTRUCTIONS_CHARS = 65_536


class InputPart(BaseModel):
    """A part of a message's content: ``input_text`` (a user's), ``output_text`` (an
    assistant's in a history); images and files are refused where they would be read."""

    # extra="allow": parts of a history carry fields (annotations, logprobs, ...) not read here
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class InputItem(BaseModel):
    """An item of ``input``: a message (``type`` "message", or left out as the easy form
    ``{"role", "content"}`` allows); the other item types of a history (tool calls and
    their outputs, reasoning) are accepted and not read."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[InputPart] | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str


class TextOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``. The fields it shares with chat completions (the sampling
    parameters, ``user``, ``metadata``, ``store``, ``service_tier`` and openbook's extra body
    fields) are declared here by type only: their bounds are the chat completion's, checked by
    :meth:`to_chat_request`."""

    model_config = STRICT

    model: str = Field(min_length=1, max_length=256)
    input: str | list[InputItem]
    instructions: str | None = Field(None, max_length=MAX_INSTRUCTIONS_CHARS)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = Field(None, allow_inf_nan=False)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    text: TextOptions | None = None
    include: list[str] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    reasoning: dict[str, Any] | None = None
    previous_response_id: str | None = Field(None, max_length=256)
    conversation: Any = None
    prompt: Any = None
    background: bool | None = None
    top_logprobs: int | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None

    # openbook's options (extra body fields, as for chat completions); top_k and seed pass to
    # the chat completion as the other shared fields do (its SamplingParams check them)
    top_k: int | None = None
    seed: int | None = None
    k: int | None = None
    decoding: str | None = None
    num_beams: int | None = None
    min_new_tokens: int | None = None
    length_penalty: float | None = Field(None, allow_inf_nan=False)
    index: str | None = None
    retrieval: str | None = None
    filter: dict[str, Any] | None = None  # checked as the chat completion's (RetrievalFilter)
    use_cache: bool | None = None
    min_confidence: float | None = Field(None, allow_inf_nan=False)
    citation_markers: bool | None = None

    def check_supported(self) -> None:
        """Raise :class:`OpenAIRequestError` for what this API adds that openbook cannot
        honour (the rest is checked as a chat completion, :meth:`to_chat_request`)."""
        # "auto" with no tools (what clients send by default) asks for no tool call either
        for name, fine in (("tools", (None, [])), ("tool_choice", (None, "none", "auto"))):
            if getattr(self, name) not in fine:
                raise OpenAIRequestError(
                    f"{name}: openbook answers from retrieved passages and calls no tools",
                    name,
                    "unsupported_parameter",
                )
        for name, why in (
            (
                "conversation",
                "conversation objects are not stored: send the earlier turns in input, or "
                "previous_response_id",
            ),
            ("prompt", "stored prompt templates are not supported"),
            ("reasoning", "openbook's models do not reason in hidden steps"),
        ):
            if getattr(self, name) is not None:
                raise OpenAIRequestError(f"{name}: {why}", name, "unsupported_parameter")
        if self.background:
            raise OpenAIRequestError(
                "background: responses run while the request waits (or streams)",
                "background",
                "unsupported_parameter",
            )
        if self.top_logprobs:
            raise OpenAIRequestError(
                "top_logprobs: log-probs are not returned; each citation carries the passage's "
                "posterior instead",
                "top_logprobs",
                "unsupported_parameter",
            )
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            raise OpenAIRequestError(
                f"text.format {fmt.type!r} is not supported: only 'text'",
                "text.format",
                "unsupported_parameter",
            )
        if self.stream_options is not None and not self.stream:
            raise OpenAIRequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )

    def _question_at(self) -> int | None:
        """Where the question is in ``input`` (None: ``input`` is the question)."""
        if isinstance(self.input, str):
            return None
        for i in range(len(self.input) - 1, -1, -1):
            item = self.input[i]
            if item.type == "message" and item.role == "user":
                return i
        return None

    def history(self, prior: Sequence[Turn] = ()) -> list[Turn]:
        """The conversation before the question: ``prior`` (the stored state of
        ``previous_response_id``), then the user and assistant messages of ``input`` before
        the question (text parts joined, other parts and items skipped: earlier turns are
        context, not input to refuse), the recent ones only
        (:func:`~openbook_gateway.conversation.recent`)."""
        turns = list(prior)
        at = self._question_at()
        if at is not None and not isinstance(self.input, str):
            for item in self.input[:at]:
                if item.type == "message" and item.role in ("user", "assistant"):
                    turns.append(Turn(item.role, text_of(item.content)))
        return recent(turns)

    def question(self) -> tuple[str, str]:
        """The question (``input`` itself, or the last user message's text) and the parameter
        that names it in errors."""
        if isinstance(self.input, str):
            return self.input, "input"
        if not 1 <= len(self.input) <= MAX_MESSAGES:
            raise OpenAIRequestError(
                f"input: between 1 and {MAX_MESSAGES} items, got {len(self.input)}", "input"
            )
        for i in range(len(self.input) - 1, -1, -1):
            item = self.input[i]
            if item.type != "message" or item.role != "user":
                continue
            param = f"input[{i}].content"
            return question_text(item.content, param, ("input_text", "text")) or "", param
        raise OpenAIRequestError(
            "input: no user message; the last user message is the question", "input"
        )

    def to_chat_request(self, prior: Sequence[Turn] = ()) -> ChatCompletionRequest:
        """The chat completion this request asks for, checked as one (module docstring):
        the conversation's recent turns (:meth:`history`, after ``prior``) then one user
        message, the question; ``max_output_tokens`` as ``max_tokens``; every field the two
        APIs share, as sent. A shared field the chat completions API does not take (yet) is
        refused naming it."""
        self.check_supported()
        question, _ = self.question()
        earlier = [ChatMessage(role=t.role, content=t.text) for t in self.history(prior)]
        fields: dict[str, Any] = {
            "model": self.model,
            "messages": [*earlier, ChatMessage(role="user", content=question)],
            "stream": self.stream,
        }
        if self.max_output_tokens is not None:
            fields["max_tokens"] = self.max_output_tokens
        for name in self.model_fields_set - _OWN_FIELDS:
            if name not in ChatCompletionRequest.model_fields:
                # a shared field whose chat completion counterpart is not there (yet)
                raise OpenAIRequestError(f"{name} is not supported", name, "unsupported_parameter")
            value = getattr(self, name)
            if value is not None:
                fields[name] = value
        try:
            chat = ChatCompletionRequest.model_validate(fields)
        except ValidationError as exc:
            error = exc.errors()[0]
            field = str(error["loc"][0]) if error["loc"] else None
            raise self.renamed(
                OpenAIRequestError(f"{field}: {error['msg']}", field, error["type"])
            ) from None
        try:
            chat.check_supported()
        except OpenAIRequestError as exc:
            raise self.renamed(exc) from None
        return chat

    def renamed(self, error: OpenAIRequestError) -> OpenAIRequestError:
        """``error`` of the chat completion this request amounts to, naming this request's
        parameter instead (``messages[...]`` is the question's, ``max_tokens`` is
        ``max_output_tokens``); its message too, where it starts with the name."""
        if error.param is None:
            return error
        head = error.param.split("[")[0].split(".")[0]
        if head == "messages":
            param = self.question()[1]
        else:
            param = {"max_tokens": "max_output_tokens"}.get(head, error.param)
        message = str(error)
        if message.startswith(error.param):
            message = param + message[len(error.param) :]
        return OpenAIRequestError(message, param, error.code, error.status)


# ResponsesRequest's fields that are not a chat completion's (mapped, or checked above).
_OWN_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "stream",
        "stream_options",
        "max_output_tokens",
        "truncation",
        "text",
        "include",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_tool_calls",
        "reasoning",
        "previous_response_id",
        "conversation",
        "prompt",
        "background",
        "top_logprobs",
        "safety_identifier",
        "prompt_cache_key",
    }
)


class EmbeddingsRequest(BaseModel):
    """``POST /v1/embeddings``: texts embedded by an index's query encoder. Token ids (which
    OpenAI also accepts as ``input``) are refused: they would be another tokenizer's."""

    model_config = STRICT

    model: str = Field(min_length=1, max_length=256)
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = Field(None, max_length=256)

    def texts(self) -> list[str]:
        """``input`` as a list of texts, each checked against the bounds of a question."""
        texts = [self.input] if isinstance(self.input, str) else self.input
        if not texts:
            raise OpenAIRequestError("input: at least one text is required", "input")
        if len(texts) > MAX_QUERIES:
            raise OpenAIRequestError(
                f"input: at most {MAX_QUERIES} texts per request, got {len(texts)}", "input"
            )
        out: list[str] = []
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise OpenAIRequestError(
                    "input: token ids are not accepted (they would be another tokenizer's): "
                    "send text",
                    "input",
                    "unsupported_value",
                )
            if len(text) > MAX_QUESTION_CHARS:
                raise OpenAIRequestError(
                    f"input[{i}]: at most {MAX_QUESTION_CHARS} characters, got {len(text)}",
                    "input",
                )
            if not text.strip():
                raise OpenAIRequestError(f"input[{i}]: the text is empty", "input")
            out.append(text)
        return out

    def index(self) -> str | None:
        """The index ``model`` names (None: the active one); that it exists is the
        retriever's to say."""
        if self.model == MODEL:
            return None
        return self.model.removeprefix(MODEL + "/")
