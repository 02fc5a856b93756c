"""The generator back-end interface every model family implements, and what families share.

Every family gives p(y_i | x, z, y_<i) for a batch of (request, passage) rows through the small
interface of :class:`GeneratorBackend`:

* :meth:`~GeneratorBackend.encode` runs the expensive per-passage part ONCE (the encoder plus the
  decoder-start step, or the prompt prefill on top of the shared prefix cache) and returns the
  family's :class:`Encoded` state: its key/value caches and log p(y_1 | x, z);
* :meth:`~GeneratorBackend.start` forks that into ``copies`` decoding rows per passage (beams), the
  family's :class:`DecodeState`; :meth:`~GeneratorBackend.step` feeds one token per row;
  :meth:`~GeneratorBackend.reorder` follows beam search's row permutation;
* :meth:`~GeneratorBackend.score` teacher-forces whole candidate sequences, again reusing the
  encoded state; :meth:`~GeneratorBackend.target_logits` gives differentiable training logits.

Each family also states what the code around decoding must know about it, so that nothing
outside ``backends/`` tests which family it holds: its memory model
(:meth:`~GeneratorBackend.memory_model`, :mod:`openbook.rag.memory`) and its inputs' lengths
(:meth:`~GeneratorBackend.input_lengths`), a copy to measure requests with in another thread
(:meth:`~GeneratorBackend.measuring_twin`), and its capabilities: :attr:`joins_running`,
:meth:`drafts`, :meth:`concats_encoded`, :attr:`prompted` (with :attr:`answer_prefix` and
:meth:`stop_strings`).

Invariants every family keeps: rows are always ordered (request, passage slot[, copy]); requests
with fewer passages than the batch's slot count are padded by repeating a passage (callers give
such slots a log prior of -inf); a state is only ever handed back to the backend that made it.
Shapes: n requests, k passage slots, R = n*k encoded rows, N = R*copies decoding rows, V vocabulary.

The families live beside this module, one each (``seq2seq.py``, ``bart.py``, ``causal.py``);
``registry.py`` picks the encoder-decoder family for a model. Adding a model family: see
``README.md`` in ``openbook/rag``.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Self, TypeVar, cast

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from openbook.rag.backends.int8_head import RESCORE_MARGIN
from openbook.rag.errors import ModelLoadError

# SCORE_LOGIT_ELEMENTS: the bound on logit elements one teacher-forcing pass materialises
# (defined with the memory estimate that counts it). The families read it through this module
# at call time, so one setting bounds them all.
from openbook.rag.memory import SCORE_LOGIT_ELEMENTS as SCORE_LOGIT_ELEMENTS
from openbook.rag.memory import MemoryModel
from openbook.rag.packed_weights import Packing
from openbook.types import Passage

if TYPE_CHECKING:
    from openbook.rag.backends.int8_head import Int8Product

Items = Sequence[tuple[str, Sequence[Passage]]]  # (question, passages) per request


@dataclass
class Encoded:
    """What every family's encoded state holds: ``n`` requests x ``k`` passage slots.

    first_logprobs: (R, V) float32, log p(y_1 | x, z), rows ordered request-major.
    reused_tokens: prompt tokens whose keys/values came from a cache (a causal LM's passage
        cache) instead of being prefilled: what the prefill did not compute, which the
        generator's speed model must not count as work done.
    """

    n: int
    k: int
    first_logprobs: Tensor
    reused_tokens: int = field(default=0, kw_only=True)


@dataclass
class DecodeState:
    """Base of the families' live decoding rows (request, slot, copy); :meth:`step` grows them."""


class FedLogProbs:
    """The next-token log-probs after the tokens one :meth:`GeneratorBackend.step_many` fed:
    (N, L, V) float32, entry [r, i] after tokens[r, : i + 1], computed when asked.

    A drafted step feeds the decided token and up to eight drafted ones, but the search reads
    position i only once it accepted every drafted token before i: most steps read one or two
    positions. The forward pass runs over all of them (it must, to fill the cache); the LM head
    (on Gemma a 262,144 x 640 product per row and position, the step's largest) runs only for
    the positions read. Positions are read in order, each once, for any subset of rows.
    """

    def __init__(self, hidden: Tensor, head: Callable[[Tensor], Tensor]) -> None:
        """hidden: (N, L, d) final hidden states; head: (n, d) -> (n, V) float32 log-probs."""
        # (N, L, d) hidden states, or (N, L, V) log-probs already computed (the head: identity)
        self._rows = hidden
        self._head = head

    @classmethod
    def computed(cls, log_probs: Tensor) -> FedLogProbs:
        """Log-probs (N, L, V) a family's forward already produced (no head left to defer)."""
        return cls(log_probs, lambda lp: lp)

    @classmethod
    def cat(cls, parts: Sequence[FedLogProbs]) -> FedLogProbs:
        """The rows of ``parts`` (one backend's, so one head) in one, in order: the head then
        runs once over all of them."""
        return cls(torch.cat([p._rows for p in parts]), parts[0]._head)

    def at(self, position: int, rows: Tensor | None = None) -> Tensor:
        """(n, V) float32: ``position``'s log-probs of ``rows`` (n,) (None: every row)."""
        at = self._rows[:, position]
        return self._head(at if rows is None else at[rows])


# The family's own states: what its encode returns is what its start / score take, what its start
# returns is what its step / reorder / join / keep take (the engine never mixes families).
EncodedT = TypeVar("EncodedT", bound=Encoded)
StateT = TypeVar("StateT", bound=DecodeState)


class GeneratorBackend(ABC, Generic[EncodedT, StateT]):
    """p(y_i | x, z, y_<i) from one model family (see the module docstring).

    Generic in the family's encoded state and decoding state; code that drives any family (the
    engine, the searches) holds a ``GeneratorBackend`` and hands back only the states it got.
    """

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    kind: str
    eos_token_id: int | None
    pad_token_id: int
    bos_token_id: int | None
    # Token placed before the answer in loss targets (BART: decoder_start_token_id); losses drop it.
    target_start_id: int

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def vocab_size(self) -> int:
        # nn.Linear and the int8 head (int8_head.py) both say their rows
        return int(self.model.get_output_embeddings().out_features)

    @abstractmethod
    def encode(self, items: Items, k: int) -> EncodedT:
        """Encode ``k`` passage slots of every request (short requests repeat their last one)."""

    @abstractmethod
    def start(self, enc: EncodedT, copies: int) -> StateT:
        """``copies`` decoding rows per encoded row: row ``r * copies + c`` reads encoded row r."""

    @abstractmethod
    def step(self, state: StateT, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (N,), one per row -> next-token log-probs (N, V) float32."""

    @abstractmethod
    def reorder(self, state: StateT, rows: Tensor) -> None:
        """Row i of ``state`` becomes its row ``rows[i]`` (N,) (beams move within their passage)."""

    def drafts(self) -> bool:
        """Whether :meth:`step_many` and :meth:`drop_fed` are implemented: the engine may then
        verify drafted tokens (:mod:`openbook.rag.drafting`) in one forward pass."""
        return False

    def quantize_head(
        self, product: Int8Product | None = None, margin: float | None = RESCORE_MARGIN
    ) -> None:
        """Serve the LM head with int8 weights, one scale per output row
        (:class:`~openbook.rag.backends.int8_head.Int8Head`, multiplying with ``product``,
        by default the faster kernel for the model's precision on this machine; the tokens
        within ``margin`` of a row's best scored again in full precision, None: not); a
        :class:`~openbook.rag.errors.ModelLoadError` (a ``ValueError``) saying why where this
        family, its head or its device cannot. The input embedding keeps its precision."""
        raise ModelLoadError(f"the {self.kind} backend keeps its LM head in the model's precision")

    def pack_weights(self, packing: Packing = Packing.AUTO) -> bool:
        """Reorder the model's linear weights once for this machine's kernels
        (:mod:`openbook.rag.packed_weights`; ``packing`` says for which precisions); whether any
        were. For inference only: :meth:`unpack_weights` before training, merging or saving."""
        return False

    def unpack_weights(self) -> bool:
        """Undo :meth:`pack_weights`: the model's own linear modules, with the same weights, are
        back; whether any were packed."""
        return False

    def defers_head(self) -> bool:
        """Whether :meth:`step_many` runs the LM head only over the positions read (its
        :class:`FedLogProbs` holds hidden states), so that a drafted step holds the logits of
        two positions per row at most, not of every fed one."""
        return False

    def step_many(self, state: StateT, tokens: Tensor) -> FedLogProbs:
        """Feed ``tokens`` (N, L), L consecutive tokens per row, in one forward pass -> their
        next-token log-probs (N, L, V), computed as read (:class:`FedLogProbs`): entry [r, i]
        after tokens[r, : i + 1], exactly what :meth:`step` would give fed them one at a time,
        to float tolerance."""
        raise NotImplementedError(f"{type(self).__name__} does not verify drafts")

    def drop_fed(self, state: StateT, fed: int, kept: Tensor) -> None:
        """After :meth:`step_many` fed ``fed`` tokens per row: row r keeps only the first
        ``kept[r]`` (N,) (>= 1) of them; the others (rejected drafts) leave its cache, as if
        they had never been fed."""
        raise NotImplementedError(f"{type(self).__name__} does not verify drafts")

    def draft_sources(self, question: str, passages: Sequence[Passage]) -> list[list[int]]:
        """Per passage, the token ids drafts are looked up in (:mod:`openbook.rag.drafting`):
        by default the passage's title and text as the tokenizer splits them."""
        out = []
        for p in passages:
            text = f"{p.title}\n{p.text}" if p.title else p.text
            out.append(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return out

    # Whether :meth:`join` accepts states that have decoded different numbers of tokens (the
    # decoding engine then admits new requests into a running batch between steps).
    joins_running: bool = True

    def concats_encoded(self) -> bool:
        """Whether :meth:`concat_encoded` joins separately encoded passages of one request, so
        that a large request's prefill can be split into chunks (:mod:`openbook.rag.engine`)."""
        return False

    def concat_encoded(self, parts: Sequence[Encoded]) -> Encoded:
        """One request's encoded state from ``parts``: the same request's passages encoded in
        consecutive slices (each ``n == 1``), in order. Every row is exactly the row a single
        :meth:`encode` of all the passages would have given (only padding differs, masked)."""
        raise NotImplementedError(f"{type(self).__name__} encodes a request's passages at once")

    @abstractmethod
    def join(self, states: Sequence[StateT]) -> StateT:
        """One state whose rows are the rows of ``states``, in order (caches left-padded to the
        longest; padding is masked). Every row decodes exactly as it would in its own state.
        ``states[0]`` is consumed (the result may be it, grown in place): the caller holds the
        result only."""

    @abstractmethod
    def keep(self, state: StateT, rows: Tensor) -> StateT:
        """The state of rows ``rows`` (ascending) only: the rows of finished searches leave.
        Whole passage groups (all copies of an encoded row) leave together. ``state`` is
        consumed (the result may be it, its rows moved in place): the caller holds the result
        only."""

    @abstractmethod
    def score(
        self, enc: EncodedT, rows: Tensor, seqs: Tensor, lengths: Sequence[int] | None = None
    ) -> Tensor:
        """Token log-probs (M, T) float32 of ``seqs`` (M, T) under encoded rows ``rows`` (M,).

        Entry t is log p(seqs[m, t] | x, z, seqs[m, :t]); padding positions (t >= lengths[m] when
        ``lengths`` is given) hold garbage the caller masks.
        """

    @abstractmethod
    def target_logits(self, items: Items, targets: Tensor) -> Tensor:
        """Generator logits for teacher forcing, differentiable, in transformers' RAG layout.

        items: n requests with exactly k passages each; targets: (n, T) starting with
        ``target_start_id``. Returns (n*k, T, V) where [r, t] predicts targets[r // k, t + 1].
        """

    @abstractmethod
    def tokenize_targets(self, answers: Sequence[str]) -> Tensor:
        """(n, T) loss targets: ``target_start_id``, answer tokens, EOS; right-padded."""

    # Whether answers continue a text prompt (a decoder-only LM): the answer then follows
    # :attr:`answer_prefix` and decoding stops at :meth:`stop_strings` and at the generation
    # config's extra EOS ids (:class:`~openbook.rag.generator.RagGenerator`).
    prompted: bool = False

    @property
    def answer_prefix(self) -> str:
        """Text the prompt puts before every answer, cut from decoded answers ("": none)."""
        return ""

    def stop_strings(self) -> list[str]:
        """Strings at which decoding cuts an answer (prompted families; none by default)."""
        return []

    # ---------------------------------------------------------------- memory

    @abstractmethod
    def memory_model(self) -> MemoryModel:
        """The family's :class:`~openbook.rag.memory.MemoryModel`: bytes per unit of decoding
        work of this model, from its config and parameter dtype (:mod:`openbook.rag.memory`)."""

    @abstractmethod
    def input_lengths(self, question: str, passages: Sequence[Passage]) -> list[int]:
        """Tokens of each passage's input as this family builds it (what a request's
        :class:`~openbook.rag.memory.RequestShape` is measured from); tokenises, nothing more."""

    def cached_input_tokens(self, question: str, passages: Sequence[Passage]) -> int:
        """Of those tokens, how many a prefill would take from a cache kept across requests
        instead of computing (none, for a family that keeps nothing across requests)."""
        return 0

    def measuring_twin(self) -> Self:
        """A copy sharing the model but owning copies of the tokenizers, to measure requests
        (:meth:`input_lengths`) in another thread while a batch tokenises in its own (a fast
        tokenizer is not thread-safe: :func:`openbook.rag.memory.measuring_twin`)."""
        twin = copy.copy(self)
        twin.tokenizer = copy.deepcopy(self.tokenizer)
        return twin

    def refresh(self) -> None:
        """Rebuild state derived from the weights (call after they change); none by default."""
        return None

    def set_passage_cache(self, max_bytes: int) -> None:
        """Bound the keys/values of passage prompts kept across requests (0: keep none). A
        family that reuses nothing across requests ignores it."""
        return None

    def clear_passage_cache(self) -> None:
        """Drop the passage keys/values kept across requests (those of passages nobody will
        ask about again, e.g. a speed calibration's); none by default."""
        return None

    def decode(self, token_ids: Sequence[int]) -> str:
        return decode_text(self.tokenizer, token_ids, skip_special_tokens=True)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [decode_text(self.tokenizer, [t]) for t in token_ids]


# ------------------------------------------------------------------ helpers the families share


def log_softmax(logits: Tensor) -> Tensor:
    """float32 log-probabilities over the last axis (logits may be bf16/fp16).

    On the CPU, reduced-precision logits are widened once and normalized in place in that
    copy: a step's (rows, V) float32 tensors are tens of MB (42 MB at 40 rows of Gemma 3's
    vocabulary), past the allocator's threshold, so each is a fresh mapping whose pages fault
    in; one instead of two took a 40-row step's log-softmax from 41 to 24 ms on the AMX Xeon
    (docs/benchmarks.md, "Rows joining and leaving the batch"). torch's CPU kernel writes each
    row after reading it, so in place it gives the same values bit for bit (tested)."""
    if logits.dtype == torch.float32 or logits.device.type != "cpu" or logits.requires_grad:
        return torch.log_softmax(logits.float(), dim=-1)  # (an out= op records no gradient)
    widened = logits.float()
    return torch._log_softmax(widened, -1, False, out=widened)


def decode_text(
    tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], skip_special_tokens: bool = False
) -> str:
    """The text of one token sequence. transformers annotates ``decode`` as ``str | list[str]``
    (it decodes a batch of sequences too); a flat list of ids always gives a ``str``."""
    return cast(str, tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))


def pad_slots(items: Items, k: int) -> list[tuple[str, Passage]]:
    """(question, passage) rows, k per request; short requests repeat their last passage."""
    rows: list[tuple[str, Passage]] = []
    for question, passages in items:
        ps = list(passages)
        rows.extend((question, ps[min(j, len(ps) - 1)]) for j in range(k))
    return rows


def copy_rows(enc: Encoded, copies: int) -> Tensor:
    """(R * copies,) the encoded row of every decoding row: 0,0,..,1,1,.. (``copies`` each)."""
    n_rows = enc.n * enc.k
    return torch.arange(n_rows, device=enc.first_logprobs.device).repeat_interleave(copies)


def first_id(*candidates: int | list[int] | tuple[int, ...] | None) -> int | None:
    """The first given token id among ``candidates`` (a list or tuple gives its first entry):
    configs and tokenizers disagree on which of them sets an id, and how."""
    for c in candidates:
        if isinstance(c, list | tuple):
            c = c[0] if c else None
        if c is not None:
            return int(c)
    return None


def right_pad(seqs: Sequence[Sequence[int]], pad: int) -> Tensor:
    """(len(seqs), longest) long tensor of ``seqs``, right-padded with ``pad``."""
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out
