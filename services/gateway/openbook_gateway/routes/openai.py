"""The OpenAI-compatible API: ``POST /v1/chat/completions`` and ``POST /v1/responses``
(whole or streamed), ``POST /v1/embeddings`` and ``GET /v1/models``, so that OpenAI's SDKs,
agent frameworks and chat front-ends work unchanged. Any other ``/v1`` path is an OpenAI-style
404 saying it is not supported (:func:`openbook_gateway.errors.http_error`).

* The last user message is the question. The conversation before it (the user and assistant
  messages of ``messages`` / ``input``, after the stored state of a ``previous_response_id``)
  expands a follow-up before retrieval and generation (:mod:`openbook_gateway.conversation`):
  the last user turns and the last answer, bounded; ``openbook.question_used`` says what was
  asked. A response is kept (its conversation state only, for
  ``OPENBOOK_GATEWAY_RESPONSE_TTL_S``) unless ``store`` is false
  (:mod:`openbook_gateway.stored_responses`).
* Models: ``openbook`` answers from the active index, ``openbook/<index>`` from that index.
* Decoding is greedy, or beam search (``num_beams``; ``n`` > 1 answers are the n best beams),
  or, with ``temperature`` > 0, sampling (``top_p``, ``top_k``, ``seed``; ``n`` > 1 answers are
  n independent samples): the sampling fields and their bounds are
  :class:`~openbook_gateway.openai_schemas.SamplingParams`, shared by the ``/v1`` routes.
* ``stop`` cuts each answer at its first stop sequence (the answer is still computed whole).
* The reply carries the passages used as ``citations`` (1-based, as the ``[i]`` markers appended
  to each answer when ``citation_markers`` is on) and openbook's provenance in ``openbook``,
  the answer's ``confidence`` and whether it ``abstained`` included.
* ``min_confidence`` (extra body field; default: ``OPENBOOK_GATEWAY_MIN_CONFIDENCE``): a choice
  whose answer's confidence is below it says so in its message instead of answering
  (:func:`~openbook_gateway.openai_format.abstention`). A stream under a threshold holds the
  text back until the confidence is known at the end (a chat client cannot take back text it
  was sent): it comes whole, or the abstention does, in the last content chunk.
* Errors are OpenAI's error objects (``{"error": {"message", "type", "param", "code"}}``); a
  stream that fails after it began ends with such an object as its last event.
* With ``OPENBOOK_GATEWAY_API_KEYS`` set (or ``OPENBOOK_GATEWAY_REQUIRE_KEYS``), every ``/v1``
  call needs a key with the ``ask`` scope (``openbook_gateway.access``); a key held to indexes
  is offered and may name only those (``openbook`` is then its first).

The answer itself comes from the same pipeline as ``POST /answer``
(:mod:`openbook_gateway.answering`): the same cache, limits and errors. The reply's wire
format is :mod:`openbook_gateway.openai_format`.
"""

from __future__ import annotations

import base64
import struct
from collections.abc import AsyncGenerator, Callable, Sequence
from functools import partial

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from openbook_gateway.answering import (
    AnswerOut,
    TokenOut,
    answer_events,
    confidence_threshold,
    unless_disconnected,
)
from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.conversation import Turn
from openbook_gateway.events import STREAMED, EventStream
from openbook_gateway.openai_format import PREFIX, Completion
from openbook_gateway.openai_responses import EmbeddingsRequest, ResponsesRequest
from openbook_gateway.openai_schemas import (
    MODEL,
    ChatCompletionRequest,
    OpenAIRequestError,
    to_answer_request,
)
from openbook_gateway.operations import indexes as index_operations
from openbook_gateway.operations import search as search_operations
from openbook_gateway.operations.caller import Caller, caller_of
from openbook_gateway.responses_format import ResponseReply
from openbook_gateway.services import Services, ServicesDep
from openbook_gateway.stored_responses import load_turns, owner_of, save_turns

# What answer_events yields: token events as the answer is written, then the answer.
AnswerEvents = AsyncGenerator[TokenOut | AnswerOut, None]

router = APIRouter(prefix=PREFIX, route_class=JSONBodyRoute)


def model_card(model_id: str, services: Services) -> dict:
    return {
        "id": model_id,
        "object": "model",
        "created": services.created,
        "owned_by": "openbook",
    }


async def model_ids(services: Services, caller: Caller) -> list[str]:
    """``openbook`` and ``openbook/<index>`` for every index that can be loaded: a model
    that names an index the retriever says is broken (``problem``) is not offered, nor one
    the caller's key may not name."""
    usable = await index_operations.loadable_names(services, caller)
    return [MODEL, *(f"{MODEL}/{name}" for name in usable)]


@router.get("/models")
async def models(request: Request, services: ServicesDep) -> dict:
    """``openbook`` (the active index) and ``openbook/<index>`` for every loadable index."""
    ids = await model_ids(services, caller_of(request))
    return {"object": "list", "data": [model_card(m, services) for m in ids]}


@router.get("/models/{model_id:path}")
async def model(model_id: str, request: Request, services: ServicesDep) -> dict:
    if model_id not in await model_ids(services, caller_of(request)):
        raise _unknown_model(model_id)
    return model_card(model_id, services)


async def index_of(body: ChatCompletionRequest, services: Services, caller: Caller) -> str | None:
    """The index the model (and the ``index`` extra field) name; None: the active one."""
    index: str | None = None
    if body.model != MODEL:
        if body.model not in await model_ids(services, caller):
            raise _unknown_model(body.model)
        index = body.model.removeprefix(MODEL + "/")
    if body.index is not None:
        if index is not None and body.index != index:
            raise OpenAIRequestError(
                f"index {body.index!r} contradicts model {body.model!r}", "index"
            )
        index = body.index
    return index


@router.post("/chat/completions", responses=STREAMED)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, services: ServicesDep
) -> Response:
    body.check_supported()
    caller = caller_of(request)
    question = to_answer_request(body, await index_of(body, services, caller))
    threshold = confidence_threshold(body.min_confidence, services)
    reply = Completion(body, caller.request_id, holds_text=threshold is not None)
    events = answer_events(question, services, caller, stream=body.stream)
    return await _reply(events, caller, services, reply.whole, reply.chunks, body.stream)


@router.post("/responses", responses=STREAMED)
async def responses(
    body: ResponsesRequest,
    request: Request,
    services: ServicesDep,
) -> Response:
    """The Responses API: the chat completion the request amounts to
    (:meth:`~openbook_gateway.openai_responses.ResponsesRequest.to_chat_request`), after the
    conversation of ``previous_response_id`` if it names one; its citations as the annotations
    of its text (:mod:`openbook_gateway.responses_format`); its conversation kept for the next
    one unless ``store`` is false."""
    body.check_supported()
    caller = caller_of(request)
    owner = owner_of(caller.principal)
    prior: list[Turn] = []
    if body.previous_response_id is not None:
        prior = await load_turns(services, body.previous_response_id, owner)
    chat = body.to_chat_request(prior)
    try:
        question = to_answer_request(chat, await index_of(chat, services, caller))
    except OpenAIRequestError as exc:
        raise body.renamed(exc) from None
    threshold = confidence_threshold(chat.min_confidence, services)
    reply = ResponseReply(body, chat, caller.request_id, holds_text=threshold is not None)
    events = answer_events(question, services, caller, stream=body.stream)
    if body.store is not False:
        said, _ = body.question()
        turns = [*body.history(prior), Turn("user", said)]
        events = _storing(events, services, reply, owner, turns)
    return await _reply(events, caller, services, reply.whole, reply.events, body.stream)


async def _storing(
    events: AnswerEvents, services: Services, reply: ResponseReply, owner: str, turns: list[Turn]
) -> AnswerEvents:
    """``events``, the response's conversation (``turns`` and the answer) kept under its id
    once the answer is in, before the answer goes on to be written (it says ``store``)."""
    try:
        async for event in events:
            if isinstance(event, AnswerOut):
                answered = [*turns, Turn("assistant", event.body.get("answer") or "")]
                reply.stored = await save_turns(services, reply.id, owner, answered)
            yield event
    finally:
        await events.aclose()


@router.post("/embeddings")
async def embeddings(body: EmbeddingsRequest, request: Request, services: ServicesDep) -> dict:
    """The texts embedded by the query encoder that retrieval on the model's index uses
    (``openbook``: the active index), as OpenAI's embeddings list."""
    texts = body.texts()
    caller = caller_of(request)
    index: str | None = None
    if body.model != MODEL:
        if body.model not in await model_ids(services, caller):
            raise _unknown_model(body.model)
        index = body.model.removeprefix(MODEL + "/")
    try:
        # a key held to indexes: its first when the model names none
        reply = await search_operations.embed(services, caller, texts, index)
    except HTTPException as exc:
        if exc.status_code == 409:  # a bm25 index: it has no query encoder
            raise OpenAIRequestError(str(exc.detail), "model", "unsupported_model") from None
        if exc.status_code == 422:  # a text the retriever refuses as a query
            raise OpenAIRequestError(str(exc.detail), "input") from None
        raise
    dim = len(reply.embeddings[0].vector) if reply.embeddings else 0
    if body.dimensions is not None and body.dimensions != dim:
        raise OpenAIRequestError(
            f"dimensions: the query encoder of index {reply.index!r} gives {dim} dimensions, "
            f"got {body.dimensions} (vectors are not shortened)",
            "dimensions",
            "unsupported_value",
        )
    tokens = sum(e.num_tokens for e in reply.embeddings)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": encode_vector(e.vector, body.encoding_format),
            }
            for i, e in enumerate(reply.embeddings)
        ],
        "model": body.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        "openbook": {"index": reply.index, "model_version": reply.model_version, "dim": dim},
    }


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """A vector as OpenAI sends it: floats, or base64 of its little-endian float32 bytes
    (what the official clients ask for by default, and decode)."""
    if encoding_format == "base64":
        packed = struct.pack(f"<{len(vector)}f", *vector)
        return base64.b64encode(packed).decode("ascii")
    return list(vector)


def _unknown_model(model_id: str) -> OpenAIRequestError:
    return OpenAIRequestError(
        f"The model {model_id!r} does not exist: GET /v1/models lists '{MODEL}' (the active "
        f"index) and '{MODEL}/<index>' for each index",
        "model",
        "model_not_found",
        status=404,
    )


async def _reply(
    events: AnswerEvents,
    caller: Caller,
    services: Services,
    whole: Callable[[dict], dict],
    streamed: Callable[[TokenOut | AnswerOut, AnswerEvents], AsyncGenerator[bytes, None]],
    stream: bool,
) -> Response:
    """The reply of a /v1 route over ``answer_events``: ``whole`` of the final answer's body,
    or an event stream of ``streamed`` from the first event on (chat chunks, response events)."""
    if not stream:
        async for event in events:
            if isinstance(event, AnswerOut):
                return JSONResponse(whole(event.body))
        raise HTTPException(502, "no answer")  # answer_events always ends with one
    first = await unless_disconnected(caller, anext(events))
    return EventStream(
        streamed(first, events), on_end=partial(services.metrics.stream_ended, "openai")
    )
