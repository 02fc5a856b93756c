"""gRPC handlers of the generator: validation, batching, translation to protobuf."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

from openbook.checkpoint import (
    CheckpointError,
    generator_dir,
    resolve_checkpoint,
    verify_checkpoint,
)
from openbook.errors import InvalidArgument
from openbook.rag import DecodingOptions, GenerationResult, RagGenerator
from openbook.serving.batcher import Batcher
from openbook.serving.metrics import ServiceMetrics
from openbook.types import Passage
from openbook.v1 import common_pb2, generator_pb2, generator_pb2_grpc

log = logging.getLogger(__name__)

MAX_PASSAGES = 100
MAX_QUESTION_CHARS = 4000
DEFAULTS = DecodingOptions()

GenerateItem = tuple[str, Sequence[Passage], DecodingOptions]
Generated = tuple[GenerationResult, str]  # the result and the model version that produced it


def options_from_proto(msg: generator_pb2.DecodingOptions) -> DecodingOptions:
    """Unset (zero) fields take the library defaults; the library validates ranges."""
    options = DecodingOptions(
        mode=msg.mode or DEFAULTS.mode,
        num_beams=msg.num_beams or DEFAULTS.num_beams,
        max_new_tokens=msg.max_new_tokens or DEFAULTS.max_new_tokens,
        min_new_tokens=msg.min_new_tokens,
        length_penalty=msg.length_penalty if msg.HasField("length_penalty") else 1.0,
        num_return_sequences=msg.num_return_sequences or DEFAULTS.num_return_sequences,
    )
    options.validate()
    return options


def validate_generate(request: generator_pb2.GenerateRequest) -> list[Passage]:
    if not request.question.strip():
        raise InvalidArgument("question: must not be empty")
    if len(request.question) > MAX_QUESTION_CHARS:
        raise InvalidArgument(f"question: longer than {MAX_QUESTION_CHARS} characters")
    if not request.passages:
        raise InvalidArgument("passages: at least one passage is required")
    if len(request.passages) > MAX_PASSAGES:
        raise InvalidArgument(f"passages: at most {MAX_PASSAGES}, got {len(request.passages)}")
    return [Passage(id=p.id, title=p.title, text=p.text, score=p.score) for p in request.passages]


def result_to_proto(result: GenerationResult, model_version: str) -> generator_pb2.GenerateResponse:
    hypotheses = []
    for hyp in result.hypotheses:
        msg = generator_pb2.Hypothesis(text=hyp.text, log_prob=float(hyp.log_prob))
        if hyp.doc_posterior is not None:
            msg.doc_posterior.extend(hyp.doc_posterior)
        if hyp.tokens is not None and hyp.token_doc_posteriors is not None:
            for token, posterior in zip(hyp.tokens, hyp.token_doc_posteriors, strict=True):
                msg.tokens.append(
                    generator_pb2.TokenPosterior(token=token, doc_posterior=posterior)
                )
        hypotheses.append(msg)
    return generator_pb2.GenerateResponse(
        hypotheses=hypotheses, doc_prior=result.doc_prior, model_version=model_version
    )


def _model_info(g: RagGenerator) -> common_pb2.ModelInfo:
    return common_pb2.ModelInfo(
        model_version=g.model_version, model_type=g.model_type, device=g.device, dtype=g.dtype
    )


def load_generator_checkpoint(path: Path, device: str | None, dtype: str | None) -> RagGenerator:
    """The generator of a verified trainer checkpoint (or of the latest one under a root)."""
    ckpt = resolve_checkpoint(path)
    manifest = verify_checkpoint(ckpt)
    try:
        generator = RagGenerator.load(generator_dir(ckpt), device=device, dtype=dtype)
    except ValueError as exc:
        raise CheckpointError(f"checkpoint {manifest.version}: generator: {exc}") from None
    generator.model_version = manifest.version
    return generator


class GeneratorServicer(generator_pb2_grpc.GeneratorServicer):
    def __init__(
        self,
        generator: RagGenerator,
        *,
        max_batch_size: int = 8,
        max_batch_wait_ms: float = 5.0,
        max_queue: int = 64,
        metrics: ServiceMetrics | None = None,
        checkpoint_root: Path | None = None,
        on_model: Callable[[str], None] | None = None,
    ) -> None:
        self.generator = generator
        self.on_model = on_model
        self.metrics = metrics
        self.checkpoint_root = checkpoint_root
        self._reload_lock = threading.Lock()
        self.batcher: Batcher[GenerateItem, Generated] = Batcher(
            self._run_batch,
            max_batch_size=max_batch_size,
            max_wait_ms=max_batch_wait_ms,
            max_queue=max_queue,
            name="generate-batcher",
            on_batch=self._on_batch,
        )
        if metrics is not None:
            metrics.track_queue(self.batcher.depth)
        self._announce()

    def _on_batch(self, size: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_batch(size, self.batcher.depth())

    def _run_batch(self, items: list[GenerateItem]) -> list[Generated | Exception]:
        # One model for the whole batch: a reload swaps the reference for later batches only.
        generator = self.generator
        results = list(generator.generate_batch(items))
        return [(r, generator.model_version) for r in results]

    def Generate(self, request, context):
        passages = validate_generate(request)
        options = options_from_proto(request.options)
        remaining = context.time_remaining()
        result, version = self.batcher.submit(
            (request.question, passages, options), timeout_s=remaining
        )
        return result_to_proto(result, version)

    def Info(self, request, context):
        return _model_info(self.generator)

    def ReloadModel(self, request, context):
        """Load a checkpoint's generator beside the current one, then switch atomically.

        Requests already batched finish on the old model; a checkpoint that fails to verify
        or load raises (INVALID_ARGUMENT with the reason) and the old model keeps serving.
        """
        with self._reload_lock:
            path = Path(request.path) if request.path else self.checkpoint_root
            if path is None:
                raise InvalidArgument("path: no checkpoint given and no checkpoint root configured")
            current = self.generator
            self.generator = load_generator_checkpoint(path, current.device, current.dtype)
        log.info(
            "generator reloaded: %s -> %s", current.model_version, self.generator.model_version
        )
        self._announce()
        return _model_info(self.generator)

    def _announce(self) -> None:
        version = self.generator.model_version
        if self.metrics is not None:
            self.metrics.set_serving("model", version)
        if self.on_model is not None:
            self.on_model(version)

    def close(self) -> None:
        self.batcher.close()
