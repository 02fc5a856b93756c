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
import queue
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import torch

from openbook.errors import DeadlineExceeded
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.rag.engine import DecodingEngine, Running
from openbook.rag.errors import Abandoned
from openbook.rag.memory import RequestShape
from openbook.rag.streaming import OnToken, TokenEvent
from openbook.serving.batcher import Waiting, WaitingLine, bounded_timeout, resolve
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
    # called from the decoding thread with every token decided (a streaming request)
    on_token: OnToken | None = None


# Put in a stream's queue once its request is resolved (answered, failed or dropped).
_RESOLVED = object()


class Scheduler(WaitingLine[GenerateItem, Generated]):
    """Continuous batching of generate requests (module docstring).

    ``current()`` is the model new requests start on. ``fits(shapes)`` says whether requests of
    those shapes may decode together (the memory budget). ``on_step(requests, queued)`` is told
    the batch size of every step, ``on_drop(where, n)`` of requests dropped because their caller
    gave up (``where``: "queued" or "running"). ``submit`` (:class:`WaitingLine`) blocks for a
    result, and a running request's rows leave the batch before the next step once its caller
    gave up; :meth:`stream` yields tokens as they are decided, then the result.
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
        super().__init__(
            max_queue=max_queue,
            name="generate-scheduler",
            on_drop=None if on_drop is None else (lambda n: on_drop("queued", n)),
        )
        self._current = current
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._fits = fits
        self._on_step = on_step
        self._on_running_drop = on_drop
        # one engine per model that has running requests, the current model's last
        self._engines: dict[int, tuple[RagGenerator, DecodingEngine]] = {}
        # id(waiting) -> the request and, once admitted, its engine entry
        self._running: dict[int, tuple[Waiting, Running | None]] = {}
        self.seconds_per_request = 0.0  # engine time per request, running estimate
        self._start()

    def running(self) -> int:
        with self._cond:
            return len(self._running)

    def wait_estimate_s(self) -> float:
        """About how long a request submitted now waits for its place: none while the batch has
        a free place for it, else one request's engine time per request ahead of it."""
        with self._cond:
            ahead = len(self._waiting) + 1 - (self.max_batch_size - len(self._running))
        return max(0, ahead) * self.seconds_per_request

    def stream(
        self,
        item: GenerateItem,
        timeout_s: float | None = None,
        on_cancel: Callable[[Callable[[], None]], object] | None = None,
    ) -> Iterator[TokenEvent | Generated]:
        """Generate ``item``, yielding its tokens as they are decided
        (:mod:`openbook.rag.streaming`: greedy decoding only) and then its result; raises its
        error, as :meth:`submit` does. Closing the iterator early (the caller went away) gives
        the request up: it leaves the line, or its rows the batch before the next step."""
        timeout_s = bounded_timeout(timeout_s)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        events: queue.SimpleQueue[object] = queue.SimpleQueue()
        waiting = self._enqueue(replace(item, on_token=events.put), timeout_s, on_cancel)
        waiting.future.add_done_callback(lambda _: events.put(_RESOLVED))
        try:
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    event = events.get(timeout=left)
                except queue.Empty:
                    self._give_up(waiting)
                    raise DeadlineExceeded(f"no result within {timeout_s:.1f}s") from None
                if event is _RESOLVED:
                    break
                assert isinstance(event, TokenEvent)
                yield event
            yield self._outcome(waiting, None)  # resolved: returns at once
        finally:
            self._give_up(waiting)  # a no-op once it is resolved

    # ------------------------------------------------------------------ the decoding thread

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
                if self._expired_head():
                    continue
                head = self._waiting[0]
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
                on_token=item.on_token,
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
                if self._on_running_drop is not None:
                    self._on_running_drop("running", 1)
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
