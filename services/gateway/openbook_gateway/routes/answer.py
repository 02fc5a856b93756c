"""``POST /answer``: the answer to one question, whole (JSON) or as Server-Sent Events.

The handler only picks the shape; the answer comes from :mod:`openbook_gateway.answering`.
A stream's events (docs/api.md): ``token`` events as the answer is written, then one
``answer`` event with the JSON body, or an ``error`` event if it fails after the stream
began. Before the first event (retrieval and the prompt's prefill), an error is the usual
HTTP error.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from functools import partial

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from openbook_gateway.answering import AnswerOut, TokenOut, answer_events, unless_disconnected
from openbook_gateway.bodies import JSONBodyRoute
from openbook_gateway.events import STREAMED, EventStream, sse
from openbook_gateway.operations.caller import caller_of
from openbook_gateway.schemas import AnswerRequest, AnswerResponse
from openbook_gateway.services import ServicesDep

log = logging.getLogger(__name__)

router = APIRouter(route_class=JSONBodyRoute)


@router.post("/answer", response_model=AnswerResponse, responses=STREAMED)
async def answer(body: AnswerRequest, request: Request, services: ServicesDep) -> Response:
    """The answer, or with ``"stream": true`` Server-Sent Events: ``token`` events as it is
    written, then an ``answer`` event with the same body (an ``error`` event if it fails
    after the stream began; before that, the usual HTTP error)."""
    caller = caller_of(request)
    events = answer_events(body, services, caller, stream=body.stream)
    if not body.stream:
        async for event in events:
            if isinstance(event, AnswerOut):
                return JSONResponse(event.body)
        raise HTTPException(502, "no answer")  # answer_events always ends with one
    # The first event waits for retrieval and the prompt's prefill: errors until then are
    # plain HTTP errors.
    first = await unless_disconnected(caller, anext(events))
    stream = answer_sse(first, events, caller.request_id)
    return EventStream(stream, on_end=partial(services.metrics.stream_ended, "answer"))


async def answer_sse(
    first: TokenOut | AnswerOut,
    events: AsyncGenerator[TokenOut | AnswerOut, None],
    request_id: str,
) -> AsyncGenerator[bytes, None]:
    """``/answer``'s Server-Sent Events (docs/api.md): ``token``, then ``answer`` or ``error``."""
    try:
        event = first
        while True:
            if isinstance(event, AnswerOut):
                yield sse(event.body, "answer")
                return
            yield sse(event.body(), "token")
            event = await anext(events)
    except HTTPException as exc:
        yield sse(error_event(exc.status_code, exc.detail, request_id), "error")
    except StopAsyncIteration:
        yield sse(error_event(502, "the answer ended without a final event", request_id), "error")
    except Exception:  # noqa: BLE001 - the stream has begun: end it with an error event
        log.exception("answer stream failed")
        yield sse(error_event(500, "internal error", request_id), "error")
    finally:
        await events.aclose()


def error_event(status: int, detail: object, request_id: str) -> dict:
    """An error event's body: as an HTTP error's, with the request id of a failure."""
    body = {"status": status, "detail": detail}
    return {**body, "request_id": request_id} if status >= 500 else body
