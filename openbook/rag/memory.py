"""Peak working memory of a decoding batch, estimated from the model's shapes.

The generator admits work against a byte budget (``OPENBOOK_GENERATOR_MEMORY_MB``): a request
whose estimate alone exceeds it is refused before anything is allocated, and batches are packed
so that their estimate stays under it. The estimate is an upper bound of what decoding holds
beyond the weights, by design of the code paths it describes:

* **encode**: one prefill over ``rows_enc`` (request, passage) rows of ``prompt`` tokens. Only
  the last position goes through the LM head (``logits_to_keep=1``); what remains transient is
  the per-token activations and attention scores; what stays is the encoded key/value cache
  (causal: the shared prefix forked per row + the prompt; BART: cross-attention keys/values) and
  one float32 vocabulary row per encoded row (log p(y_1 | x, z)).
* **decode**: the cache forked per beam (``rows_dec = rows_enc x beams``) and grown by the answer
  (plus :data:`~openbook.rag.cache.GROWTH_SLOTS` spare slots per row: it grows in place), plus a
  few float32 distributions over the vocabulary per decoding row and step
  (:data:`LOGIT_COPIES`: the model's logits, their log-softmax, the mixture / beam scores).
* **score** (RAG-Sequence thorough, provenance): chunks of at most
  :data:`SCORE_LOGIT_ELEMENTS` logits (twice: logits and log-softmax) and their
  forked cache.
* **copies**: what the code holds twice for a moment. Joining caches (prefill groups into one
  encoded state, a new request into the running batch) and dropping rows (finished searches)
  build the new cache while the old one is alive, so the encoded and the decoded caches are
  each counted twice (:data:`CACHE_COPIES`), the decoded one with room: a running batch's
  buffers keep room for rows to join in place, up to
  :data:`~openbook.rag.cache.SPARE_SHARE` of what its rows take, and a copy made beside them
  up to :data:`~openbook.rag.cache.ROOM_SHARE`; and in bf16/fp16
  the model's own logits and the final soft-capping's temporary exist beside the float32
  copies, per decoding row and per scored element (:data:`MODEL_LOGIT_COPIES`).

Everything is summed (see :meth:`MemoryModel.batch_bytes` for why not the larger of prefill and
decode).

Each model family states its own :class:`MemoryModel` (``GeneratorBackend.memory_model``, from
its config, with the helpers at the end of this module) and the input lengths a request's shape
is measured from (``GeneratorBackend.input_lengths``); this module names no family.

Numbers for the default model are in docs/benchmarks.md; ``bench/load --real`` measures them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from transformers import PreTrainedModel

from openbook.rag import attention
from openbook.rag.cache import GROWTH_SLOTS, ROOM_SHARE, SPARE_SHARE
from openbook.rag.options import DecodingOptions
from openbook.types import Passage

if TYPE_CHECKING:  # the families import this module (they state their memory model with it)
    from openbook.rag.backends.base import GeneratorBackend

# Upper bound on logit elements (rows x positions x vocabulary) one teacher-forcing forward pass
# materialises: 2**24 float32 = 64 MiB, plus its log-softmax. With Gemma's 262k vocabulary a
# whole-sequence forward of a few rows would otherwise hold gigabytes. The families read it
# through ``openbook.rag.backends.base`` at call time, so one setting bounds them all.
SCORE_LOGIT_ELEMENTS = 1 << 24

# float32 distributions over the vocabulary alive per decoding row during one step.
LOGIT_COPIES = 4
# Reduced precision: distributions over the vocabulary in the model's dtype beside those (its
# logits, and the temporary of Gemma's final logit soft-capping); float32 models count them in
# LOGIT_COPIES already.
MODEL_LOGIT_COPIES = 2
# A cache is copied whole when rows join or leave it (cache.join_rows, cache.select_rows): the
# old one is freed only once the new one is built.
CACHE_COPIES = 2
_F32 = 4


@dataclass(frozen=True)
class RequestShape:
    """What decides one request's memory: its rows and their lengths (all in tokens)."""

    passages: int  # k: encoded rows
    beams: int  # decoding rows per passage
    prompt_tokens: int  # longest per-passage input: causal prompt after the prefix / BART encoder
    new_tokens: int  # max_new_tokens
    # every passage input together (what the model reads; reported as a request's usage)
    input_tokens: int = 0
    # of those, the tokens a passage cache held when the request was measured: its prefill
    # will not compute them if they are still there (the generator's admission plans with it)
    cached_tokens: int = 0

    @property
    def rows(self) -> int:
        return self.passages * self.beams


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per unit of work for one loaded generator (see the module docstring)."""

    vocab: int
    prefix_tokens: int  # causal: shared prefix forked into every row; BART: 0
    kv_bytes_per_token: int  # decoder self-attention keys + values, all layers, one token
    cross_bytes_per_token: int  # BART: cross-attention keys + values per encoder token; causal: 0
    activation_bytes_per_token: int  # transient per prefilled token inside one layer
    score_bytes_per_pair: int  # attention scores, all heads, per (query, key) pair in prefill
    shared_cross: bool  # BART fast path: beams share the encoded row's cross keys/values
    mask_bytes_per_pair: int = 0  # causal: the attention masks built for the prefill
    # The most attention-score bytes alive at once when the attention works in bounded chunks
    # (openbook/rag/attention.py); 0: all of them at once.
    score_bytes_cap: int = 0
    # reduced precision: bytes of one logit in the model's dtype (0: float32, in LOGIT_COPIES)
    model_logit_bytes: int = 0
    # tokens drafted per step (openbook/rag/drafting.py): a drafted step feeds 1 + draft_tokens
    # positions per decoding row and holds the logits of all of them, or, where the family
    # runs the LM head only over the positions read (head_deferred), of two at most: the one
    # read and the one before it, which the search keeps until the next
    draft_tokens: int = 0
    head_deferred: bool = False
    # bytes per logit an int8 LM head holds while it computes them, beside its output (its
    # product's float32 pieces, the rescoring's bounds and mask: Int8Head.transient_bytes_per_logit)
    head_logit_bytes: int = 0

    @property
    def drafted_logit_positions(self) -> int:
        """Positions per decoding row whose logits one step holds at once."""
        return min(2, 1 + self.draft_tokens) if self.head_deferred else 1 + self.draft_tokens

    def batch_bytes(self, shapes: Sequence[RequestShape]) -> int:
        """Estimated peak bytes of decoding ``shapes`` as one batch (prompts padded to the
        longest, as the backends do)."""
        if not shapes:
            return 0
        rows_enc = sum(s.passages for s in shapes)
        rows_dec = sum(s.rows for s in shapes)
        prompt = max(s.prompt_tokens for s in shapes)
        new = max(s.new_tokens for s in shapes)
        context = self.prefix_tokens + prompt  # keys each prompt token attends to at most
        pairs = rows_enc * prompt * context
        scores = pairs * self.score_bytes_per_pair
        if self.score_bytes_cap:  # a chunk holds one query position of every row at least
            one_query = rows_enc * context * self.score_bytes_per_pair
            scores = min(scores, max(self.score_bytes_cap, one_query))
        prefill = (
            rows_enc * prompt * self.activation_bytes_per_token
            + pairs * self.mask_bytes_per_pair
            + scores
        )
        logit_bytes = (
            _F32 * LOGIT_COPIES
            + self.model_logit_bytes * MODEL_LOGIT_COPIES
            + self.head_logit_bytes
        )
        encoded = rows_enc * (
            CACHE_COPIES * context * self.kv_bytes_per_token
            + prompt * self.cross_bytes_per_token
            + self.vocab * _F32
        )
        cross_rows = rows_enc if self.shared_cross else rows_dec
        decoded = (
            math.ceil(
                (CACHE_COPIES + SPARE_SHARE + ROOM_SHARE)
                * rows_dec
                * (context + new + GROWTH_SLOTS)
                * self.kv_bytes_per_token
            )
            + cross_rows * prompt * self.cross_bytes_per_token
            + rows_dec * self.drafted_logit_positions * self.vocab * logit_bytes
        )
        # Teacher-forced scoring: a chunk's logits and log-softmax, and its forked cache. At most
        # every decoded hypothesis is scored under every passage of its request.
        scored_rows = sum(s.rows * s.passages for s in shapes)
        chunk_elements = min(SCORE_LOGIT_ELEMENTS, scored_rows * new * self.vocab)
        chunk_rows = max(1, chunk_elements // max(1, new * self.vocab))
        scoring = (
            chunk_elements
            * (2 * _F32 + self.model_logit_bytes * MODEL_LOGIT_COPIES + self.head_logit_bytes)
            + chunk_rows * (context + new) * self.kv_bytes_per_token
        )
        # Summed, not the larger of prefill and decode: the prefill's activations are freed
        # before decoding grows, but the allocator may keep those pages resident (glibc keeps
        # freed blocks below its mmap threshold), and a bound must not depend on the allocator.
        return encoded + prefill + decoded + scoring


def memory_model(backend: GeneratorBackend) -> MemoryModel:
    """The :class:`MemoryModel` of a loaded backend: its family states it
    (:meth:`GeneratorBackend.memory_model`), from its config and parameter dtype."""
    return backend.memory_model()


# ------------------------------------------------------------------ what the families share
# Each family builds its MemoryModel from its own config (GeneratorBackend.memory_model) with
# these: what depends on the dtype and the attention, not on the family.


def parameter_bytes(model: PreTrainedModel) -> int:
    """Bytes of one of ``model``'s parameters (its dtype's element size)."""
    return next(model.parameters()).element_size()


def model_logit_bytes(elt: int) -> int:
    """Bytes of a logit in the model's dtype where it is not float32 (module docstring)."""
    return 0 if elt >= _F32 else elt


def _matmul_attention(model: PreTrainedModel) -> bool:
    return getattr(model.config, "_attn_implementation", None) == attention.NAME


def score_bytes(model: PreTrainedModel, elt: int) -> int:
    """Prefill attention bytes per (query, key) pair and head: a score and its softmax, or the
    matmul attention's float32 passes (openbook/rag/attention.py)."""
    return attention.MATMUL_SCORE_BYTES if _matmul_attention(model) else 2 * elt


def score_bytes_cap(model: PreTrainedModel) -> int:
    """The matmul attention's scores of one query chunk (float32) and their other copies."""
    if not _matmul_attention(model):
        return 0
    return attention.MAX_SCORE_BYTES * attention.MATMUL_SCORE_BYTES // 4


def measuring_twin(backend: GeneratorBackend) -> GeneratorBackend:
    """A copy of ``backend`` that shares its model but owns copies of its tokenizers.

    Requests are measured (:func:`request_shape`) in the service's request threads while a batch
    tokenises in the batch thread, and a Hugging Face fast tokenizer is not thread-safe: every
    call sets the shared Rust tokenizer's padding and truncation, so a measurement running
    beside a batch's padded call could leave the batch's tensors unpadded. The twin's tokenizers
    are its own; use it from one thread at a time (one twin per generator, under a lock).
    """
    return backend.measuring_twin()


def request_shape(
    backend: GeneratorBackend,
    question: str,
    passages: Sequence[Passage],
    options: DecodingOptions,
) -> RequestShape:
    """Tokenise the request's passage inputs (nothing else) to get its :class:`RequestShape`.

    ``backend`` is a :func:`measuring_twin` when this runs beside decoding in another thread."""
    lengths = backend.input_lengths(question, passages)
    return RequestShape(
        passages=len(passages),
        beams=options.rows_per_passage,  # beams, or samples
        prompt_tokens=max(lengths, default=1),
        new_tokens=options.max_new_tokens,
        input_tokens=sum(lengths),
        cached_tokens=backend.cached_input_tokens(question, passages),
    )


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:,.0f} MiB"
