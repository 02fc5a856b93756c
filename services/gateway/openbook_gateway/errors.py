"""How the gateway answers an error: the exception handlers ``create_app`` registers.

Invariants: under ``/v1`` every error is OpenAI's error object (``openai_format``); elsewhere
a client's mistake is FastAPI's ``{"detail": ...}`` and a failure (5xx, here or in a service)
adds the request id, which finds it in the logs. A 422 echoes back what the client sent, as
ASCII JSON that renders whatever that was (:class:`AsciiJSONResponse`), but never more than a
prefix of it (:func:`bounded`: at most :data:`MAX_ECHO_CHARS` characters of each bad value, its
JSON text cut where it is longer, and of each name in ``loc``; issue 42: a 31 MB body was sent
back whole), so a refusal costs no more to send than the request's first bytes.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from openbook_gateway import openai_format
from openbook_gateway.bodies import readable
from openbook_gateway.openai_schemas import OpenAIRequestError


class AsciiJSONResponse(JSONResponse):
    """JSON that renders whatever a client sent (echoed back in a 422): non-ASCII is escaped,
    so even lone surrogates, which UTF-8 cannot encode, come out; NaN and ±Infinity (which
    Python's json reads, and 1e400 as inf) come out as the strings "NaN", "Infinity" and
    "-Infinity", since strict JSON has no such numbers."""

    def render(self, content: Any) -> bytes:
        try:
            text = json.dumps(content, allow_nan=False, separators=(",", ":"))
        except ValueError:
            text = json.dumps(_finite(content), allow_nan=False, separators=(",", ":"))
        return text.encode("ascii")


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by its JSON-ish name."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


# The most characters of a bad value, a name in an error's loc, or a message a 422 echoes.
MAX_ECHO_CHARS = 256
MAX_MESSAGE_CHARS = 1024
TRUNCATED = "..."


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit] + TRUNCATED


def _bounded_input(value: Any) -> tuple[Any, bool]:
    """``value`` if it is short, else a prefix of it (of its JSON text, for anything but a
    string), and whether it was cut."""
    if isinstance(value, str):
        return (value, False) if len(value) <= MAX_ECHO_CHARS else (value[:MAX_ECHO_CHARS], True)
    if value is None or isinstance(value, bool | float):
        return value, False
    try:
        text = json.dumps(jsonable_encoder(value), separators=(",", ":"))
    except (RecursionError, ValueError, TypeError):
        return "", True  # nested past what can be rendered: nothing of it
    if len(text) <= MAX_ECHO_CHARS:
        return value, False
    return text[:MAX_ECHO_CHARS], True


def bounded(errors: Sequence[dict]) -> list[dict]:
    """``errors`` with each ``input`` at most :data:`MAX_ECHO_CHARS` characters (a cut one
    is the prefix of its JSON text, marked ``input_truncated``), each string of ``loc`` (an
    unknown key is named by itself) at most that too, and each ``msg`` at most
    :data:`MAX_MESSAGE_CHARS`."""
    out = []
    for error in errors:
        error = dict(error)
        if "loc" in error:
            error["loc"] = tuple(
                _cut(part, MAX_ECHO_CHARS) if isinstance(part, str) else part
                for part in error["loc"]
            )
        if isinstance(error.get("msg"), str):
            error["msg"] = _cut(error["msg"], MAX_MESSAGE_CHARS)
        if "input" in error:
            error["input"], cut = _bounded_input(error["input"])
            if cut:
                error["input_truncated"] = True
        out.append(error)
    return out


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body or parameter that failed validation: 422 (OpenAI's 400 under ``/v1``)."""
    errors = bounded(readable(exc.errors()))
    if openai_format.is_openai_path(request.url.path):
        return openai_format.validation_error_response(errors)
    try:
        return AsciiJSONResponse({"detail": jsonable_encoder(errors)}, 422)
    except RecursionError:
        # JSON nested nearly as deep as the parser allows cannot be echoed back from down
        # here: name the field and the problem, without the input.
        shallow = [
            {key: err[key] for key in ("type", "loc", "msg") if key in err} for err in errors
        ]
        return AsciiJSONResponse({"detail": jsonable_encoder(shallow)}, 422)


async def openai_request_error(request: Request, exc: OpenAIRequestError) -> JSONResponse:
    """A request the OpenAI-compatible API refuses, as OpenAI's error object."""
    return openai_format.error_response(exc.status, exc, exc.param, exc.code, exc.headers)


async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
    """An ``HTTPException`` raised by a handler, a dependency or a service client."""
    if openai_format.is_openai_path(request.url.path):
        headers = getattr(exc, "headers", None)
        if exc.status_code == 404 and "endpoint" not in request.scope:
            # no route matched (a handler's 404 has its endpoint): a route openbook does not
            # serve, said so as OpenAI says it, not a bare "Not Found"
            return openai_format.unsupported_route(request.method, request.url.path)
        return openai_format.error_response(exc.status_code, exc.detail, headers=headers)
    if exc.status_code < 500:
        return await http_exception_handler(request, exc)
    # A failure (here or in a service): its request id finds it in the logs.
    body = {"detail": exc.detail, "request_id": getattr(request.state, "request_id", "")}
    return JSONResponse(body, exc.status_code, headers=exc.headers)
