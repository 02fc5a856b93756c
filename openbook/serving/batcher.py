"""Dynamic batching: concurrent callers share one call of a batched function.

A bounded waiting line feeds one worker thread. The worker takes the first waiting item, keeps
collecting until ``max_batch_size`` items, ``max_wait_ms``, or an item that would not ``fit``
with those already taken (it then leads the next batch), drops items whose caller gave up, and
runs ``fn`` once on the rest. Callers block on their own future.

Invariants:
* the line never holds more than ``max_queue`` items: ``submit`` fails at once (backpressure)
  instead of piling up;
* an item whose caller gave up (deadline passed, cancelled) leaves the line at once and is never
  run; while its batch runs, ``fn`` can ask the same question (``gave_up``) and stop early;
* no wait is unbounded: every caller waits at most its own timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from openbook.errors import Cancelled, DeadlineExceeded, Overloaded

log = logging.getLogger(__name__)

# Longer than anyone waits, shorter than what threading can wait on.
NO_DEADLINE_S = 365 * 24 * 3600.0

T = TypeVar("T")
R = TypeVar("R")

# fn(payloads) or, with ``pass_gave_up``, fn(payloads, gave_up) -> one result or error per item.
BatchFn = Callable[..., Sequence[R | Exception]]


@dataclass(eq=False)
class Waiting(Generic[T, R]):
    """One submitted item and its caller's future."""

    payload: T
    deadline: float | None  # time.monotonic() value, or None for no deadline
    future: Future = field(default_factory=Future)

    def gave_up(self) -> bool:
        """The caller stopped waiting (cancelled, or its deadline passed), or was already
        answered (refused while its work ran): the work is for no one."""
        return self.future.done() or (
            self.deadline is not None and time.monotonic() >= self.deadline
        )


class WaitingLine(Generic[T, R]):
    """A bounded line of submitted items and the one worker thread (``_run``) that serves it;
    each caller blocks on its own future. The base of :class:`Batcher` and of the generator's
    continuous-batching scheduler, which differ only in how the worker takes and runs items.

    ``on_drop(n)`` is told of items that left the line because their caller gave up. A subclass
    sets up its own state, then calls :meth:`_start`.
    """

    def __init__(
        self, *, max_queue: int, name: str, on_drop: Callable[[int], None] | None = None
    ) -> None:
        self.max_queue = max_queue
        self._waiting: deque[Waiting[T, R]] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._on_drop = on_drop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def _start(self) -> None:
        self._thread.start()

    def depth(self) -> int:
        """Items waiting in the line (not those running)."""
        with self._cond:
            return len(self._waiting)

    def submit(
        self,
        payload: T,
        timeout_s: float | None = None,
        on_cancel: Callable[[Callable[[], None]], object] | None = None,
    ) -> R:
        """Block until ``payload`` has been processed; raise its error if it failed.

        ``on_cancel(callback)``, when given, registers ``callback`` to be called if the caller
        goes away (e.g. gRPC's ``context.add_callback``): the item then leaves the line, or the
        work running it is told it gave up.
        """
        timeout_s = bounded_timeout(timeout_s)
        item = self._enqueue(payload, timeout_s, on_cancel)
        return self._outcome(item, timeout_s)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _enqueue(
        self,
        payload: T,
        timeout_s: float | None,
        on_cancel: Callable[[Callable[[], None]], object] | None,
    ) -> Waiting[T, R]:
        """Put ``payload`` in the line (or refuse it: closed, line full)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        item: Waiting[T, R] = Waiting(payload, deadline)
        with self._cond:
            if self._closed:
                raise Overloaded("server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"queue full ({self.max_queue} requests waiting); retry later")
            self._waiting.append(item)
            self._cond.notify()
        if on_cancel is not None:
            on_cancel(lambda: self._give_up(item))
        return item

    def _outcome(self, item: Waiting[T, R], timeout_s: float | None) -> R:
        """``item``'s result, waiting at most ``timeout_s``; its error raised."""
        try:
            return item.future.result(timeout=timeout_s)
        except TimeoutError:
            self._give_up(item)
            raise DeadlineExceeded(f"no result within {timeout_s:.1f}s") from None
        except CancelledError:
            raise Cancelled("the caller cancelled the request") from None

    def _give_up(self, item: Waiting[T, R]) -> None:
        """Cancel ``item`` (unless it has its result) and free its place in the line."""
        with self._cond:
            # not waiting any more: already taken by the worker, which sees ``gave_up``
            if item.future.cancel() and item in self._waiting:
                self._waiting.remove(item)
                self._dropped()

    def _expired_head(self) -> bool:
        """Drop the first waiting item if its caller gave up (call under ``_cond``)."""
        item = self._waiting[0]
        if not item.gave_up():
            return False
        self._waiting.popleft()
        resolve(item.future, DeadlineExceeded("deadline passed while queued"))
        self._dropped()
        return True

    def _dropped(self) -> None:
        if self._on_drop is not None:
            self._on_drop(1)

    def _run(self) -> None:
        raise NotImplementedError


class Batcher(WaitingLine[T, R]):
    """Run ``fn(list[T]) -> list[R | Exception]`` on batches of concurrently submitted items.

    ``fn`` returns one result per item, in order; an ``Exception`` in the list fails only
    that item. If ``fn`` raises, every item of the batch fails with that error. With
    ``pass_gave_up`` it is called as ``fn(payloads, gave_up)``, ``gave_up[i]()`` saying whether
    item i's caller stopped waiting. ``fits(payloads)`` (default: always) says whether items may
    run as one batch; a single item always may (callers refuse what can never fit).
    ``on_drop(n)`` is told of items that left the line because their caller gave up.
    """

    def __init__(
        self,
        fn: BatchFn,
        *,
        max_batch_size: int = 8,
        max_wait_ms: float = 5.0,
        max_queue: int = 64,
        name: str = "batcher",
        on_batch: Callable[[int], None] | None = None,
        on_drop: Callable[[int], None] | None = None,
        fits: Callable[[list[T]], bool] | None = None,
        pass_gave_up: bool = False,
    ) -> None:
        super().__init__(max_queue=max_queue, name=name, on_drop=on_drop)
        self._fn = fn
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._fits = fits
        self._pass_gave_up = pass_gave_up
        self._on_batch = on_batch
        self._start()

    def _take(self) -> list[Waiting[T, R]] | None:
        """The next batch (None once closed and drained); drops items whose caller gave up."""
        with self._cond:
            batch: list[Waiting[T, R]] = []
            until: float | None = None
            while len(batch) < self.max_batch_size:
                if not self._waiting:
                    if self._closed:
                        break
                    if until is None:  # nothing taken yet: wait for the first item
                        self._cond.wait()
                        continue
                    remaining = until - time.monotonic()
                    if remaining <= 0 or not self._cond.wait(remaining):
                        break
                    continue
                if self._expired_head():
                    continue
                item = self._waiting[0]
                fits = self._fits
                if (
                    batch
                    and fits is not None
                    and not fits([*(i.payload for i in batch), item.payload])
                ):
                    break  # it leads the next batch
                self._waiting.popleft()
                batch.append(item)
                if until is None:
                    until = time.monotonic() + self.max_wait_s
            if not batch and self._closed:
                return None
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if not batch:
                continue
            if self._on_batch:
                self._on_batch(len(batch))
            payloads = [item.payload for item in batch]
            try:
                if self._pass_gave_up:
                    results = self._fn(payloads, [item.gave_up for item in batch])
                else:
                    results = self._fn(payloads)
            except Exception as exc:  # noqa: BLE001 - reported to every caller of the batch
                log.exception("batch of %d failed", len(batch))
                for item in batch:
                    resolve(item.future, exc)
                continue
            for item, result in zip(batch, results, strict=True):
                resolve(item.future, result)


def bounded_timeout(timeout_s: float | None) -> float | None:
    """gRPC reports "no deadline" as a practically infinite time left: that is no timeout."""
    return None if timeout_s is not None and timeout_s > NO_DEADLINE_S else timeout_s


def resolve(future: Future, result: object) -> None:
    """Set a result unless the caller gave up (cancelled) in the meantime."""
    try:
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
