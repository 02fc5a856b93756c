"""Server-Sent Events responses that stop their producer the moment the client goes away.

A streamed answer holds a place in the generator's batch; a client that disconnects must free
it at once, not when the next token fails to send. :class:`EventStream` therefore watches the
connection (``http.disconnect``) while it waits for the next event, and on a disconnect cancels
the wait and closes the producer, whose cleanup cancels its gRPC call.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # nginx and similar proxies buffer responses unless told not to
    "X-Accel-Buffering": "no",
}


# OpenAPI: a route that answers with a stream when asked to (docs/api.md)
STREAMED: dict = {
    200: {
        "content": {"text/event-stream": {"schema": {"type": "string"}}},
        "description": 'with "stream": true, Server-Sent Events (docs/api.md)',
    }
}


def sse(data: object, event: str | None = None) -> bytes:
    """One event in the text/event-stream format; ``data`` as one line of JSON (or as is)."""
    text = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {text}\n\n".encode()


class EventStream(Response):
    """Send ``events`` (already formatted, :func:`sse`) as ``text/event-stream``.

    ``on_end(outcome)`` is told how the stream ended: "completed", or "disconnected" when the
    client went away first (the producer is then closed without being read further).
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        on_end: Callable[[str], None] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        # Not Response.__init__: it would declare the length of an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({**SSE_HEADERS, **(headers or {})})
        self.events = events
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        watcher = asyncio.ensure_future(_disconnect(receive))
        outcome = "completed"
        try:
            while True:
                following = asyncio.ensure_future(anext(self.events))
                await asyncio.wait({following, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if not following.done():
                    following.cancel()
                    outcome = "disconnected"
                    await asyncio.gather(following, return_exceptions=True)
                    break
                try:
                    chunk = following.result()
                except StopAsyncIteration:
                    break
                try:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                except OSError:
                    outcome = "disconnected"
                    break
            if outcome == "completed":
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.events.aclose()
            if self.on_end is not None:
                self.on_end(outcome)


async def _disconnect(receive: Receive) -> None:
    """Returns once the client has gone away."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
