"""The Responses API's wire format (``POST /v1/responses``): a response object, whole or as
its stream of named events.

* The answer is one ``message`` output item holding one ``output_text`` content part: the text
  of the chat completion the request amounts to (:class:`~openbook_gateway.openai_format.
  Completion`: cut at a stop, ``[i]`` markers appended, or the abstention), so both APIs say
  the same thing.
* Each ``[i]`` marker in the text has one ``url_citation`` annotation: ``start_index`` and
  ``end_index`` are the marker's span (``text[start_index:end_index] == "[i]"``), ``title``
  the passage's title, ``url`` ``openbook://<index>/passages/<passage id>``; openbook's
  documented extra fields: ``passage_id``, ``citation`` (the i of the marker), ``score``,
  ``prior`` and ``posterior``. The response also carries every passage used as ``citations``
  and openbook's provenance as ``openbook``, as a chat completion does.
* A stream sends, each once and in this order with a growing ``sequence_number``:
  ``response.created``, ``response.in_progress``, ``response.output_item.added``,
  ``response.content_part.added``, then ``response.output_text.delta`` as the text is written
  (RAG-Token greedy; the other modes decide at the end), one
  ``response.output_text.annotation.added`` per marker, ``response.output_text.done``,
  ``response.content_part.done``, ``response.output_item.done`` and ``response.completed``
  (the whole response). The deltas add up to the done text. A stream that fails after it began
  ends with an ``error`` event and a ``response.failed`` one.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from urllib.parse import quote

from fastapi import HTTPException

from openbook_gateway.answering import AnswerOut, TokenOut
from openbook_gateway.events import sse
from openbook_gateway.openai_format import Completion, _before_stop, _markers, error_body
from openbook_gateway.openai_responses import ResponsesRequest
from openbook_gateway.openai_schemas import ChatCompletionRequest
from openbook_gateway.stored_responses import new_response_id


class ResponseReply:
    """The reply to one ``POST /v1/responses``, whole or as events (module docstring)."""

    def __init__(
        self,
        body: ResponsesRequest,
        chat: ChatCompletionRequest,
        request_id: str,
        holds_text: bool = False,
    ) -> None:
        """``chat``: the chat completion ``body`` amounts to (its text rules); ``holds_text``:
        a confidence threshold applies, so a stream sends no text before the end."""
        self.body = body
        self.completion = Completion(chat, request_id, holds_text=holds_text)
        # random, not the request id a client may choose: a stored response is found by it
        self.id = new_response_id()
        # whether its conversation was kept for a later previous_response_id (set by the route
        # once the answer is in, before the response that says so is written)
        self.stored = False
        self.item_id = f"msg_{request_id}"
        self.created = int(time.time())
        self._sequence = 0

    def whole(self, answer: dict) -> dict:
        return self._response("completed", answer)

    async def events(
        self, first: TokenOut | AnswerOut, events: AsyncGenerator[TokenOut | AnswerOut, None]
    ) -> AsyncGenerator[bytes, None]:
        """The stream of named events (module docstring)."""
        try:
            yield self._event("response.created", response=self._response("in_progress"))
            yield self._event("response.in_progress", response=self._response("in_progress"))
            yield self._event(
                "response.output_item.added",
                output_index=0,
                item=self._item("in_progress", []),
            )
            yield self._event(
                "response.content_part.added", **self._where(), part=_text_part("", [])
            )
            written, sent = "", ""  # the text so far, and what was sent of it
            stops = self.completion.stops
            event = first
            while isinstance(event, TokenOut):
                if event.passage is None and not self.completion.holds_text:
                    written += event.text
                    # trailing whitespace waits: markers may follow it instead of more text
                    visible = _before_stop(written, stops).rstrip()
                    if len(visible) > len(sent):
                        yield self._delta(visible[len(sent) :])
                        sent = visible
                event = await anext(events)
            answer = event.body
            text, annotations = self._text(answer)
            if text.startswith(sent) and len(text) > len(sent):
                yield self._delta(text[len(sent) :])
            for i, annotation in enumerate(annotations):
                yield self._event(
                    "response.output_text.annotation.added",
                    **self._where(),
                    annotation_index=i,
                    annotation=annotation,
                )
            yield self._event("response.output_text.done", **self._where(), text=text, logprobs=[])
            part = _text_part(text, annotations)
            yield self._event("response.content_part.done", **self._where(), part=part)
            whole = self._response("completed", answer)
            yield self._event("response.output_item.done", output_index=0, item=whole["output"][0])
            yield self._event(f"response.{whole['status']}", response=whole)
        except HTTPException as exc:
            status = 400 if exc.status_code == 422 else exc.status_code
            error = error_body(status, exc.detail)["error"]
            yield self._event("error", code=error["type"], message=error["message"], param=None)
            failed = self._response("failed")
            failed["error"] = {"code": "server_error" if status >= 500 else error["type"]}
            failed["error"]["message"] = error["message"]
            yield self._event("response.failed", response=failed)
        except StopAsyncIteration:
            failed = self._response("failed")
            failed["error"] = {
                "code": "server_error",
                "message": "the answer ended without a final event",
            }
            yield self._event("response.failed", response=failed)
        finally:
            await events.aclose()

    def _text(self, answer: dict) -> tuple[str, list[dict]]:
        """The answer's text (as the chat completion's first choice) and its annotations:
        one per ``[i]`` marker, at the marker's span."""
        text, _ = self.completion._choices(answer)[0]
        hyp = answer["hypotheses"][0] if answer["hypotheses"] else {}
        markers = _markers(hyp, answer).lstrip() if hyp else ""
        if not (self.completion.body.citation_markers and markers and text.endswith(markers)):
            return text, []
        annotations = []
        at = len(text) - len(markers)
        for marker in markers.replace("]", "]\n").split():
            number = int(marker.strip("[]"))
            passage = answer["passages"][number - 1]
            annotations.append(
                {
                    "type": "url_citation",
                    "start_index": at,
                    "end_index": at + len(marker),
                    "title": passage.get("title") or "",
                    "url": passage_url(answer.get("index") or "", passage.get("id") or ""),
                    # openbook's extra fields (docs/api.md)
                    "passage_id": passage.get("id"),
                    "citation": number,
                    "score": passage.get("score"),
                    "prior": passage.get("prior"),
                    "posterior": passage.get("posterior"),
                }
            )
            at += len(marker)
        return text, annotations

    def _response(self, status: str, answer: dict | None = None) -> dict:
        body = self.body
        output: list[dict] = []
        usage = None
        extras: dict = {}
        incomplete = None
        if answer is not None:
            text, annotations = self._text(answer)
            output = [self._item("completed", [_text_part(text, annotations)])]
            chat_usage = self.completion._usage(answer)
            usage = {
                "input_tokens": chat_usage["prompt_tokens"],
                "input_tokens_details": chat_usage["prompt_tokens_details"],
                "output_tokens": chat_usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": chat_usage["total_tokens"],
            }
            extras = Completion._extras(answer)
            _, finish = self.completion._choices(answer)[0]
            if finish == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": output,
            "parallel_tool_calls": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": "none",
            "tools": [],
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage,
            "metadata": body.metadata or {},
            "store": self.stored,
            "previous_response_id": body.previous_response_id,
            "user": body.user,
            **extras,
        }

    def _item(self, status: str, content: list[dict]) -> dict:
        return {
            "type": "message",
            "id": self.item_id,
            "status": status,
            "role": "assistant",
            "content": content,
        }

    def _where(self) -> dict:
        return {"item_id": self.item_id, "output_index": 0, "content_index": 0}

    def _delta(self, text: str) -> bytes:
        return self._event("response.output_text.delta", **self._where(), delta=text, logprobs=[])

    def _event(self, kind: str, **fields: object) -> bytes:
        body = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse(body, event=kind)


def _text_part(text: str, annotations: list[dict]) -> dict:
    return {"type": "output_text", "text": text, "annotations": annotations, "logprobs": []}


def passage_url(index: str, passage_id: str) -> str:
    """The ``url`` of a citation: names the passage (and its index) for a client that
    dereferences nothing; ``GET /indexes/{index}/documents/{id}`` serves a written
    document's passages."""
    return f"openbook://{quote(index, safe='')}/passages/{quote(passage_id, safe='')}"
