"""Dynamic batching: concurrent callers share one call of a batched function.

A bounded queue feeds one worker thread. The worker takes the first waiting item, keeps
collecting until ``max_batch_size`` items or ``max_wait_ms`` have passed, drops items whose
deadline has already passed, and runs ``fn`` once on the rest. Callers block on their own
future. When the queue is full ``submit`` fails at once (backpressure) instead of piling up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from openbook.errors import DeadlineExceeded, Overloaded

log = logging.getLogger(__name__)

# Longer than anyone waits, shorter than what threading can wait on.
NO_DEADLINE_S = 365 * 24 * 3600.0

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class _Item(Generic[T, R]):
    payload: T
    deadline: float | None  # time.monotonic() value, or None for no deadline
    future: Future = field(default_factory=Future)


class Batcher(Generic[T, R]):
    """Run ``fn(list[T]) -> list[R | Exception]`` on batches of concurrently submitted items.

    ``fn`` returns one result per item, in order; an ``Exception`` in the list fails only
    that item. If ``fn`` raises, every item of the batch fails with that error.
    """

    def __init__(
        self,
        fn: Callable[[list[T]], Sequence[R | Exception]],
        *,
        max_batch_size: int = 8,
        max_wait_ms: float = 5.0,
        max_queue: int = 64,
        name: str = "batcher",
        on_batch: Callable[[int], None] | None = None,
    ) -> None:
        self._fn = fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._queue: queue.Queue[_Item[T, R] | None] = queue.Queue(maxsize=max_queue)
        self._on_batch = on_batch
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def depth(self) -> int:
        return self._queue.qsize()

    def submit(self, payload: T, timeout_s: float | None = None) -> R:
        """Block until ``payload`` has been processed; raise its error if it failed."""
        if self._closed:
            raise Overloaded("server is shutting down")
        if timeout_s is not None and timeout_s > NO_DEADLINE_S:
            timeout_s = None  # gRPC reports "no deadline" as a practically infinite time left
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        item: _Item[T, R] = _Item(payload, deadline)
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            raise Overloaded(
                f"queue full ({self._queue.maxsize} requests waiting); retry later"
            ) from None
        try:
            return item.future.result(timeout=timeout_s)
        except TimeoutError:
            item.future.cancel()
            raise DeadlineExceeded(f"no result within {timeout_s:.1f}s") from None

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _collect(self, first: _Item[T, R]) -> list[_Item[T, R]]:
        batch = [first]
        until = time.monotonic() + self.max_wait_s
        while len(batch) < self.max_batch_size:
            remaining = until - time.monotonic()
            try:
                item = (
                    self._queue.get(timeout=max(remaining, 0))
                    if remaining > 0
                    else (self._queue.get_nowait())
                )
            except queue.Empty:
                break
            if item is None:  # close() while collecting: finish this batch, then stop
                self._queue.put(None)
                break
            batch.append(item)
        return batch

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            now = time.monotonic()
            live = []
            for item in self._collect(first):
                if item.future.cancelled():
                    continue
                if item.deadline is not None and item.deadline <= now:
                    _resolve(item.future, DeadlineExceeded("deadline passed while queued"))
                    continue
                live.append(item)
            if not live:
                continue
            if self._on_batch:
                self._on_batch(len(live))
            try:
                results = self._fn([item.payload for item in live])
            except Exception as exc:  # noqa: BLE001 - reported to every caller of the batch
                log.exception("batch of %d failed", len(live))
                for item in live:
                    _resolve(item.future, exc)
                continue
            for item, result in zip(live, results, strict=True):
                _resolve(item.future, result)


def _resolve(future: Future, result: object) -> None:
    """Set a result unless the caller gave up (cancelled) in the meantime."""
    try:
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
