"""Request bodies as every gateway route reads them: JSON, or one validation error naming
``body`` (a 422; under ``/v1`` OpenAI's 400), whatever way a body fails to be JSON.

FastAPI parses a JSON body with ``json.loads`` and answers a 422 for a body that is truncated
or not JSON, but a bare "400 There was an error parsing the body" for the two failures that are
not ``JSONDecodeError``s: bytes that are not UTF-8 (``UnicodeDecodeError``), nesting deeper
than the interpreter's recursion limit (``RecursionError``, around 1,000 levels) and an integer
of more digits than Python converts (a plain ``ValueError``, past 4,300 digits; issue 42).
:class:`JSONBodyRequest` turns both into ``JSONDecodeError``s that say what is wrong, so FastAPI
reports them as it reports every other malformed body. A body sent with another content type
than JSON is not parsed by FastAPI at all: :class:`JSONBodyRoute` refuses it first, naming the
content type, rather than letting a bare "Input should be a valid dictionary" stand for it.

Every router of the app uses :class:`JSONBodyRoute` (``route_class``); a route without a body
is untouched.
"""

from __future__ import annotations

import email.message
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute


class JSONBodyRequest(Request):
    """A request whose ``json()`` raises ``JSONDecodeError`` for every body that is not JSON."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            try:
                self._json = json.loads(body)
            except UnicodeDecodeError as exc:
                raise json.JSONDecodeError(
                    f"not UTF-8: byte 0x{body[exc.start]:02x} at offset {exc.start} "
                    f"cannot be decoded",
                    body.decode("utf-8", "replace"),
                    exc.start,
                ) from None
            except RecursionError:
                raise json.JSONDecodeError(
                    "nested too deeply to parse", body.decode("utf-8", "replace"), 0
                ) from None
            except json.JSONDecodeError:
                raise
            except ValueError:
                # int() refuses more digits than sys.get_int_max_str_digits(): a number no
                # field takes, said as what it is rather than FastAPI's bare 400.
                raise json.JSONDecodeError(
                    f"an integer of more than {sys.get_int_max_str_digits()} digits",
                    body.decode("utf-8", "replace"),
                    0,
                ) from None
        return self._json


def is_json_content_type(content_type: str) -> bool:
    """``application/json`` or ``application/<anything>+json``, parameters aside: the types
    FastAPI parses as JSON."""
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (
        subtype == "json" or subtype.endswith("+json")
    )


class JSONBodyRoute(APIRoute):
    """A route that reads its body with :class:`JSONBodyRequest`, and refuses a body sent
    with a content type other than JSON (422 naming ``body`` and the type it got)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        takes_body = self.body_field is not None

        async def read_json_body(request: Request) -> Response:
            request = JSONBodyRequest(request.scope, request.receive)
            if takes_body:
                content_type = request.headers.get("content-type", "")
                if not is_json_content_type(content_type) and await request.body():
                    raise RequestValidationError(
                        [
                            {
                                "type": "content_type",
                                "loc": ("body",),
                                "msg": "must be JSON sent with 'content-type: "
                                f"application/json', got {content_type or 'no content type'!r}",
                                "input": content_type or None,
                            }
                        ]
                    )
            return await handler(request)

        return read_json_body


def readable(errors: Sequence[dict]) -> list[dict]:
    """``errors`` with FastAPI's "JSON decode error" saying what the decoder found (its
    ``ctx.error``): that a body is truncated, not UTF-8 or nested too deeply, and where."""
    out = []
    for error in errors:
        reason = (error.get("ctx") or {}).get("error")
        if error.get("type") == "json_invalid" and reason:
            error = {**error, "msg": f"JSON decode error: {reason}"}
        out.append(error)
    return out
