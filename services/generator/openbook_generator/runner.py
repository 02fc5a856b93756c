"""The generator's model runner: the batches of the loaded models, and running one piece of work.

The second of the engine's three parts (:mod:`openbook_generator.policy` says which piece of
work runs next, :mod:`openbook_generator.scheduler` runs the loop): it holds a
:class:`~openbook.rag.engine.DecodingEngine` per batch, places a started request in its batch
(:meth:`ModelRunner.place`, :meth:`ModelRunner.add`) and executes a prefill chunk or a decoding
step (:meth:`ModelRunner.execute`), reporting what happened (:class:`RunOutput`) for the loop
to answer the callers and measure the speed. It decides nothing about order or admission.

Invariants:

* used by the decoding thread only (its batches are that thread's: no lock);
* a failed prefill fails its request only; a failed step fails the requests of its batch (its
  state is lost) and the batch goes; no other batch is touched;
* a batch lives while it holds requests; the current model's shared batch is kept when empty,
  a solo batch or an old model's batch goes (a model reload never disturbs running requests:
  they finish on the engine of the model they started on, new requests start on the new one);
* with compute threads (:mod:`openbook.runtime.compute_threads`), every model it runs is hooked
  once so that the thread count may change between the layers of a forward pass, on this thread
  only.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from openbook.rag import DecodingOptions, RagGenerator
from openbook.rag.engine import DecodingEngine, Outcome, Running
from openbook.rag.streaming import OnToken
from openbook.runtime.compute_threads import ComputeThreads
from openbook.types import Passage
from openbook_generator.policy import Work, WorkKind

log = logging.getLogger(__name__)


class Generate(Protocol):
    """What the engine is given of a request (the loop's ``GenerateItem``)."""

    @property
    def question(self) -> str: ...
    @property
    def passages(self) -> Sequence[Passage]: ...
    @property
    def options(self) -> DecodingOptions: ...
    @property
    def on_token(self) -> OnToken | None: ...


@dataclass(eq=False)
class Batch:
    """One decoding batch: the engine of one model, shared by small requests or holding one
    large request (``solo``)."""

    generator: RagGenerator
    engine: DecodingEngine
    solo: bool


@dataclass
class RunOutput:
    """What one piece of work did. ``size`` is what the speed model is told: rows stepped or
    prompt tokens prefilled; ``measured`` is false when it did no work to time (it failed, or a
    step decoded nothing). ``scored_tokens``/``scoring_s``: RAG-Sequence thorough's scoring
    done by a step for the requests it finished (openbook_generator.speed: timed apart from
    the step). ``outcomes``: (tag, result or :class:`~openbook.rag.errors.Abandoned`) of the
    requests it finished; ``failed``: the tags of the requests ``error`` failed."""

    kind: WorkKind
    size: float = 0.0
    measured: bool = False
    scored_tokens: float = 0.0
    scoring_s: float = 0.0
    outcomes: list[Outcome] = field(default_factory=list)
    failed: list[Any] = field(default_factory=list)
    error: Exception | None = None


class ModelRunner:
    """Batches of the loaded models, and the pieces of work run on them (module docstring).

    ``current()`` is the model new requests start on; ``compute``: the compute threads resized
    between layers (None: torch's default, untouched)."""

    def __init__(
        self, current: Callable[[], RagGenerator], compute: ComputeThreads | None = None
    ) -> None:
        self._current = current
        self._compute = compute
        self.batches: list[Batch] = []
        self._resizing: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()  # models hooked

    # ------------------------------------------------------------------ placing requests

    def place(self, rows: int, shared: bool, joining: dict[int, int]) -> Batch | None:
        """The batch a request of ``rows`` decoder rows decodes in: the current model's shared
        batch if it is ``shared`` and the batch's rows leave room (``joining``: rows placed in
        batches since they last ran, by ``id(batch)``), None if they do not (it waits); else a
        new batch of its own, also when the model family joins no running batch."""
        generator = self._current()
        if shared:
            for batch in self.batches:
                if batch.generator is generator and not batch.solo:
                    fits = batch.engine.accepts(rows, joining.get(id(batch), 0))
                    return batch if fits else None
        self.resize_within(generator)
        batch = Batch(generator, generator.engine(), solo=not shared)
        if not batch.solo and not generator.backend.joins_running:
            batch.solo = True  # nothing can join it: it is this request's alone
        self.batches.append(batch)
        return batch

    def add(
        self,
        batch: Batch,
        item: Generate,
        tag: Any,
        gave_up: Callable[[], bool],
        chunk_passages: int,
    ) -> Running:
        """Add a started request (``item``: its question, passages, options and ``on_token``)
        to its batch's engine, nothing encoded yet; raises what the engine raises."""
        return batch.engine.add(
            item.question,
            item.passages,
            item.options,
            tag=tag,
            gave_up=gave_up,
            on_token=item.on_token,
            chunk_passages=chunk_passages,
        )

    # ------------------------------------------------------------------ running work

    def execute(self, work: Work[Batch], running: Running | None = None) -> RunOutput:
        """Run the piece of work the policy chose: a prefill chunk of ``work.request`` (whose
        engine entry is ``running``) or a decoding step of ``work.batch``."""
        if work.kind is WorkKind.PREFILL:
            assert work.request is not None and running is not None
            return self._prefill(work.batch, running, work.request.shape.input_tokens)
        return self._step(work.batch)

    def _step(self, batch: Batch) -> RunOutput:
        engine = batch.engine
        rows = engine.rows
        try:
            outcomes = engine.step()
        except Exception as exc:  # noqa: BLE001 - the batch's state is lost: fail its requests
            log.exception("decoding step failed; failing the %d requests of its batch", len(engine))
            self.batches.remove(batch)
            return RunOutput(WorkKind.STEP, failed=engine.abort(), error=exc)
        # nothing decoded (answers returned, abandoned requests dropped): nothing to time
        return RunOutput(
            WorkKind.STEP,
            size=rows,
            measured=engine.last_step_s > 0,
            scored_tokens=engine.last_scored_tokens,
            scoring_s=engine.last_scoring_s,
            outcomes=outcomes,
        )

    def _prefill(self, batch: Batch, running: Running, input_tokens: int) -> RunOutput:
        before = running.prefilled
        try:
            batch.engine.prefill(running)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            log.exception("prefilling a request failed")
            batch.engine.abort_request(running)
            return RunOutput(WorkKind.PREFILL, failed=[running.tag], error=exc)
        passages = max(1, len(running.passages))
        # the chunk's share of the prompt tokens, less those whose keys/values the passage
        # cache gave: counted as work done, reused heads made the prefill look several times
        # faster than it is for new passages, and admission then planned those too short
        tokens = input_tokens * (running.prefilled - before) / passages
        computed = max(0.0, tokens - batch.engine.last_reused_tokens)
        return RunOutput(WorkKind.PREFILL, size=computed, measured=True)

    def forget_idle(self) -> None:
        """Batches with nothing left go, except the current model's shared one."""
        current = self._current()
        self.batches = [
            b for b in self.batches if len(b.engine) or (b.generator is current and not b.solo)
        ]

    # ------------------------------------------------------------------ compute threads

    def resize_within(self, generator: RagGenerator) -> None:
        """Let the compute threads be resized between the layers of ``generator``'s forward
        passes too, not only between pieces of work: a piece that a neighbour stalls may take
        many seconds (a team of two on one core), and the first chance to give up the lost
        core must not wait for its end. A forward pre-hook on every layer of the model's layer
        lists calls ``maybe_resize`` (a clock read unless a second has passed) when it runs on
        the decoding thread. Called by the decoding thread for each model it runs."""
        model = generator.model
        if self._compute is None or model in self._resizing:
            return
        compute, thread = self._compute, threading.current_thread()

        def between_layers(module: torch.nn.Module, args: object) -> None:
            if threading.current_thread() is thread:
                compute.maybe_resize()

        for module in model.modules():
            if isinstance(module, torch.nn.ModuleList):
                for layer in module:
                    layer.register_forward_pre_hook(between_layers)
        self._resizing.add(model)
