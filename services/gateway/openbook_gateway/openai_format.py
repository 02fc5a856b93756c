"""OpenAI's wire format, as the OpenAI-compatible API (:mod:`openbook_gateway.routes.openai`)
writes it: error objects, and a chat completion's reply, whole or as stream chunks.

* Errors are ``{"error": {"message", "type", "param", "code"}}``; input the services refused
  (their 422) is a 400, as OpenAI answers bad input. Every error under :data:`PREFIX` takes
  this shape, from a handler, the middlewares or the server's request-head limits.
* A reply carries the passages used as ``citations`` (1-based, as the ``[i]`` markers appended
  to each answer when ``citation_markers`` is on) and openbook's provenance in ``openbook``.
* A stream under a confidence threshold holds the text back until the confidence is known at
  the end (a chat client cannot take back text it was sent): it comes whole, or the
  abstention does, in the last content chunk.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncGenerator

from fastapi import HTTPException
from fastapi.responses import JSONResponse

from openbook_gateway.answering import AnswerOut, TokenOut
from openbook_gateway.conversation import ABSTENTION_PREFIX
from openbook_gateway.events import sse
from openbook_gateway.openai_schemas import ChatCompletionRequest

PREFIX = "/v1"

# HTTP status -> OpenAI's error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


def is_openai_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def error_body(
    status: int, message: object, param: str | None = None, code: str | None = None
) -> dict:
    kind = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": str(message), "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: object,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    # Input the services refused (422 there) is a 400 here, as OpenAI answers bad input.
    if status == 422 and param is None:
        param = _field_of(message)
    status = 400 if status == 422 else status
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


# What openbook serves under PREFIX: named in the 404 of every other path.
SERVED_ROUTES = (
    "POST /v1/chat/completions",
    "POST /v1/responses",
    "POST /v1/embeddings",
    "GET /v1/models",
    "GET /v1/models/{model}",
)


def unsupported_route(method: str, path: str) -> JSONResponse:
    """The 404 of a path under :data:`PREFIX` that openbook does not serve."""
    message = (
        f"{method} {path} is not supported by openbook; it serves "
        f"{', '.join(SERVED_ROUTES)} (docs/api.md)"
    )
    return error_response(404, message, None, "unsupported_endpoint")


# The services' own refusals name the field first ("retrieval: 'hybrid' needs ...").
_FIELD_PREFIX = re.compile(r"([a-z_]+): ")


def _field_of(message: object) -> str | None:
    """The field a service's refusal names at its start, if it names one that way."""
    match = _FIELD_PREFIX.match(message) if isinstance(message, str) else None
    return match.group(1) if match else None


def validation_error_response(errors: list[dict]) -> JSONResponse:
    """The first of a body's validation errors, as OpenAI reports bad input."""
    first = errors[0] if errors else {}
    if first.get("type") in ("json_invalid", "content_type"):  # the body as a whole
        return error_response(400, f"body: {first.get('msg')}", None, first.get("type"))
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = loc[0] if loc else None
    for part in loc[1:]:
        param = f"{param}[{part}]" if part.isdigit() else f"{param}.{part}"
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = f"Unrecognized request argument supplied: {param}"
    elif param:
        message = f"{param}: {message}"
    return error_response(400, message, param, first.get("type"))


class Completion:
    """The reply to one chat completion, whole or as chunks (module docstring)."""

    def __init__(
        self, body: ChatCompletionRequest, request_id: str, holds_text: bool = False
    ) -> None:
        """``holds_text``: a confidence threshold applies, so a stream sends no text before
        the end (module docstring)."""
        self.body = body
        self.holds_text = holds_text
        self.stops = body.stop_sequences()
        self.id = f"chatcmpl-{request_id}"
        self.created = int(time.time())

    def whole(self, answer: dict) -> dict:
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": content, "refusal": None},
                "finish_reason": finish,
                "logprobs": None,
            }
            for i, (content, finish) in enumerate(self._choices(answer))
        ]
        return {
            "id": self.id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.body.model,
            "system_fingerprint": answer.get("model_version"),
            "choices": choices,
            "usage": self._usage(answer),
            **self._extras(answer),
        }

    async def chunks(
        self, first: TokenOut | AnswerOut, events: AsyncGenerator[TokenOut | AnswerOut, None]
    ) -> AsyncGenerator[bytes, None]:
        """The stream: a role chunk, the first answer's text as it is written (RAG-Token greedy;
        other modes decide at the end), each answer's rest and finish reason, the usage when
        asked for, then ``[DONE]``; or an error object if it fails on the way."""
        try:
            yield self._chunk([_delta(0, {"role": "assistant", "content": ""})])
            written, sent = "", ""  # the first answer's text so far, and what was sent of it
            event = first
            while isinstance(event, TokenOut):
                if event.passage is None and self.body.n == 1 and not self.holds_text:
                    written += event.text
                    # trailing whitespace waits: the markers may follow it instead of more
                    # text, and they follow one space (``_choices``)
                    visible = _before_stop(written, self.stops).rstrip()
                    if len(visible) > len(sent):
                        yield self._chunk([_delta(0, {"content": visible[len(sent) :]})])
                        sent = visible
                event = await anext(events)
            answer = event.body
            choices = self._choices(answer)
            for i, (content, finish) in enumerate(choices):
                if i == 0:  # its role went first, and perhaps some of its text
                    delta = {"content": content[len(sent) :]} if content.startswith(sent) else {}
                else:
                    delta = {"role": "assistant", "content": content}
                if delta.get("content") or "role" in delta:
                    yield self._chunk([_delta(i, delta)])
                # the passages cited and the provenance come once, with the last finish
                extras = self._extras(answer) if i == len(choices) - 1 else None
                yield self._chunk([_delta(i, {}, finish)], extras=extras)
            if self.body.stream_options is not None and self.body.stream_options.include_usage:
                yield self._chunk([], usage=self._usage(answer))
            yield sse("[DONE]")
        except HTTPException as exc:
            status = 400 if exc.status_code == 422 else exc.status_code
            yield sse(error_body(status, exc.detail))
        except StopAsyncIteration:
            yield sse(error_body(502, "the answer ended without a final event"))
        finally:
            await events.aclose()

    def _chunk(self, choices: list[dict], usage: dict | None = None, extras: dict | None = None):
        body = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
            **(extras or {}),
        }
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    def _choices(self, answer: dict) -> list[tuple[str, str]]:
        """(content, finish_reason) of each answer: cut at a stop sequence, markers added; or
        the abstention, for an answer below the request's confidence threshold."""
        out = []
        threshold = answer.get("min_confidence")
        for hyp in answer["hypotheses"][: self.body.n]:
            confidence = hyp.get("confidence", 0.0)
            if threshold is not None and confidence < threshold:
                out.append((abstention(confidence, threshold), "stop"))
                continue
            content = _before_stop(hyp["text"], self.stops, hold=False)
            finish = "stop" if len(content) < len(hyp["text"]) else hyp.get("finish_reason")
            if self.body.citation_markers and content.strip():
                # one space before the markers, whatever the text ended with: a stop that
                # follows a space ("the world's greatest", stop "greatest") leaves it
                content = content.rstrip() + _markers(hyp, answer)
            out.append((content, finish or "stop"))
        return out

    def _usage(self, answer: dict) -> dict:
        prompt = answer.get("prompt_tokens") or 0
        completion = sum(h.get("num_tokens") or 0 for h in answer["hypotheses"][: self.body.n])
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            # the passage prompts' tokens the generator's passage cache held
            "prompt_tokens_details": {"cached_tokens": answer.get("cached_prompt_tokens") or 0},
        }

    @staticmethod
    def _extras(answer: dict) -> dict:
        """The documented extra fields: the passages used, and openbook's provenance."""
        citations = [
            {"index": i + 1, **{key: p.get(key) for key in _CITED}}
            for i, p in enumerate(answer["passages"])
        ]
        provenance = {key: answer.get(key) for key in _PROVENANCE}
        return {"citations": citations, "openbook": provenance}


_CITED = ("id", "document", "title", "page", "text", "score", "prior", "posterior")
_PROVENANCE = (
    # what was retrieved and answered: the question, expanded from the conversation
    "question_used",
    "index",
    "index_version",
    "retrieval",
    "model_version",
    "retriever_version",
    "decoding",
    "hypotheses",
    "cached",
    "request_id",
    "timings_ms",
    "confidence",
    "abstained",
    "min_confidence",
)


def abstention(confidence: float, threshold: float) -> str:
    """The message of an answer withheld for its low confidence."""
    digits = 2
    while digits < 6 and f"{confidence:.{digits}f}" == f"{threshold:.{digits}f}":
        digits += 1  # 0.499 < 0.5 must not read "0.50 < 0.50"
    shown, limit = f"{confidence:.{digits}f}", f"{threshold:.{digits}f}"
    return f"{ABSTENTION_PREFIX} (confidence {shown} < {limit})."


def _delta(index: int, delta: dict, finish: str | None = None) -> dict:
    return {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}


def _before_stop(text: str, stops: list[str], hold: bool = True) -> str:
    """``text`` up to its first stop sequence; with ``hold``, also without a tail that may be
    the start of one (more text may complete it)."""
    cuts = [text.find(stop) for stop in stops if stop in text]
    if cuts:
        return text[: min(cuts)]
    if hold:
        for stop in stops:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    return text[: len(text) - n]
    return text


def _markers(hyp: dict, answer: dict) -> str:
    """`` [i][j]``: the passages an answer was drawn from, in the order they first count.

    RAG-Token: the most probable passage of each token (its per-token posterior);
    RAG-Sequence: the most probable passage given the whole answer; otherwise the best
    passage of the answer's posterior (or prior)."""
    used: list[int] = []
    if hyp.get("tokens"):
        for token in hyp["tokens"]:
            best = _argmax(token["posterior"])
            if best is not None and best not in used:
                used.append(best)
    elif hyp.get("doc_posterior"):
        best = _argmax(hyp["doc_posterior"])
        used = [] if best is None else [best]
    else:
        scores = [p.get("posterior") or p.get("prior") or 0.0 for p in answer["passages"]]
        best = _argmax(scores)
        used = [] if best is None else [best]
    return (" " + "".join(f"[{i + 1}]" for i in used)) if used else ""


def _argmax(values: list[float]) -> int | None:
    return max(range(len(values)), key=values.__getitem__) if values else None
