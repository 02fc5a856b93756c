"""``RagGenerator``: the public entry point used by the generator service and the trainer."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from openbook.errors import InvalidArgument
from openbook.rag.adapters import check_base, merged
from openbook.rag.backends import GeneratorBackend
from openbook.rag.beam import SearchSettings, StopFn
from openbook.rag.confidence import AnyCalibration, load_calibration
from openbook.rag.engine import DecodingEngine, GaveUp
from openbook.rag.errors import Abandoned
from openbook.rag.loading import dtype_name, load
from openbook.rag.losses import rag_sequence_nll, rag_token_nll
from openbook.rag.memory import (
    MemoryModel,
    RequestShape,
    measuring_twin,
    memory_model,
    request_shape,
)
from openbook.rag.options import DecodingOptions, GenerationResult
from openbook.rag.packed_weights import Packing, is_packed
from openbook.rag.streaming import OnToken
from openbook.types import Passage
from openbook.validation.limits import check_finite

Request = tuple[str, Sequence[Passage], DecodingOptions]

# Upper bound on decoder rows (requests x passages x beams) decoded together.
MAX_BATCH_ROWS = 256


def validate_request(question: str, passages: Sequence[Passage], options: DecodingOptions) -> None:
    """The library's entry check, for :class:`RagGenerator`'s direct callers (the generator
    service validates at its own boundary, with the same decoding rules, and calls the engine).
    Raises :class:`~openbook.errors.InvalidArgument` naming the first bad field."""
    if not isinstance(question, str) or not question.strip():
        raise InvalidArgument("question must be a non-empty string")
    if passages is None or len(passages) == 0:
        raise InvalidArgument("passages must contain at least one passage, got 0")
    for j, p in enumerate(passages):
        if not isinstance(p, Passage):
            raise InvalidArgument(f"passages[{j}] must be a Passage, got {type(p).__name__}")
        check_finite(f"passages[{j}].score", p.score)
    if not isinstance(options, DecodingOptions):
        raise InvalidArgument(f"options must be DecodingOptions, got {type(options).__name__}")
    options.validate()


class RagGenerator:
    """RAG-Token / RAG-Sequence generation over a BART, RAG-checkpoint or causal-LM generator."""

    def __init__(
        self,
        backend: GeneratorBackend,
        *,
        model_version: str,
        generation: dict[str, Any] | None = None,
        default_k: int = 0,
        calibration: AnyCalibration | None = None,
    ) -> None:
        self.backend = backend
        # an answer's raw confidence (and features) -> its calibrated confidence
        # (openbook/rag/confidence.py); None: raw
        self.calibration = calibration
        self.model_version = model_version
        # Passages to retrieve when a request names none (a RAG checkpoint's n_docs); 0: none
        self.default_k = default_k
        self.model_type = backend.kind
        self.device = str(backend.device)
        self.dtype = dtype_name(next(backend.model.parameters()).dtype)
        self.generation = dict(generation or {})
        self.memory: MemoryModel = memory_model(backend)
        # Requests are measured in other threads than the one decoding: with their own
        # tokenizers (tokenizers are not thread-safe), one measurement at a time.
        self._measuring = measuring_twin(backend)
        self._measuring_lock = threading.Lock()
        self._lock = threading.Lock()
        # tokens greedy searches (RAG-Token, RAG-Sequence) draft per step
        # (openbook/rag/drafting.py); 0: off
        self.draft_tokens = 0

    def set_draft_tokens(self, tokens: int) -> None:
        """Draft up to ``tokens`` tokens per step of greedy RAG-Token or RAG-Sequence decoding,
        verified in one forward pass (:mod:`openbook.rag.drafting`; answers unchanged); 0
        turns drafting off. The memory model then counts the drafted positions' logits (two
        positions at most where the backend defers its LM head)."""
        if tokens < 0:
            raise InvalidArgument(f"draft tokens must be >= 0, got {tokens}")
        self.draft_tokens = tokens if self.backend.drafts() else 0
        self.memory = replace(
            memory_model(self.backend),
            draft_tokens=self.draft_tokens,
            head_deferred=self.backend.defers_head(),
        )

    @classmethod
    def load(
        cls, path: str | Path, device: str | None = None, dtype: str | None = None
    ) -> RagGenerator:
        """Load a local generator directory (BART, RAG checkpoint or causal LM + prompt file).

        Raises :class:`openbook.rag.ModelLoadError` (a ``ValueError``) naming a missing/corrupt
        file; the directory's confidence calibration, if any (``confidence_calibration.json``,
        :mod:`openbook.rag.confidence`), is read and checked first.
        """
        calibration = load_calibration(path)
        loaded = load(path, device, dtype)
        return cls(
            loaded.backend,
            model_version=loaded.version,
            generation=loaded.generation,
            default_k=loaded.default_k,
            calibration=calibration,
        )

    def pack_weights(self, packing: Packing = Packing.AUTO) -> bool:
        """Serve with the linear weights reordered once for this machine's kernels
        (:mod:`openbook.rag.packed_weights`, causal models on CPU: by default bf16, the answers
        bitwise the same, and float32, to rounding); whether they were. Inference only (a
        merged adapter is packed again)."""
        return self.backend.pack_weights(packing)

    @property
    def weights_packed(self) -> bool:
        """Whether the model serves with packed linear weights (:meth:`pack_weights`)."""
        return is_packed(self.backend.model)

    @property
    def model(self) -> torch.nn.Module:
        return self.backend.model

    @property
    def tokenizer(self):
        return self.backend.tokenizer

    def refresh(self) -> None:
        """Rebuild caches derived from the weights (causal prefix cache); call after updates."""
        self.backend.refresh()

    def apply_adapter(self, adapter_dir: Path, base_dir: Path) -> None:
        """Merge a LoRA adapter (:mod:`openbook.rag.adapters`) into this generator, loaded from
        ``base_dir``; raises :class:`~openbook.rag.adapters.AdapterMismatch` if the adapter was
        trained on another base model. A confidence calibration stored with the adapter replaces
        the base model's (it was fitted on the adapted model's answers)."""
        check_base(adapter_dir, base_dir)
        calibration = load_calibration(adapter_dir)
        packed = self.backend.unpack_weights()  # PEFT merges into nn.Linear modules
        self.backend.model = merged(self.backend.model, adapter_dir)
        if packed:  # as before the merge: it was packed, so its precision is one that packs
            self.backend.pack_weights(Packing.AUTO)
        self.refresh()
        if calibration is not None:
            self.calibration = calibration

    # ------------------------------------------------------------------ generation

    def request_shape(
        self, question: str, passages: Sequence[Passage], options: DecodingOptions
    ) -> RequestShape:
        """Rows and lengths of a request (tokenises its passages), for :attr:`memory`."""
        with self._measuring_lock:
            return request_shape(self._measuring, question, passages, options)

    def generate(
        self,
        question: str,
        passages: Sequence[Passage],
        options: DecodingOptions,
        on_token: OnToken | None = None,
    ) -> GenerationResult:
        """One answer; ``on_token`` (greedy decoding) is called with each token as it is
        decided (:mod:`openbook.rag.streaming`)."""
        validate_request(question, passages, options)
        with self._lock, torch.inference_mode():
            engine = self.engine()
            engine.add(question, passages, options, on_token=on_token)
            while True:
                for _, outcome in engine.step():
                    assert isinstance(outcome, GenerationResult)
                    return outcome

    def engine(self, max_rows: int = MAX_BATCH_ROWS) -> DecodingEngine:
        """A continuous-batching engine over this generator (:mod:`openbook.rag.engine`); use it
        from one thread, under ``torch.inference_mode()``, with requests that passed
        :func:`validate_request`."""
        backend = self.backend
        return DecodingEngine(
            backend,
            self._settings,
            self._stop_fn(),
            max_rows,
            self.stop_strings(),
            answer_prefix=backend.answer_prefix,
            calibration=self.calibration,
            draft_tokens=self.draft_tokens,
        )

    def stop_strings(self) -> list[str]:
        """Strings at which the model family's decoding cuts an answer (prompted families)."""
        return self.backend.stop_strings()

    def generate_batch(
        self, requests: Sequence[Request], gave_up: Sequence[GaveUp] | None = None
    ) -> list[GenerationResult | Abandoned]:
        """Generate for several requests, decoded together by one :meth:`engine`.

        Every request is validated first; the first invalid one raises
        :class:`~openbook.errors.InvalidArgument`
        (callers that must isolate bad requests validate each with :func:`validate_request`).
        ``gave_up[i]``, when given, says whether request i's caller stopped waiting: its rows
        leave the batch before the next decoding step (or it never starts) and it gets an
        :class:`Abandoned` instead of a result. Without ``gave_up`` every entry is a
        :class:`GenerationResult`.
        """
        for question, passages, options in requests:
            validate_request(question, passages, options)
        results: list[GenerationResult | Abandoned | None] = [None] * len(requests)
        waiting = list(range(len(requests)))
        with self._lock, torch.inference_mode():
            engine = self.engine()
            while waiting or len(engine):
                while waiting:
                    i = waiting[0]
                    question, passages, options = requests[i]
                    if gave_up is not None and gave_up[i]():
                        results[waiting.pop(0)] = Abandoned("the caller gave up before decoding")
                        continue
                    if not engine.accepts(len(passages) * options.rows_per_passage):
                        break
                    waiting.pop(0)
                    check = None if gave_up is None else gave_up[i]
                    engine.add(question, passages, options, tag=i, gave_up=check)
                for i, outcome in engine.step():
                    results[i] = outcome
        return [r for r in results if r is not None]

    def _settings(self, options: DecodingOptions) -> SearchSettings:
        b = self.backend
        s = SearchSettings(
            num_beams=options.num_beams,
            max_new_tokens=options.max_new_tokens,
            min_new_tokens=options.min_new_tokens,
            length_penalty=float(options.length_penalty),
            num_return_sequences=options.num_return_sequences,
            temperature=float(options.temperature),
            top_k=options.top_k,
            top_p=float(options.top_p),
            eos_token_id=b.eos_token_id,
            pad_token_id=b.pad_token_id,
            early_stopping=self.generation.get("early_stopping", False),
        )
        if b.kind == "bart":
            s.forced_bos_token_id = self.generation.get("forced_bos_token_id")
            s.forced_eos_token_id = self.generation.get("forced_eos_token_id")
            s.no_repeat_ngram_size = int(self.generation.get("no_repeat_ngram_size") or 0)
            s.history_prefix = (b.target_start_id,)
        return s

    def _stop_fn(self) -> StopFn | None:
        b = self.backend
        if not b.prompted:
            return None
        stops = self.stop_strings()
        extra = {t for t in self.generation.get("extra_eos_token_ids", []) if t != b.eos_token_id}
        tok = b.tokenizer

        def stop(tokens: list[int]) -> bool:
            if tokens[-1] in extra:
                return True
            # a stop string ends in the newest token, so a short tail suffices
            tail = tok.decode(tokens[-8:], skip_special_tokens=False)
            return any(s in tail for s in stops)

        return stop if (stops or extra) else None

    # ------------------------------------------------------------------ training

    def loss(
        self,
        questions: Sequence[str],
        passages_per_question: Sequence[Sequence[Passage]],
        doc_scores: torch.Tensor,
        targets: Sequence[str],
        mode: str,
        epsilon: float = 0.0,
        *,
        reduce_loss: bool = True,
        exclude_bos_score: bool = False,
    ) -> torch.Tensor:
        """Marginal NLL of ``targets`` (answer strings) for training.

        doc_scores: (B, k) retrieval scores, may require grad (e.g. DPR q.d products); every
        question must come with exactly k passages. mode: "rag-token" or "rag-sequence" (any
        "rag-sequence-*" accepted). Returns the summed loss (scalar) by default, (B,) with
        ``reduce_loss=False``. Runs with the caller's grad mode and the model's train/eval mode.
        """
        n = len(questions)
        if n == 0 or len(passages_per_question) != n or len(targets) != n:
            raise InvalidArgument(
                "questions, passages_per_question and targets must have equal length"
            )
        if doc_scores.dim() != 2 or doc_scores.shape[0] != n:
            raise InvalidArgument(
                f"doc_scores must have shape ({n}, k), got {tuple(doc_scores.shape)}"
            )
        k = doc_scores.shape[1]
        if any(len(p) != k for p in passages_per_question):
            raise InvalidArgument(
                f"every question needs exactly k={k} passages (doc_scores columns)"
            )
        if mode == "rag-token":
            nll = rag_token_nll
        elif mode.startswith("rag-sequence"):
            nll = rag_sequence_nll
        else:
            raise InvalidArgument(f"mode must be 'rag-token' or 'rag-sequence', got {mode!r}")
        b = self.backend
        target = b.tokenize_targets(list(targets))
        logits = b.target_logits(list(zip(questions, passages_per_question, strict=True)), target)
        return nll(
            logits,
            doc_scores.to(logits.device),
            target,
            b.pad_token_id,
            bos_token_id=b.bos_token_id,
            reduce_loss=reduce_loss,
            epsilon=epsilon,
            exclude_bos_score=exclude_bos_score,
        )
