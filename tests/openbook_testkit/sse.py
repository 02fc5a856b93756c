"""A minimal Server-Sent Events reader for tests and benchmarks (the text/event-stream format:
``event:`` and ``data:`` lines, a blank line ending each event)."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Event:
    event: str  # "message" when the stream names none
    data: str

    def json(self):
        return json.loads(self.data)


def read_events(lines: Iterable[str]) -> Iterator[Event]:
    """Events from the lines of a text/event-stream body (as ``httpx``'s ``iter_lines``)."""
    name, data = "message", []
    for line in lines:
        if not line:
            if data:
                yield Event(name, "\n".join(data))
            name, data = "message", []
        elif line.startswith(":"):
            continue  # a comment (keep-alive)
        else:
            field, _, value = line.partition(":")
            value = value.removeprefix(" ")
            if field == "event":
                name = value
            elif field == "data":
                data.append(value)
    if data:
        yield Event(name, "\n".join(data))
