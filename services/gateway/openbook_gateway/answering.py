"""The answer pipeline behind ``POST /answer``, the ``/v1`` chat completions and responses, and
the MCP ``answer`` tool (the service layer's answer operation, ``openbook_gateway.operations``):
cache lookup, retrieval, generation (whole, or streamed token by token), cache store.

:func:`answer_events` yields :class:`TokenOut` events while the answer is written (streaming
only) and one :class:`AnswerOut` last. The texts of the token events whose ``passage`` is None
add up to the answer: the generator's token texts, then, as a last token event with no token,
whatever the answer adds to them (a tail the generator held back; for RAG-Sequence and beam
search, which decide only at the end, the whole answer). A cached answer streams the same way:
its tokens (RAG-Token: with their posteriors), then its text.

Abstention: the answer is computed (and cached) as the model gives it; the request's
``min_confidence`` (or the server's default) is applied to it on the way out
(:func:`~openbook_gateway.mapping.with_threshold`), so one cached answer serves every
threshold. A stream's token events cannot wait for the confidence, known only at the end: they
are those of the answer as written, and only the final event says it abstained (its answer
empty). A streaming client must take the final event's answer.

Errors before the first event are the caller's to turn into an HTTP status; an error after it
is raised from the iterator (an ``HTTPException``), for the caller to send as an error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

from fastapi import HTTPException
from opentelemetry.trace import SpanKind
from opentelemetry.util.types import AttributeValue

from openbook.observability import telemetry
from openbook.v1 import generator_pb2, retriever_pb2
from openbook.validation.limits import check_question
from openbook_gateway import key_limits, tenancy
from openbook_gateway.cache import answer_params
from openbook_gateway.conversation import Turn, contextual_question
from openbook_gateway.mapping import (
    answer_response,
    cached_answer,
    generate_request,
    stored_answer,
    with_threshold,
)
from openbook_gateway.operations.caller import Caller
from openbook_gateway.schemas import AnswerRequest
from openbook_gateway.services import Services

T = TypeVar("T")
# How often a request waiting on the generator checks that its HTTP client is still there.
DISCONNECT_POLL_S = 0.25
# nginx's "client closed request": logged and counted, never seen by the gone client.
CLIENT_CLOSED_REQUEST = 499


@dataclass(frozen=True)
class TokenOut:
    """A token of the answer as it is written (see the module docstring)."""

    text: str
    token: str | None  # None: the text that completes the answer, at the end
    passage: int | None = None  # RAG-Sequence: the passage whose own hypothesis grew
    posterior: list[float] | None = None  # RAG-Token: p(z | x, y_<=i)

    def body(self) -> dict:
        return {
            "text": self.text,
            "token": self.token,
            "passage": self.passage,
            "posterior": self.posterior,
        }


@dataclass(frozen=True)
class AnswerOut:
    """The finished answer: the ``AnswerResponse`` body."""

    body: dict


async def unless_disconnected(caller: Caller, call: Awaitable[T]) -> T:
    """Await ``call``; if the caller's HTTP client goes away first, cancel it (and with it the gRPC
    call, so the generator drops the request instead of computing an answer nobody reads)."""
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await caller.is_disconnected():
                raise HTTPException(CLIENT_CLOSED_REQUEST, "the client closed the request")
    finally:
        task.cancel()  # a no-op once done


def confidence_threshold(requested: float | None, services: Services) -> float | None:
    """The threshold an answer is held to: the request's, else the server's default
    (``OPENBOOK_GATEWAY_MIN_CONFIDENCE``); None: none."""
    if requested is not None:
        return requested
    return services.settings.min_confidence


async def answer_events(
    body: AnswerRequest, services: Services, caller: Caller, *, stream: bool
) -> AsyncGenerator[TokenOut | AnswerOut, None]:
    """The answer to ``body`` (module docstring); without ``stream`` only its AnswerOut.

    ``caller``: whose key the answer is held to, the request id, and whether its client is
    still there (a gone client cancels the generation)."""
    # A follow-up is retrieved with the question expanded from the conversation (the cache key
    # and question_used hold that text, which starts with the question as asked), and answered
    # as asked: the generator reads the question the user wrote over the passages the
    # conversation found (docs/benchmarks.md, "Conversations": the expanded text as the
    # generator's question lost every answer of a conversation that changed topic).
    asked = body.question
    body = with_conversation(body)
    # The index it may be answered from: a key held to indexes names only those, and a
    # request naming none gets its first (a 404 otherwise, before the cache is looked at).
    principal = caller.principal
    index = principal.index_for(body.index)
    # What retrieval searches: a key's tenant filter AND the request's (issue 43: no request
    # field widens it); it keys the cached answer too.
    where = principal.where(body.metadata_filter())
    if index != body.index:
        body = body.model_copy(update={"index": index})
    metrics = services.metrics
    request_id = caller.request_id
    timer = metrics.stages()
    # Resolved before the cache key is built: a request without k and one naming the
    # model's default share the key.
    k = body.k if body.k is not None else await services.default_k.get(request_id)
    params = answer_params(body, k, where)
    if asked != body.question:
        # what the generator reads, beside what retrieval searched: the expanded text asked
        # outright is generated from itself, and must not share this answer's entry
        params["asked"] = asked
    # not part of the cache key: applied to the answer, cached or not, on its way out
    threshold = confidence_threshold(body.min_confidence, services)

    if body.cacheable:
        with timer.stage("cache"), telemetry.span("openbook.cache.lookup") as span:
            cached = await services.cache.lookup(body.index, params)
            if cached is not None and "confidence" not in cached:
                cached = None  # stored before answers had a confidence: computed afresh
            span.set_attribute("openbook.cache.hit", cached is not None)
        metrics.cache_lookup(hit=cached is not None)
        if cached is not None:
            # Validated when it was stored: sent as it is, not validated again.
            answer = cached_answer(cached, request_id, timer.done())
            # an answer stored before replies said so: the question of the key that found it
            answer["question_used"] = body.question
            if stream:
                for event in _replayed(answer):
                    yield event
            yield AnswerOut(with_threshold(answer, threshold))
            return
    else:
        metrics.cache_skipped()

    with (
        timer.stage("retrieve"),
        telemetry.span("retrieval", retrieval_attributes(k), SpanKind.CLIENT) as span,
    ):
        retrieved = await services.retrieval.retrieve(
            body.question, k, body.index, request_id, retrieval=body.retrieval, where=where
        )
        span.update_name(f"retrieval {retrieved.index}")
        span.set_attributes(retrieved_attributes(retrieved))
    # a tenant's passages cite its documents by the ids it wrote (tenancy: its namespace);
    # the answer, and the cached answer (keyed by its filter), show those
    tenancy.shown(principal, retrieved)
    passages = list(retrieved.results[0].passages)
    if not passages and where is not None:
        # No passage matches the filter: an empty result, not an error. Nothing to generate
        # from, so the answer abstains (empty, no passages); not cached (nothing computed).
        empty = generator_pb2.GenerateResponse()
        answer = answer_response(body, retrieved, empty, request_id, timer.done())
        yield AnswerOut({**answer, "abstained": True, "min_confidence": threshold})
        return
    if not passages:
        raise HTTPException(409, f"index {retrieved.index!r} returned no passages")
    generated: generator_pb2.GenerateResponse | None = None
    sent = ""  # the answer text streamed so far
    requested = generation_attributes(body, stream)
    try:
        # one of the key's concurrent generations (key_limits), held until the answer is in
        lease = await key_limits.generation(principal, services)
    except key_limits.Limited as limited:
        raise HTTPException(limited.status, limited.message, limited.headers()) from None
    try:
        with (
            timer.stage("generate"),
            telemetry.span("text_completion", requested, SpanKind.CLIENT) as span,
        ):
            as_asked = (
                body if body.question == asked else body.model_copy(update={"question": asked})
            )
            # the key's name, its fair share of the generator (issue 43)
            request = generate_request(as_asked, passages, principal.fair_share_class)
            if not stream:
                generated = await unless_disconnected(
                    caller, services.generator.generate(request, request_id)
                )
            else:
                async for event in services.generator.generate_stream(request, request_id):
                    if event.WhichOneof("event") == "done":
                        generated = event.done
                        break
                    token = event.token
                    passage = token.passage if token.HasField("passage") else None
                    if passage is None:
                        sent += token.text
                    yield TokenOut(
                        token.text, token.token, passage, list(token.doc_posterior) or None
                    )
            if generated is not None:
                span.update_name(f"text_completion {generated.model_version}")
                span.set_attributes(generated_attributes(generated))
    finally:
        await lease.release()
    if generated is None:
        raise HTTPException(502, "generator ended the stream without an answer")

    versions = {"generator": generated.model_version, "retriever": retrieved.model_version}
    metrics.answered(retrieved.index, versions)
    metrics.index_version(retrieved.index, retrieved.index_version)
    services.cache.answered(
        retrieved.index, retrieved.index_version, versions, active=not body.index
    )
    services.default_k.seen(generated.model_version)
    answer = answer_response(body, retrieved, generated, request_id, timer.done())
    if body.cacheable:
        await services.cache.store(
            retrieved.index, retrieved.index_version, params, versions, stored_answer(answer)
        )
    if stream:
        rest = _rest(answer["answer"], sent)
        if rest:
            yield TokenOut(rest, None)
    yield AnswerOut(with_threshold(answer, threshold))


def with_conversation(body: AnswerRequest) -> AnswerRequest:
    """``body`` as answered: with a ``history``, its question expanded from the earlier turns
    (:func:`~openbook_gateway.conversation.contextual_question`), the history then spent; the
    question, the cache key and ``question_used`` are that text. Without one, ``body``."""
    if not body.history:
        return body
    turns = [Turn(message.role, message.content) for message in body.history]
    question = contextual_question(body.question, turns)
    # bounded and cleaned by contextual_question; checked again as every question is
    check_question("question", question)
    return body.model_copy(update={"question": question, "history": None})


def retrieval_attributes(k: int) -> dict[str, AttributeValue]:
    """The GenAI retrieval span's request attributes (the OpenTelemetry GenAI conventions)."""
    return {
        "gen_ai.operation.name": "retrieval",
        "gen_ai.provider.name": telemetry.PROVIDER,
        "gen_ai.retrieval.top_k": k,
    }


def retrieved_attributes(reply: retriever_pb2.RetrieveResponse) -> dict[str, AttributeValue]:
    """What the retrieval span learns from the reply: the index (the GenAI data source), how
    it searched, and how many passages it found."""
    return {
        "gen_ai.data_source.id": reply.index,
        "openbook.retrieval.mode": reply.retrieval,
        "openbook.retrieval.passages": len(reply.results[0].passages) if reply.results else 0,
        "openbook.index.version": reply.index_version,
        "openbook.retriever.model_version": reply.model_version,
    }


def generation_attributes(body: AnswerRequest, stream: bool) -> dict[str, AttributeValue]:
    """The GenAI inference span's request attributes (the sampling ones as the conventions
    name them: ``gen_ai.request.top_k`` is the sampling cut, not retrieval's k)."""
    attributes: dict[str, AttributeValue] = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": telemetry.PROVIDER,
        "gen_ai.request.max_tokens": body.max_new_tokens,
        "gen_ai.request.stream": stream,
        "gen_ai.request.temperature": body.temperature,
        "gen_ai.request.top_p": body.top_p,
        "gen_ai.request.top_k": body.top_k,
        "openbook.decoding": body.decoding,
        "openbook.num_beams": body.num_beams,
    }
    if body.seed is not None:
        attributes["gen_ai.request.seed"] = body.seed
    return attributes


def generated_attributes(reply: generator_pb2.GenerateResponse) -> dict[str, AttributeValue]:
    """The inference span's response attributes: model, token usage and finish reasons."""
    return {
        "gen_ai.response.model": reply.model_version,
        "gen_ai.usage.input_tokens": reply.prompt_tokens,
        "gen_ai.usage.output_tokens": sum(h.num_tokens for h in reply.hypotheses),
        "gen_ai.response.finish_reasons": [h.finish_reason for h in reply.hypotheses],
    }


def _replayed(answer: dict) -> list[TokenOut]:
    """A cached answer's token events: its tokens with their posteriors (RAG-Token), then its
    text."""
    best = answer["hypotheses"][0] if answer.get("hypotheses") else {}
    events = [TokenOut("", t["token"], None, t["posterior"]) for t in best.get("tokens") or []]
    if answer["answer"]:
        events.append(TokenOut(answer["answer"], None))
    return events


def _rest(answer: str, sent: str) -> str:
    """What ``answer`` adds to the text already streamed (nothing after a divergence, which the
    generator's incremental decoding avoids: the answer event has the text)."""
    return answer[len(sent) :] if answer.startswith(sent) else ""
