"""The generator's continuous batching loop: requests join the running decode between steps.

A bounded waiting line feeds one decoding thread, which owns a
:class:`openbook.rag.engine.DecodingEngine` per loaded model. Between two decoding steps the
thread admits waiting requests (prefill, then their rows join the batch) while the batch holds
fewer than ``max_batch_size`` requests, their estimated memory together stays within the budget
(:mod:`openbook.rag.memory`) and the engine accepts their rows; then it runs one step, and
answers every request that finished at that step. So a request waits for a free place, never for
a whole batch to end, and a short answer leaves as soon as it is written.

Invariants:
* the line never holds more than ``max_queue`` requests: ``submit`` fails at once (backpressure);
* a request whose caller gave up (deadline passed, cancelled) leaves the line at once and is
  never run; once running, its rows leave the batch before the next step;
* no wait is unbounded: every caller waits at most its own timeout;
* a model reload never disturbs running requests: they finish on the engine of the model they
  started on, while new requests start on the new model.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass

import torch

from openbook.errors import Cancelled, DeadlineExceeded, Overloaded
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.rag.engine import DecodingEngine, Running
from openbook.rag.errors import Abandoned
from openbook.rag.memory import RequestShape
from openbook.serving.batcher import NO_DEADLINE_S, Waiting, resolve
from openbook.types import Passage

log = logging.getLogger(__name__)

Generated = tuple[GenerationResult, str]  # the result and the model version that produced it
# Weight of the newest finished request in the running estimate of seconds per request.
_RATE_WEIGHT = 0.3


@dataclass(frozen=True)
class GenerateItem:
    """A validated request waiting for a place, with the shape its memory is estimated from."""

    question: str
    passages: Sequence[Passage]
    options: DecodingOptions
    shape: RequestShape


class Scheduler:
    """Continuous batching of generate requests (module docstring).

    ``current()`` is the model new requests start on. ``fits(shapes)`` says whether requests of
    those shapes may decode together (the memory budget). ``on_step(requests, queued)`` is told
    the batch size of every step, ``on_drop(where, n)`` of requests dropped because their caller
    gave up (``where``: "queued" or "running").
    """

    def __init__(
        self,
        current: Callable[[], RagGenerator],
        *,
        max_batch_size: int,
        max_wait_ms: float,
        max_queue: int,
        fits: Callable[[list[RequestShape]], bool],
        on_step: Callable[[int, int], None] | None = None,
        on_drop: Callable[[str, int], None] | None = None,
    ) -> None:
        self._current = current
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self.max_queue = max_queue
        self._fits = fits
        self._on_step = on_step
        self._on_drop = on_drop
        self._waiting: deque[Waiting] = deque()
        self._cond = threading.Condition()
        self._closed = False
        # one engine per model that has running requests, the current model's last
        self._engines: dict[int, tuple[RagGenerator, DecodingEngine]] = {}
        # id(waiting) -> the request and, once admitted, its engine entry
        self._running: dict[int, tuple[Waiting, Running | None]] = {}
        self.seconds_per_request = 0.0  # engine time per request, running estimate
        self._thread = threading.Thread(target=self._run, name="generate-scheduler", daemon=True)
        self._thread.start()

    def depth(self) -> int:
        """Requests waiting for a place in the batch (not those running)."""
        with self._cond:
            return len(self._waiting)

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def wait_estimate_s(self) -> float:
        """About how long a request submitted now waits for its place: none while the batch has
        a free place for it, else one request's engine time per request ahead of it."""
        with self._cond:
            ahead = len(self._waiting) + 1 - (self.max_batch_size - len(self._running))
        return max(0, ahead) * self.seconds_per_request

    def submit(
        self,
        item: GenerateItem,
        timeout_s: float | None = None,
        on_cancel: Callable[[Callable[[], None]], object] | None = None,
    ) -> Generated:
        """Block until ``item`` is generated; raise its error if it failed.

        ``on_cancel(callback)``, when given, registers ``callback`` to be called if the caller
        goes away (gRPC's ``context.add_callback``): the request then leaves the line, or its
        rows leave the batch before the next step.
        """
        if timeout_s is not None and timeout_s > NO_DEADLINE_S:
            timeout_s = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        waiting = Waiting(item, deadline)
        with self._cond:
            if self._closed:
                raise Overloaded("server is shutting down")
            if len(self._waiting) >= self.max_queue:
                raise Overloaded(f"queue full ({self.max_queue} requests waiting); retry later")
            self._waiting.append(waiting)
            self._cond.notify()
        if on_cancel is not None:
            on_cancel(lambda: self._give_up(waiting))
        try:
            return waiting.future.result(timeout=timeout_s)
        except TimeoutError:
            self._give_up(waiting)
            raise DeadlineExceeded(f"no result within {timeout_s:.1f}s") from None
        except CancelledError:
            raise Cancelled("the caller cancelled the request") from None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    # ------------------------------------------------------------------ the decoding thread

    def _give_up(self, waiting: Waiting) -> None:
        with self._cond:
            # running requests see ``gave_up`` before the next step
            if waiting.future.cancel() and waiting in self._waiting:
                self._waiting.remove(waiting)
                self._dropped("queued", 1)

    def _dropped(self, where: str, count: int) -> None:
        if self._on_drop is not None and count:
            self._on_drop(where, count)

    def _take(self) -> list[Waiting] | None:
        """Waiting requests that may join now (None once closed and drained). Blocks while
        nothing runs and nothing waits; when idle, waits ``max_wait_s`` after the first arrival
        so that requests arriving together start together."""
        with self._cond:
            while not self._waiting and not self._running:
                if self._closed:
                    return None
                self._cond.wait()
                if self._waiting and self.max_wait_s > 0:
                    self._cond.wait_for(
                        lambda: len(self._waiting) >= self.max_batch_size or self._closed,
                        timeout=self.max_wait_s,
                    )
            taken: list[Waiting] = []
            joining = 0  # decoder rows of the requests taken now
            shapes = [w.payload.shape for w, _ in self._running.values()]
            engine = self._engine(self._current())
            while self._waiting and len(self._running) < self.max_batch_size:
                head = self._waiting[0]
                if head.gave_up():
                    self._waiting.popleft()
                    resolve(head.future, DeadlineExceeded("deadline passed while queued"))
                    self._dropped("queued", 1)
                    continue
                item: GenerateItem = head.payload
                busy = bool(self._running or taken)
                if busy and not self._fits([*shapes, item.shape]):
                    break  # it joins when enough rows have left
                rows = len(item.passages) * item.options.num_beams
                if not engine.accepts(rows, joining):
                    break
                self._waiting.popleft()
                taken.append(head)
                joining += rows
                shapes.append(item.shape)
                self._running[id(head)] = (head, None)
            return taken

    def _engine(self, generator: RagGenerator) -> DecodingEngine:
        entry = self._engines.get(id(generator))
        if entry is None:
            entry = (generator, generator.engine())
            self._engines[id(generator)] = entry
        return entry[1]

    def _run(self) -> None:
        while True:
            taken = self._take()
            if taken is None:
                return
            with torch.inference_mode():
                generator = self._current()
                for waiting in taken:
                    self._admit(generator, waiting)
                for generator, engine in list(self._engines.values()):
                    if len(engine):
                        if self._on_step is not None:
                            self._on_step(len(engine), self.depth())
                        self._step(generator, engine)
                    elif generator is not self._current():
                        del self._engines[id(generator)]  # a replaced model, nothing left on it

    def _admit(self, generator: RagGenerator, waiting: Waiting) -> None:
        item: GenerateItem = waiting.payload
        try:
            running = self._engine(generator).add(
                item.question,
                item.passages,
                item.options,
                tag=(waiting, generator.model_version),
                gave_up=waiting.gave_up,
            )
        except Exception as exc:  # noqa: BLE001 - fails this request only
            log.exception("admitting a request failed")
            self._finish(waiting, exc)
            return
        with self._cond:
            self._running[id(waiting)] = (waiting, running)

    def _step(self, generator: RagGenerator, engine: DecodingEngine) -> None:
        try:
            outcomes = engine.step()
        except Exception as exc:  # noqa: BLE001 - the batch's state is lost: fail its requests
            log.exception("decoding step failed; failing the %d requests of its batch", len(engine))
            self._engines.pop(id(generator), None)
            for waiting, _version in engine.abort():
                self._finish(waiting, exc)
            return
        for (waiting, version), outcome in outcomes:
            if isinstance(outcome, Abandoned):
                self._dropped("running", 1)
                self._finish(waiting, DeadlineExceeded("the caller gave up; generation stopped"))
            else:
                self._finish(waiting, (outcome, version))

    def _finish(self, waiting: Waiting, result: object) -> None:
        with self._cond:
            _, running = self._running.pop(id(waiting), (waiting, None))
        if running is not None and not isinstance(result, Exception):
            previous = self.seconds_per_request
            self.seconds_per_request = (
                running.cost_s
                if not previous
                else (1 - _RATE_WEIGHT) * previous + _RATE_WEIGHT * running.cost_s
            )
        resolve(waiting.future, result)
