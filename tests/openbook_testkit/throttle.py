"""A generator backend made slower on purpose, as a busy or throttled machine makes it.

Tests of admission and scheduling need work whose duration they know: wrapping a tiny model's
``encode`` and ``step`` with sleeps in proportion to their size makes the engine's speed (and so
what the scheduler measures) whatever the test says, far above the tiny model's own compute.
Every piece of work is also logged, so a test can check the order work ran in.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class Throttle:
    """Seconds added per encoded passage row, per decoding step, and per decoded row."""

    encode_row_s: float = 0.0
    step_s: float = 0.0
    step_row_s: float = 0.0
    # ("encode" | "step", rows) of every piece of work, in the order it ran
    log: list[tuple[str, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, kind: str, rows: int) -> None:
        with self.lock:
            self.log.append((kind, rows))

    def events(self) -> list[tuple[str, int]]:
        with self.lock:
            return list(self.log)


@contextmanager
def throttled(backend, throttle: Throttle) -> Iterator[Throttle]:
    """``backend`` (a generator's ``backend``) slowed by ``throttle`` until the block ends."""
    encode, step = backend.encode, backend.step

    def slow_encode(items, k):
        rows = len(items) * k
        throttle.record("encode", rows)
        time.sleep(throttle.encode_row_s * rows)
        return encode(items, k)

    def slow_step(state, tokens):
        rows = int(tokens.shape[0])
        throttle.record("step", rows)
        time.sleep(throttle.step_s + throttle.step_row_s * rows)
        return step(state, tokens)

    backend.encode, backend.step = slow_encode, slow_step
    try:
        yield throttle
    finally:
        backend.encode, backend.step = encode, step
