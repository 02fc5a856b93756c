"""The gateway's HTTP/1.1 connections: uvicorn's httptools protocol, with limits on request heads.

uvicorn reads a request head (the request line and the header fields) for as long as a client
takes and however large it grows: a client that sends its headers a byte at a time holds a
connection open forever (slowloris), and a 1 MB header or 10,000 header fields are parsed and
handed to the app. This protocol bounds the head of every request, before the app sees it:

* **time**: a head must be complete within :attr:`HeadLimits.timeout_s` of its first byte (of
  the connection, for a connection's first request). Past that the connection is closed, after a
  408 when part of a head came; a connection that sent nothing is closed silently. (Between
  requests, uvicorn's keep-alive timeout closes an idle connection.)
* **size**: a head over :attr:`HeadLimits.max_bytes`, or with more than
  :attr:`HeadLimits.max_fields` header fields, is answered 431 as soon as it passes the limit.

uvicorn's own settings do not cover this: ``timeout_keep_alive`` runs only between requests
(armed after a response, cancelled by any byte, never on a new connection);
``h11_max_incomplete_event_size`` bounds a head only under the h11 protocol, not httptools
(what ``http="auto"`` picks), and answers 400, not 431; ``limit_concurrency`` answers 503 to
requests beyond a count, but never frees a connection that a slow head holds.

A refused head is answered, the connection half-closed, and what the client still sends is read
and dropped (for at most ``timeout_s``, at most :data:`DRAIN_MAX_BYTES`): closing with unread
bytes makes the kernel send a TCP reset, and a client still writing its headers would see
"connection reset" instead of the answer. Then the connection is closed.

Invariants: a connection runs at most one timer of its own, the head timer while a head is
awaited on a new connection or incomplete, then the drain timer once refused; the app never
sees a request whose head broke a limit; answers keep the order of requests: a refusal of a
pipelined request waits for the responses to the requests before it.
"""

from __future__ import annotations

import asyncio
import enum
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

log = logging.getLogger(__name__)

# How much a refused client may still send (and the gateway read and drop) before the
# connection is closed on it. The bytes cost bandwidth only: nothing parses or keeps them.
DRAIN_MAX_BYTES = 32 * 1024 * 1024

# What each header field costs beyond its name and value: ": " and CRLF.
FIELD_OVERHEAD = 4


@dataclass(frozen=True)
class HeadLimits:
    """How long a request head may take and how large it may be (the gateway's settings
    ``header_timeout_s``, ``max_header_bytes`` and ``max_header_count``)."""

    timeout_s: float
    max_bytes: int  # the request line and the header fields together
    max_fields: int


# The body of a refusal: (request path as far as known, status, message) -> JSON object.
ErrorBody = Callable[[str, int, str], dict]
# Told the status of every refusal (408, 431): the app's request counter never sees them.
OnRefusal = Callable[[int], None]


def _ignore(status: int) -> None:
    return None


def _detail(path: str, status: int, message: str) -> dict:
    return {"detail": message}


class HeadTooLarge(Exception):
    """Raised from a parser callback to stop parsing a head over the limits."""


class _Head(enum.Enum):
    AWAITED = "awaited"  # no byte of the next request yet
    READING = "reading"  # its head has begun and is not complete
    DONE = "done"  # its head is complete: the body (if any) follows


class HeadLimitedProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, enforcing :class:`HeadLimits` (module docstring).

    Use :func:`head_limited_protocol` to get the class for given limits: uvicorn builds one
    protocol per connection from a class, so the limits are class attributes.
    """

    limits: ClassVar[HeadLimits]
    error_body: ClassVar[ErrorBody] = staticmethod(_detail)
    on_refusal: ClassVar[OnRefusal] = staticmethod(_ignore)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.head = _Head.AWAITED
        # Bytes of the head being read: whole chunks known to hold only it, and the request
        # target and header fields parsed so far. The larger is checked against the limit.
        self.head_chunk_bytes = 0
        self.head_field_bytes = 0
        self.head_fields = 0
        self.heads_begun = 0  # in the chunk being parsed
        self.timer: asyncio.TimerHandle | None = None
        self.dropped: int | None = None  # bytes dropped since a refusal; None: not refused
        # A refusal waiting for the responses before it: (path, status, message).
        self.pending: tuple[str, int, str] | None = None

    # ---- connection
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._start_timer(self._head_timed_out)  # the first head is due from the start

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's ``data_received``, with the head counted and a refusal answered."""
        if self.dropped is not None:
            self._drop(len(data))
            return
        before = self.head
        self.heads_begun = 0
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, HeadTooLarge):
                self._refuse(431, str(exc.__context__))
            else:
                log.warning("invalid HTTP request received: %s", exc.__context__ or exc)
                self.send_400_response("Invalid HTTP request received.")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            log.warning("invalid HTTP request received")
            self.send_400_response("Invalid HTTP request received.")
            return
        if self.head is not _Head.READING:
            return
        # The head is still incomplete. This whole chunk belongs to it if it continued a head
        # or began one at its first byte; otherwise the share is unknown and only the parsed
        # fields count (the exact check when the head completes still holds).
        if (before is _Head.READING and self.heads_begun == 0) or (
            before is _Head.AWAITED and self.heads_begun == 1
        ):
            self.head_chunk_bytes += len(data)
            try:
                self._check_size(self.head_chunk_bytes)
            except HeadTooLarge as exc:
                self._refuse(431, str(exc))

    # ---- parser callbacks (called from feed_data)
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.head = _Head.READING
        self.heads_begun += 1
        self.head_chunk_bytes = self.head_field_bytes = self.head_fields = 0
        if self.timer is None:  # a later request's head: due from its first byte
            self._start_timer(self._head_timed_out)

    def on_url(self, url: bytes) -> None:
        self.head_field_bytes += len(url)
        self._check_size(self.head_field_bytes)
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_fields += 1
        if self.head_fields > self.limits.max_fields:
            raise HeadTooLarge(
                f"request header fields too large: more than {self.limits.max_fields} header "
                "fields (OPENBOOK_GATEWAY_MAX_HEADER_COUNT)"
            )
        self.head_field_bytes += len(name) + len(value) + FIELD_OVERHEAD
        self._check_size(self.head_field_bytes)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.head = _Head.DONE
        self._stop_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self.head = _Head.AWAITED

    # ---- limits
    def _check_size(self, size: int) -> None:
        if size > self.limits.max_bytes:
            raise HeadTooLarge(
                f"request header fields too large: the request line and headers exceed "
                f"{self.limits.max_bytes} bytes (OPENBOOK_GATEWAY_MAX_HEADER_BYTES)"
            )

    def _head_timed_out(self) -> None:
        self.timer = None
        if self.transport.is_closing():
            return
        if self.head is _Head.READING:
            self._refuse(
                408,
                f"request head not received within {self.limits.timeout_s:g} s "
                "(OPENBOOK_GATEWAY_HEADER_TIMEOUT_S)",
            )
        else:
            self.transport.close()  # nothing was sent

    def _responding(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    # ---- refusal
    def _refuse(self, status: int, message: str) -> None:
        """Stop reading requests, answer ``status`` once the requests before it (pipelined)
        are answered, half-close, and drop what the client still sends until it closes, the
        drain limits are reached or the drain times out."""
        self._stop_timer()
        self._unset_keepalive_if_required()
        self.dropped = 0  # nothing more is parsed
        path = self.url.decode("latin-1").partition("?")[0] if self.head is _Head.READING else ""
        refusal = (path, status, message)
        if self._responding():
            self.pending = refusal  # on_response_complete answers it
        else:
            self._answer(*refusal)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if any
        if self.pending is not None and not self._responding() and not self.transport.is_closing():
            refusal, self.pending = self.pending, None
            self._unset_keepalive_if_required()
            self._answer(*refusal)

    def _answer(self, path: str, status: int, message: str) -> None:
        request_id = uuid.uuid4().hex
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "?"
        log.info("%s from %s: %s (request %s)", status, client, message, request_id)
        # Through the class: these are plain functions kept as class attributes, not methods.
        protocol = type(self)
        protocol.on_refusal(status)
        refusal = protocol.error_body(path, status, message)
        body = json.dumps(refusal, separators=(",", ":")).encode()
        head = [STATUS_LINE[status]]
        for name, value in self.server_state.default_headers:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"x-request-id: %s\r\n" % request_id.encode(),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.flow.resume_reading()
        self._start_timer(self.transport.close)

    def _drop(self, size: int) -> None:
        assert self.dropped is not None
        self.dropped += size
        if self.dropped > DRAIN_MAX_BYTES:
            self.transport.close()

    # ---- timer
    def _start_timer(self, callback: Callable[[], None]) -> None:
        self._stop_timer()
        self.timer = self.loop.call_later(self.limits.timeout_s, callback)

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None


def head_limited_protocol(
    limits: HeadLimits, error_body: ErrorBody = _detail, on_refusal: OnRefusal = _ignore
) -> type[HeadLimitedProtocol]:
    """The protocol class to give uvicorn (``uvicorn.Config(http=...)``) for ``limits``;
    ``error_body`` shapes the JSON body of a 408 or 431, ``on_refusal`` counts them."""
    return type(
        "HeadLimitedProtocol",
        (HeadLimitedProtocol,),
        {
            "limits": limits,
            "error_body": staticmethod(error_body),
            "on_refusal": staticmethod(on_refusal),
        },
    )
