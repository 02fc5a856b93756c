"""gRPC handlers of the generator: validation, admission, translation to protobuf.

``Generate`` turns its proto request into a :class:`ValidGenerateRequest` first, checked once
against ``openbook.validation.limits`` (the limits the gateway enforces too); everything behind it
trusts that request. Anything else that fails is a bug here, and answers INTERNAL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import grpc

from openbook.errors import InvalidArgument, TooLarge, client_errors
from openbook.observability import telemetry
from openbook.rag import DecodingOptions, GenerationResult, ModelLoadError, RagGenerator
from openbook.rag.checkpoint import load_generator
from openbook.rag.memory import RequestShape, mib
from openbook.rag.streaming import TokenEvent
from openbook.runtime.compute_threads import ComputeThreads, ComputeThreadsOptions
from openbook.serving.allocator import RESIDENT_SLACK_BYTES, MemoryReleaser
from openbook.serving.grpc_server import time_budget, time_remaining
from openbook.serving.metrics import ServiceMetrics
from openbook.serving.threads import in_passing_thread
from openbook.state.shared_state import ModelFollower
from openbook.storage.checkpoint import CheckpointError, checkpoint_in_root
from openbook.types import Passage
from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc
from openbook.validation.limits import (
    MAX_CALLER_CHARS,
    MAX_K,
    check_finite,
    check_question,
    refuse_controls,
)
from openbook_generator.model_setup import ModelSetup
from openbook_generator.scheduler import GenerateItem, Scheduler, SchedulingOptions, StageTimes

log = logging.getLogger(__name__)

# A checkpoint that ReloadModel is asked for and that is refused: the client's choice.
client_errors(CheckpointError, ModelLoadError)

DEFAULTS = DecodingOptions()


@dataclass(frozen=True)
class ValidGenerateRequest:
    """A ``GenerateRequest`` checked against ``openbook.validation.limits``: what the servicer works
    on."""

    question: str
    passages: tuple[Passage, ...]
    options: DecodingOptions
    caller: str = ""  # its fair-share class (GenerateRequest.caller); "": anonymous


def options_from_proto(msg: generator_pb2.DecodingOptions) -> DecodingOptions:
    """Unset (zero) fields take the library defaults; every field is checked here, by the
    rules the gateway and the library apply (``openbook.validation.limits.check_decoding``)."""
    length_penalty = msg.length_penalty if msg.HasField("length_penalty") else 1.0
    options = DecodingOptions(
        mode=msg.mode or DEFAULTS.mode,
        num_beams=msg.num_beams or DEFAULTS.num_beams,
        max_new_tokens=msg.max_new_tokens or DEFAULTS.max_new_tokens,
        min_new_tokens=msg.min_new_tokens,
        length_penalty=length_penalty,
        num_return_sequences=msg.num_return_sequences or DEFAULTS.num_return_sequences,
        temperature=msg.temperature if msg.HasField("temperature") else DEFAULTS.temperature,
        top_p=msg.top_p if msg.HasField("top_p") else DEFAULTS.top_p,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )
    options.validate()
    return options


def validate_generate(request: generator_pb2.GenerateRequest) -> ValidGenerateRequest:
    """The request, checked once; raises :class:`InvalidArgument` naming the first bad field."""
    question = check_question("question", request.question)
    if not request.passages:
        raise InvalidArgument("passages: at least one passage is required")
    if len(request.passages) > MAX_K:
        raise InvalidArgument(f"passages: at most {MAX_K}, got {len(request.passages)}")
    for i, p in enumerate(request.passages):
        check_finite(f"passages[{i}].score", p.score)
    passages = tuple(
        Passage(id=p.id, title=p.title, text=p.text, score=p.score) for p in request.passages
    )
    caller = request.caller
    if len(caller) > MAX_CALLER_CHARS:
        raise InvalidArgument(
            f"caller must be at most {MAX_CALLER_CHARS} characters, got {len(caller)}"
        )
    refuse_controls("caller", caller)
    return ValidGenerateRequest(question, passages, options_from_proto(request.options), caller)


def result_to_proto(
    result: GenerationResult, model_version: str, prompt_tokens: int
) -> generator_pb2.GenerateResponse:
    hypotheses = []
    for hyp in result.hypotheses:
        msg = generator_pb2.Hypothesis(
            text=hyp.text,
            log_prob=float(hyp.log_prob),
            num_tokens=len(hyp.token_ids),
            finish_reason=hyp.finish_reason,
            confidence=hyp.confidence,
            raw_confidence=hyp.raw_confidence,
        )
        if hyp.doc_posterior is not None:
            msg.doc_posterior.extend(hyp.doc_posterior)
        if hyp.tokens is not None and hyp.token_doc_posteriors is not None:
            for token, posterior in zip(hyp.tokens, hyp.token_doc_posteriors, strict=True):
                msg.tokens.append(
                    generator_pb2.TokenPosterior(token=token, doc_posterior=posterior)
                )
        hypotheses.append(msg)
    return generator_pb2.GenerateResponse(
        hypotheses=hypotheses,
        doc_prior=result.doc_prior,
        model_version=model_version,
        prompt_tokens=prompt_tokens,
        cached_prompt_tokens=result.cached_input_tokens,
    )


def trace_stages(
    received_ns: int,
    item: GenerateItem | None,
    reply: generator_pb2.GenerateResponse | None,
) -> None:
    """The request's stages as child spans of the RPC's span, from the times the scheduler
    wrote (``item.times``): ``openbook.admission`` (validation, the memory estimate and the
    deadline check), ``openbook.queue`` (waiting for a place in a batch) and
    ``openbook.generation`` (decoding in the batch, with the GenAI usage attributes). A stage
    the request never reached (refused, dropped) has no span. No-op with tracing off."""
    times = None if item is None else item.times
    if times is None or item is None:
        return
    now = time.time_ns()
    shape = item.shape
    telemetry.past_span(
        "openbook.admission",
        received_ns,
        times.admitted_ns or now,
        {
            "openbook.admitted": times.admitted_ns > 0,
            "openbook.passages": shape.passages,
            "openbook.beams": shape.beams,
        },
    )
    if not times.admitted_ns:
        return
    telemetry.past_span("openbook.queue", times.admitted_ns, times.started_ns or now)
    if not times.started_ns:
        return
    attributes: dict[str, str | int | float | list[str]] = {
        "gen_ai.operation.name": "text_completion",
        "gen_ai.provider.name": telemetry.PROVIDER,
        "gen_ai.request.max_tokens": item.options.max_new_tokens,
        "gen_ai.request.temperature": item.options.temperature,
        "gen_ai.usage.input_tokens": shape.input_tokens,
        "openbook.decoding": item.options.mode,
    }
    if reply is not None:
        attributes["gen_ai.request.model"] = reply.model_version
        attributes["gen_ai.response.model"] = reply.model_version
        attributes["gen_ai.usage.output_tokens"] = sum(h.num_tokens for h in reply.hypotheses)
        attributes["gen_ai.response.finish_reasons"] = [h.finish_reason for h in reply.hypotheses]
    telemetry.past_span(
        "openbook.generation", times.started_ns, times.finished_ns or now, attributes
    )


def token_to_proto(event: TokenEvent) -> generator_pb2.GenerateEvent:
    token = generator_pb2.TokenEvent(
        token_id=event.token_id,
        token=event.token,
        text=event.text,
        passage=event.passage,
        doc_posterior=event.doc_posterior or (),
    )
    return generator_pb2.GenerateEvent(token=token)


def _model_info(g: RagGenerator) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_version=g.model_version,
        model_type=g.model_type,
        device=g.device,
        dtype=g.dtype,
        default_k=getattr(g, "default_k", 0),
    )


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(
        self,
        generator: RagGenerator,
        *,
        scheduling: SchedulingOptions | None = None,
        memory_budget_bytes: int | None = None,
        model_setup: ModelSetup | None = None,
        max_request_s: float | None = None,
        metrics: ServiceMetrics | None = None,
        checkpoint_root: Path | None = None,
        base_model: Path | None = None,
        on_model: Callable[[str], None] | None = None,
        compute_threads: ComputeThreadsOptions | None = None,
    ) -> None:
        """``memory_budget_bytes``: estimated working memory (beyond the weights) one batch may
        hold (:mod:`openbook.rag.memory`); None: unbounded. ``max_request_s``: the longest any
        request is worked on or waited for, whatever deadline its caller sets. ``base_model``:
        the configured model, onto which a checkpoint that holds only an adapter is loaded.
        ``model_setup``: how every model it serves is set up, at start and after each reload
        (passage cache, drafting, int8 head, packed weights; :class:`ModelSetup`'s defaults
        when None); a model that cannot be set up so is refused (ValueError).
        ``compute_threads``: how the decoding thread sizes its torch threads
        (:mod:`openbook.runtime.compute_threads`); None: torch's default, untouched."""
        self.model_setup = model_setup or ModelSetup()
        self.generator = self.model_setup.apply(generator)
        self.on_model = on_model
        self.metrics = metrics
        self.checkpoint_root = checkpoint_root
        self.base_model = base_model
        self.memory_budget_bytes = memory_budget_bytes
        self.max_request_s = max_request_s
        self._reload_lock = threading.Lock()
        self.stop_following = threading.Event()
        self.follower: ModelFollower | None = None  # once following reloads
        # gives the C allocator's freed pages back when decoding goes idle, before large work
        # and when it holds more than its work accounts for, and moves its mmap threshold with
        # the size of the requests running
        self.releaser = MemoryReleaser.for_this_process(RESIDENT_SLACK_BYTES)
        self.compute: ComputeThreads | None = None
        if compute_threads is not None:
            self.compute = ComputeThreads(
                compute_threads,
                on_change=None if metrics is None else metrics.set_compute_threads,
            )
        self.scheduler = Scheduler(
            lambda: self.generator,
            scheduling or SchedulingOptions(),
            fits=self._fits,
            on_step=self._on_step,
            on_drop=self._on_drop,
            on_admit=self._on_admit,
            on_finish=self._on_finish,
            compute=self.compute,
        )
        if metrics is not None:
            metrics.track_queue(self.scheduler.depth)
            metrics.track_passage_cache(self._passage_lookups)
            metrics.track_slowdown(self.scheduler.slowdown)
        self._announce()

    def _on_step(self, size: int, queued: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_batch(size, queued)

    def _on_drop(self, where: str, count: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_dropped(where, count)

    def _on_admit(self, shape: RequestShape) -> None:
        self.releaser.started(self.generator.memory.batch_bytes([shape]))

    def _on_finish(self, shape: RequestShape, idle: bool) -> None:
        self.releaser.finished(self.generator.memory.batch_bytes([shape]), idle)

    def _fits(self, shapes: list[RequestShape]) -> bool:
        if self.memory_budget_bytes is None:
            return True
        return self.generator.memory.batch_bytes(shapes) <= self.memory_budget_bytes

    def item(
        self, question: str, passages: Sequence[Passage], options: DecodingOptions
    ) -> GenerateItem:
        """The request with its shape; refused, before anything is allocated, if its estimated
        memory alone exceeds the budget (:class:`TooLarge`). Whether it can finish before its
        deadline is checked as it enters the scheduler's line (:meth:`Scheduler.admission`)."""
        generator = self.generator
        shape = generator.request_shape(question, passages, options)
        if self.memory_budget_bytes is not None:
            need = generator.memory.batch_bytes([shape])
            if need > self.memory_budget_bytes:
                raise TooLarge(
                    f"this request needs an estimated {mib(need)} of working memory "
                    f"({shape.passages} passages x {shape.beams} beams, prompts of up to "
                    f"{shape.prompt_tokens} tokens, {shape.new_tokens} new tokens); the "
                    f"generator's budget is {mib(self.memory_budget_bytes)} "
                    "(OPENBOOK_GENERATOR_MEMORY_MB): use fewer passages (k), beams or new tokens"
                )
        return GenerateItem(question, passages, options, shape)

    def Generate(
        self, request: generator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> generator_pb2.GenerateResponse:
        received_ns = time.time_ns()
        item: GenerateItem | None = None
        reply: generator_pb2.GenerateResponse | None = None
        try:
            item, time_left = self._validated(request, context)
            result, version = self.scheduler.submit(
                item, timeout_s=time_left, on_cancel=context.add_callback
            )
            reply = result_to_proto(result, version, item.shape.input_tokens)
            return reply
        finally:
            trace_stages(received_ns, item, reply)

    def GenerateStream(
        self, request: generator_pb2.GenerateRequest, context: grpc.ServicerContext
    ) -> Iterator[generator_pb2.GenerateEvent]:
        """Validated and admitted before the first event, as Generate; then token events, and
        the reply as the last event. The client going away closes this iterator, which takes
        the request out of the batch."""
        received_ns = time.time_ns()
        item: GenerateItem | None = None
        try:
            item, time_left = self._validated(request, context)
            events = self.scheduler.stream(
                item, timeout_s=time_left, on_cancel=context.add_callback
            )
        except BaseException:
            trace_stages(received_ns, item, None)
            raise
        return self._stream_events(events, item, received_ns)

    @staticmethod
    def _stream_events(
        events, item: GenerateItem, received_ns: int
    ) -> Iterator[generator_pb2.GenerateEvent]:
        reply: generator_pb2.GenerateResponse | None = None
        try:
            for event in events:
                if isinstance(event, TokenEvent):
                    yield token_to_proto(event)
                else:
                    result, version = event
                    reply = result_to_proto(result, version, item.shape.input_tokens)
                    yield generator_pb2.GenerateEvent(done=reply)
        finally:
            trace_stages(received_ns, item, reply)

    def _validated(self, request, context) -> tuple[GenerateItem, float | None]:
        """The request validated and within the memory budget, and how long it may take (its
        deadline, bounded by ``max_request_s``); the scheduler admits it by speed. With
        tracing on, the item carries the :class:`StageTimes` the scheduler fills in."""
        valid = validate_generate(request)
        time_left, budget = time_remaining(context), time_budget(context)
        if self.max_request_s is not None:
            time_left = min(time_left or self.max_request_s, self.max_request_s)
            budget = None if budget is None else min(budget, self.max_request_s)
        item = replace(
            self.item(valid.question, valid.passages, valid.options),
            caller=valid.caller,
            budget_s=budget,
        )
        if telemetry.enabled():
            item = replace(item, times=StageTimes())
        return item, time_left

    def Info(self, request, context):
        return _model_info(self.generator)

    def ReloadModel(self, request, context):
        """Load a checkpoint's generator beside the current one, then switch atomically.

        Requests already batched finish on the old model; a checkpoint that fails to verify
        or load raises (INVALID_ARGUMENT with the reason) and the old model keeps serving.
        """
        self.load_checkpoint(request.path)
        return _model_info(self.generator)

    def load_checkpoint(self, requested: str) -> str:
        """Load the checkpoint ``requested`` names inside the checkpoint root, then switch to
        it; raises (and keeps the current model) if it is refused. Returns the new version.
        ReloadModel and the follower of shared reloads (every replica) both come here."""
        with self._reload_lock:
            current = self.generator
            try:
                # Only checkpoints inside the checkpoint root: the path comes from an HTTP client.
                path = checkpoint_in_root(self.checkpoint_root, requested)
                # in a thread that ends with the load (openbook/serving/threads.py)
                loaded = in_passing_thread(
                    lambda: load_generator(
                        path, device=current.device, dtype=current.dtype, base=self.base_model
                    )
                )
                self.generator = self.model_setup.apply(loaded)
            except OSError as exc:  # inside the root, but unreadable (permissions, ...)
                detail = exc.strerror or exc
                raise InvalidArgument(f"checkpoint {requested!r}: {detail}") from None
        log.info(
            "generator reloaded: %s -> %s", current.model_version, self.generator.model_version
        )
        self._announce()
        return self.generator.model_version

    def _passage_lookups(self, result: str) -> int:
        cache = getattr(self.generator.backend, "passage_cache", None)
        if cache is None:
            return 0
        return cache.hits if result == "hit" else cache.misses

    def _announce(self) -> None:
        version = self.generator.model_version
        if self.metrics is not None:
            self.metrics.set_serving("model", version)
        if self.on_model is not None:
            self.on_model(version)

    def close(self) -> None:
        self.stop_following.set()  # the follower of shared reloads, if one was started
        self.scheduler.close()
        self.releaser.close()
