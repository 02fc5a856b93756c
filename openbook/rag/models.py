"""Generator back-ends: one class per model family, each owning its typed decoding state.

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

Families:

* :class:`Seq2SeqBackend`: any transformers encoder-decoder (T5, mBART, ...) through the model's
  own forward, with :class:`Seq2SeqEncoded` / :class:`Seq2SeqDecodeState`;
* :class:`BartBackend`: ``BartForConditionalGeneration`` (plain BART and a RAG checkpoint's
  generator). At inference it decodes with :mod:`openbook.rag.bart` (cross-attention keys/values
  computed once per passage and shared by its beams, prefix-tree scoring) with
  :class:`BartEncoded` / :class:`BartDecodeState`; in training mode or with autograd on it is
  exactly :class:`Seq2SeqBackend`;
* :class:`CausalBackend`: decoder-only LMs (Gemma, Llama, ...) prompted per passage after a shared
  prefix whose cache is computed once, with :class:`CausalEncoded` / :class:`CausalDecodeState`.

Rows are always ordered (request, passage slot[, copy]). Requests with fewer passages than the
batch's slot count are padded by repeating a passage; callers give such slots a log prior of -inf.
Shapes: n requests, k passage slots, R = n*k encoded rows, N = R*copies decoding rows, V vocabulary.
Adding a model family: see ``README.md`` in this folder.
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutput

from openbook.rag import bart
from openbook.rag.cache import (
    broadcast_rows,
    drop_leading,
    growing,
    join_rows,
    reorder_self_attention,
    select_rows,
    share_rows,
)
from openbook.rag.passage_cache import HeadKV, PassageCache
from openbook.rag.prompting import PromptSpec, seq2seq_input
from openbook.types import Passage

# Upper bound on logit elements (rows x positions x vocabulary) one teacher-forcing forward pass
# materialises: 2**24 float32 = 64 MiB, plus its log-softmax. With Gemma's 262k vocabulary a
# whole-sequence forward of a few rows would otherwise hold gigabytes (see openbook/rag/memory.py).
SCORE_LOGIT_ELEMENTS = 1 << 24
# Keys/values of passage prompts a causal backend keeps across requests, by default
# (openbook/rag/passage_cache.py; the generator service sets OPENBOOK_GENERATOR_PASSAGE_CACHE_MB).
DEFAULT_PASSAGE_CACHE_BYTES = 256 * 2**20
# Sequences scored together as one prefix tree on the BART path (bounds the cache size).
_TREE_CHUNK_SEQS = 1024

Items = Sequence[tuple[str, Sequence[Passage]]]  # (question, passages) per request


@dataclass
class Encoded:
    """What every family's encoded state holds: ``n`` requests x ``k`` passage slots.

    first_logprobs: (R, V) float32, log p(y_1 | x, z), rows ordered request-major.
    """

    n: int
    k: int
    first_logprobs: Tensor


@dataclass
class DecodeState:
    """Base of the families' live decoding rows (request, slot, copy); :meth:`step` grows them."""


class GeneratorBackend(ABC):
    """p(y_i | x, z, y_<i) from one model family (see the module docstring)."""

    model: torch.nn.Module
    tokenizer: object
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
        return int(self.model.get_output_embeddings().weight.shape[0])

    @abstractmethod
    def encode(self, items: Items, k: int) -> Encoded:
        """Encode ``k`` passage slots of every request (short requests repeat their last one)."""

    @abstractmethod
    def start(self, enc: Encoded, copies: int) -> DecodeState:
        """``copies`` decoding rows per encoded row: row ``r * copies + c`` reads encoded row r."""

    @abstractmethod
    def step(self, state: DecodeState, tokens: Tensor) -> Tensor:
        """Feed ``tokens`` (N,), one per row -> next-token log-probs (N, V) float32."""

    @abstractmethod
    def reorder(self, state: DecodeState, rows: Tensor) -> None:
        """Row i of ``state`` becomes its row ``rows[i]`` (N,) (beams move within their passage)."""

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
    def join(self, states: Sequence[DecodeState]) -> DecodeState:
        """One state whose rows are the rows of ``states``, in order (caches left-padded to the
        longest; padding is masked). Every row decodes exactly as it would in its own state."""

    @abstractmethod
    def keep(self, state: DecodeState, rows: Tensor) -> DecodeState:
        """The state of rows ``rows`` (ascending) only: the rows of finished searches leave.
        Whole passage groups (all copies of an encoded row) leave together."""

    @abstractmethod
    def score(
        self, enc: Encoded, rows: Tensor, seqs: Tensor, lengths: Sequence[int] | None = None
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

    def refresh(self) -> None:
        """Rebuild state derived from the weights (call after they change); none by default."""
        return None

    def set_passage_cache(self, max_bytes: int) -> None:
        """Bound the keys/values of passage prompts kept across requests (0: keep none). A
        family that reuses nothing across requests ignores it."""
        return None

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def token_strings(self, token_ids: Sequence[int]) -> list[str]:
        return [self.tokenizer.decode([t]) for t in token_ids]


def _log_softmax(logits: Tensor) -> Tensor:
    return torch.log_softmax(logits.float(), dim=-1)


def _pad_slots(items: Items, k: int) -> list[tuple[str, Passage]]:
    """(question, passage) rows, k per request; short requests repeat their last passage."""
    rows: list[tuple[str, Passage]] = []
    for question, passages in items:
        ps = list(passages)
        rows.extend((question, ps[min(j, len(ps) - 1)]) for j in range(k))
    return rows


def _copy_rows(enc: Encoded, copies: int) -> Tensor:
    """(R * copies,) the encoded row of every decoding row: 0,0,..,1,1,.. (``copies`` each)."""
    n_rows = enc.n * enc.k
    return torch.arange(n_rows, device=enc.first_logprobs.device).repeat_interleave(copies)


# --------------------------------------------------------------------------- encoder-decoders


@dataclass
class Seq2SeqEncoded(Encoded):
    """Encoder-decoder state after the decoder-start step, through transformers' forward.

    hidden: (R, S, d) encoder output. mask: (R, S) encoder attention mask.
    cache: transformers' encoder-decoder cache, R rows (self-attention: the start token).
    """

    hidden: Tensor
    mask: Tensor
    cache: Cache


@dataclass
class Seq2SeqDecodeState(DecodeState):
    """N decoding rows: hidden (N, S, d), mask (N, S) and cache copied per row."""

    hidden: Tensor
    mask: Tensor
    cache: Cache


class Seq2SeqBackend(GeneratorBackend):
    """Encoder-decoder generator; input formatted like transformers' ``RagRetriever``.

    This class runs any transformers encoder-decoder through its own forward; a family with a
    faster path of its own subclasses it (:class:`BartBackend`). :func:`seq2seq_backend` picks
    the family for a model.
    """

    kind = "bart"

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        """Whether this family runs ``model`` (the generic class runs every encoder-decoder)."""
        return True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        *,
        prefix: str | None = None,
        title_sep: str = " / ",
        doc_sep: str = " // ",
        max_combined_length: int = 300,
        question_tokenizer=None,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        # A RAG checkpoint's question-encoder tokenizer: the question the generator reads is this
        # tokenizer's decoding of it, as ``RagRetriever`` builds it (see :meth:`question_text`).
        self.question_tokenizer = question_tokenizer
        cfg = model.config
        self.prefix = prefix
        self.title_sep = title_sep
        self.doc_sep = doc_sep
        self.max_combined_length = max_combined_length
        self.decoder_start_token_id = int(cfg.decoder_start_token_id)
        self.target_start_id = self.decoder_start_token_id
        self.eos_token_id = _first_id(cfg.eos_token_id, tokenizer.eos_token_id)
        self.bos_token_id = _first_id(cfg.bos_token_id, tokenizer.bos_token_id)
        self.pad_token_id = int(_first_id(cfg.pad_token_id, tokenizer.pad_token_id, 0))

    # ---------------------------------------------------------------- input

    def question_text(self, question: str) -> str:
        """The question as the generator reads it.

        For a RAG checkpoint, transformers' ``RagRetriever`` joins each passage not to the question
        as typed but to the question-encoder tokenizer's decoding of its input ids
        (``skip_special_tokens=True``): lower-cased and re-spaced for an uncased BERT/DPR
        tokenizer. Other generators read the question unchanged.
        """
        tok = self.question_tokenizer
        if tok is None:
            return question
        limit = min(int(getattr(tok, "model_max_length", 512) or 512), 512)
        ids = tok(question, truncation=True, max_length=limit)["input_ids"]
        return tok.decode(ids, skip_special_tokens=True)

    def input_strings(self, rows: Sequence[tuple[str, Passage]]) -> list[str]:
        decoded: dict[str, str] = {}
        out = []
        for q, p in rows:
            if q not in decoded:
                decoded[q] = self.question_text(q)
            out.append(
                seq2seq_input(
                    p.title, p.text, decoded[q], self.prefix, self.title_sep, self.doc_sep
                )
            )
        return out

    def _tokenize_inputs(self, rows: Sequence[tuple[str, Passage]]) -> tuple[Tensor, Tensor]:
        """Encoder input ids and attention mask, (rows, S) each, right-padded."""
        batch = self.tokenizer(
            self.input_strings(rows),
            max_length=self.max_combined_length,
            truncation=True,
            padding=True,
            return_tensors="pt",
        )
        return batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)

    def _encoder_output(self, items: Items, k: int) -> tuple[Tensor, Tensor]:
        """Encoder output (R, S, d) and attention mask (R, S) of every (request, slot) row."""
        ids, mask = self._tokenize_inputs(_pad_slots(items, k))
        hidden = self.model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        return hidden, mask

    # ---------------------------------------------------------------- decoding

    def encode(self, items: Items, k: int) -> Seq2SeqEncoded:
        hidden, mask = self._encoder_output(items, k)
        start = torch.full((hidden.shape[0], 1), self.decoder_start_token_id, device=mask.device)
        out = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=hidden),
            attention_mask=mask,
            decoder_input_ids=start,
            use_cache=True,
        )
        first = _log_softmax(out.logits[:, -1])
        return Seq2SeqEncoded(len(items), k, first, hidden, mask, out.past_key_values)

    def start(self, enc: Seq2SeqEncoded, copies: int) -> Seq2SeqDecodeState:
        rows = _copy_rows(enc, copies)
        return Seq2SeqDecodeState(enc.hidden[rows], enc.mask[rows], select_rows(enc.cache, rows))

    def step(self, state: Seq2SeqDecodeState, tokens: Tensor) -> Tensor:
        out = self.model(
            encoder_outputs=BaseModelOutput(last_hidden_state=state.hidden),
            attention_mask=state.mask,
            decoder_input_ids=tokens[:, None],
            past_key_values=state.cache,
            use_cache=True,
        )
        state.cache = out.past_key_values
        return _log_softmax(out.logits[:, -1])

    def reorder(self, state: Seq2SeqDecodeState, rows: Tensor) -> None:
        # beams stay within their passage: encoder output, mask and cross-attention are unchanged
        reorder_self_attention(state.cache, rows)

    # transformers' decoder cache has no per-row padding: only states at the same step join
    joins_running = False

    def join(self, states: Sequence[Seq2SeqDecodeState]) -> Seq2SeqDecodeState:
        if len(states) == 1:
            return states[0]
        lengths = {s.cache.get_seq_length() for s in states}
        widths = {s.hidden.shape[1] for s in states}
        if len(lengths) != 1 or len(widths) != 1:
            raise ValueError("Seq2SeqBackend joins only states of equal decoder and encoder length")
        return Seq2SeqDecodeState(
            torch.cat([s.hidden for s in states]),
            torch.cat([s.mask for s in states]),
            join_rows([s.cache for s in states]),
        )

    def keep(self, state: Seq2SeqDecodeState, rows: Tensor) -> Seq2SeqDecodeState:
        return Seq2SeqDecodeState(
            state.hidden[rows], state.mask[rows], select_rows(state.cache, rows)
        )

    def score(
        self,
        enc: Seq2SeqEncoded,
        rows: Tensor,
        seqs: Tensor,
        lengths: Sequence[int] | None = None,
    ) -> Tensor:
        """Teacher forcing in chunks of rows whose logits stay within
        :data:`SCORE_LOGIT_ELEMENTS` (at least one row per chunk)."""
        n_rows, length = seqs.shape
        out = torch.empty(n_rows, length, dtype=torch.float32, device=seqs.device)
        chunk = max(1, SCORE_LOGIT_ELEMENTS // max(1, (length - 1) * self.vocab_size))
        for lo in range(0, n_rows, chunk):
            r = rows[lo : lo + chunk]
            s = seqs[lo : lo + chunk]
            out[lo : lo + chunk, 0] = enc.first_logprobs[r].gather(1, s[:, :1]).squeeze(1)
            if length > 1:
                logits = self.model(
                    encoder_outputs=BaseModelOutput(last_hidden_state=enc.hidden[r]),
                    attention_mask=enc.mask[r],
                    decoder_input_ids=s[:, :-1],
                    past_key_values=select_rows(enc.cache, r),
                    use_cache=True,
                ).logits
                lp = _log_softmax(logits)
                out[lo : lo + chunk, 1:] = lp.gather(2, s[:, 1:, None]).squeeze(2)
        return out

    # ---------------------------------------------------------------- training

    def target_logits(self, items: Items, targets: Tensor) -> Tensor:
        k = len(items[0][1])
        ids, mask = self._tokenize_inputs(_pad_slots(items, k))
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            decoder_input_ids=targets.to(ids.device).repeat_interleave(k, dim=0),
            use_cache=False,
        ).logits

    def tokenize_targets(self, answers: Sequence[str]) -> Tensor:
        enc = self.tokenizer(text_target=list(answers), padding=False, truncation=False)
        seqs = [[self.decoder_start_token_id, *ids] for ids in enc["input_ids"]]
        return _right_pad(seqs, self.pad_token_id).to(self.device)


@dataclass
class BartEncoded(Encoded):
    """BART state after the decoder-start step, from :mod:`openbook.rag.bart`.

    mask: (R, S) encoder attention mask.
    cross: per decoder layer, cross-attention keys and values (R, H, S, dh), computed once per row
        and shared by every beam / scored candidate of that row.
    cross_mask: (R, S) bool (True = attend), None when no row is padded.
    cache: per decoder layer, self-attention keys and values of the start token (R, H, 1, dh).
    """

    mask: Tensor
    cross: bart.KV
    cross_mask: Tensor | None
    cache: bart.KV


@dataclass
class BartDecodeState(DecodeState):
    """N decoding rows in cross-attention segments (:class:`openbook.rag.bart.CrossSegment`): the
    rows of one :meth:`BartBackend.start` form one segment, whose rows ``r * copies + c`` read
    encoded row r's cross keys/values; :meth:`BartBackend.join` concatenates segments.

    cache: per decoder layer, self-attention keys and values (N, H, L, dh), left-padded when rows
    started at different steps (the decoder-start token first). self_mask: (N, L) bool, True
    for real slots; None when no row is padded. positions: (N,) decoder position of each row's
    next token (1 + answer tokens so far).
    """

    segments: list[bart.CrossSegment]
    cache: bart.KV
    self_mask: Tensor | None
    positions: Tensor


class BartBackend(Seq2SeqBackend):
    """``BartForConditionalGeneration``, decoded by :mod:`openbook.rag.bart` at inference.

    :mod:`openbook.rag.bart` reproduces BART's eval-mode forward without autograd; in training mode
    (dropout) or with autograd on, :meth:`encode` returns the generic :class:`Seq2SeqEncoded` and
    every method continues as :class:`Seq2SeqBackend` does. Training logits
    (:meth:`target_logits`) always come from transformers' forward.
    """

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        return bart.supports(model)

    def __init__(self, model: torch.nn.Module, tokenizer, **kwargs) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self._decoding = bart.BartDecoding(model)

    def _decodes_itself(self) -> bool:
        return not (self.model.training or torch.is_grad_enabled())

    def encode(self, items: Items, k: int) -> BartEncoded | Seq2SeqEncoded:
        if not self._decodes_itself():
            return super().encode(items, k)
        hidden, mask = self._encoder_output(items, k)
        cross = self._decoding.cross_kv(hidden)
        # transformers drops an all-ones encoder mask as well
        cross_mask = None if bool(mask.all()) else mask.bool()
        start = torch.full((hidden.shape[0],), self.decoder_start_token_id, device=mask.device)
        zero = torch.zeros_like(start)
        segment = bart.CrossSegment(1, cross, cross_mask)
        h, cache = self._decoding.step(start, zero, None, None, [segment])
        first = self._decoding.log_probs(h)
        return BartEncoded(len(items), k, first, mask, cross, cross_mask, cache)

    def concats_encoded(self) -> bool:
        return self._decodes_itself()

    def concat_encoded(self, parts: Sequence[Encoded]) -> BartEncoded:
        """Encoder rows are right-padded (:meth:`_tokenize_inputs`): each part's encoder length
        S_i is padded to the longest, its cross keys/values with zeros that the mask hides."""
        encoded = [p for p in parts if isinstance(p, BartEncoded)]
        if len(encoded) != len(parts):
            raise NotImplementedError("only BART's own decoding state concatenates")
        if len(encoded) == 1:
            return encoded[0]
        width = max(p.mask.shape[1] for p in encoded)

        def right(t: Tensor, dim: int) -> Tensor:  # pad dimension ``dim`` up to ``width``
            missing = width - t.shape[dim]
            if not missing:
                return t
            pad = [0, 0] * (t.dim() - 1 - dim) + [0, missing]
            return F.pad(t, pad)

        mask = torch.cat([right(p.mask, 1) for p in encoded])
        cross = [
            (
                torch.cat([right(p.cross[i][0], 2) for p in encoded]),
                torch.cat([right(p.cross[i][1], 2) for p in encoded]),
            )
            for i in range(len(encoded[0].cross))
        ]
        cache = [
            (
                torch.cat([p.cache[i][0] for p in encoded]),
                torch.cat([p.cache[i][1] for p in encoded]),
            )
            for i in range(len(encoded[0].cache))
        ]
        first = torch.cat([p.first_logprobs for p in encoded])
        cross_mask = None if bool(mask.all()) else mask.bool()
        k = sum(p.k for p in encoded)
        return BartEncoded(1, k, first, mask, cross, cross_mask, cache)

    def start(
        self, enc: BartEncoded | Seq2SeqEncoded, copies: int
    ) -> BartDecodeState | Seq2SeqDecodeState:
        if not isinstance(enc, BartEncoded):
            return super().start(enc, copies)
        rows = _copy_rows(enc, copies)
        cache = [(k[rows], v[rows]) for k, v in enc.cache]
        segment = bart.CrossSegment(copies, enc.cross, enc.cross_mask)
        positions = torch.ones(rows.shape[0], dtype=torch.long, device=rows.device)
        return BartDecodeState([segment], cache, None, positions)

    def step(self, state: BartDecodeState | Seq2SeqDecodeState, tokens: Tensor) -> Tensor:
        if not isinstance(state, BartDecodeState):
            return super().step(state, tokens)
        h, state.cache = self._decoding.step(
            tokens, state.positions, state.cache, state.self_mask, state.segments
        )
        state.positions = state.positions + 1
        if state.self_mask is not None:
            own = torch.ones_like(state.self_mask[:, :1])
            state.self_mask = torch.cat([state.self_mask, own], dim=1)
        return self._decoding.log_probs(h)

    def reorder(self, state: BartDecodeState | Seq2SeqDecodeState, rows: Tensor) -> None:
        if not isinstance(state, BartDecodeState):
            return super().reorder(state, rows)
        # beams stay within their passage: segments, mask and positions are unchanged
        state.cache = [(k[rows], v[rows]) for k, v in state.cache]

    joins_running = True

    def join(
        self, states: Sequence[BartDecodeState | Seq2SeqDecodeState]
    ) -> BartDecodeState | Seq2SeqDecodeState:
        if len(states) == 1:
            return states[0]
        if not all(isinstance(s, BartDecodeState) for s in states):
            return super().join(states)
        widths = [s.cache[0][0].shape[2] for s in states]
        width = max(widths)
        cache = [
            (
                torch.cat(
                    [
                        F.pad(s.cache[i][0], (0, 0, width - w, 0))
                        for s, w in zip(states, widths, strict=True)
                    ]
                ),
                torch.cat(
                    [
                        F.pad(s.cache[i][1], (0, 0, width - w, 0))
                        for s, w in zip(states, widths, strict=True)
                    ]
                ),
            )
            for i in range(len(states[0].cache))
        ]
        self_mask = None
        if any(s.self_mask is not None for s in states) or len(set(widths)) > 1:
            masks = []
            for s, w in zip(states, widths, strict=True):
                m = s.self_mask
                if m is None:
                    m = torch.ones(
                        s.positions.shape[0], w, dtype=torch.bool, device=s.positions.device
                    )
                masks.append(F.pad(m, (width - w, 0), value=False))
            self_mask = torch.cat(masks)
        segments = [seg for s in states for seg in s.segments]
        positions = torch.cat([s.positions for s in states])
        return BartDecodeState(segments, cache, self_mask, positions)

    def keep(
        self, state: BartDecodeState | Seq2SeqDecodeState, rows: Tensor
    ) -> BartDecodeState | Seq2SeqDecodeState:
        if not isinstance(state, BartDecodeState):
            return super().keep(state, rows)
        kept = rows.tolist()
        segments: list[bart.CrossSegment] = []
        at = 0
        for seg in state.segments:
            mine = [r - at for r in kept if at <= r < at + seg.rows]
            at += seg.rows
            if not mine:
                continue
            passages = sorted({r // seg.copies for r in mine})
            if len(passages) * seg.copies != len(mine):
                raise ValueError("keep: a passage row's copies must leave together")
            idx = torch.tensor(passages, device=rows.device)
            cross = [(k[idx], v[idx]) for k, v in seg.cross]
            mask = None if seg.mask is None else seg.mask[idx]
            segments.append(bart.CrossSegment(seg.copies, cross, mask))
        cache = [(k[rows], v[rows]) for k, v in state.cache]
        positions = state.positions[rows]
        self_mask = None if state.self_mask is None else state.self_mask[rows]
        if self_mask is not None:
            lead = int(self_mask.any(dim=0).long().argmax())
            cache = [(k[:, :, lead:], v[:, :, lead:]) for k, v in cache]
            self_mask = self_mask[:, lead:]
            if bool(self_mask.all()):
                self_mask = None
        return BartDecodeState(segments, cache, self_mask, positions)

    def score(
        self,
        enc: BartEncoded | Seq2SeqEncoded,
        rows: Tensor,
        seqs: Tensor,
        lengths: Sequence[int] | None = None,
    ) -> Tensor:
        """Teacher forcing as one decoder pass over a prefix tree.

        Candidates scored under one passage share prefixes (beams of one search differ in a few
        tokens, every candidate of a request is scored under each of its passages), so every
        distinct (passage row, prefix) is decoded once, attending to its ancestors only.
        """
        if not isinstance(enc, BartEncoded):
            return super().score(enc, rows, seqs, lengths)
        n_seqs, width = seqs.shape
        out = torch.zeros(n_seqs, width, dtype=torch.float32, device=seqs.device)
        if n_seqs == 0 or width == 0:
            return out
        out[:, 0] = enc.first_logprobs[rows].gather(1, seqs[:, :1]).squeeze(1)
        seq_l = seqs.tolist()
        row_l = rows.tolist()
        len_l = [width] * n_seqs if lengths is None else [min(int(x), width) for x in lengths]
        for lo in range(0, n_seqs, _TREE_CHUNK_SEQS):
            hi = lo + _TREE_CHUNK_SEQS
            self._score_tree_chunk(enc, row_l[lo:hi], seq_l[lo:hi], len_l[lo:hi], out[lo:hi])
        return out

    def _score_tree_chunk(
        self,
        enc: BartEncoded,
        row_l: list[int],
        seq_l: list[list[int]],
        len_l: list[int],
        out: Tensor,
    ) -> None:
        n_rows = enc.n * enc.k
        index: dict[tuple[int, int], int] = {}  # (parent node or -1 - row, token) -> node
        tok: list[int] = []
        depth: list[int] = []
        parent: list[int] = []
        slot: list[int] = []  # position of the node within its passage row's sequence
        used = [0] * n_rows
        wanted: list[tuple[int, int, int, int]] = []  # (node, target token, sequence, position)
        for r, seq in enumerate(seq_l):
            row = row_l[r]
            cur = -1 - row
            for t in range(1, len_l[r]):
                key = (cur, seq[t - 1])
                j = index.get(key)
                if j is None:
                    j = index[key] = len(tok)
                    tok.append(key[1])
                    depth.append(t)
                    parent.append(cur)
                    slot.append(used[row])
                    used[row] += 1
                wanted.append((j, seq[t], r, t))
                cur = j
        if not tok:
            return
        width = max(used)
        dev = out.device
        node_row = [0] * len(tok)
        for j, p in enumerate(parent):
            node_row[j] = -1 - p if p < 0 else node_row[p]
        flat = [node_row[j] * width + slot[j] for j in range(len(tok))]
        # visibility: the decoder start (column 0), the node's ancestors and itself
        mask = torch.zeros(n_rows * width, 1 + width, dtype=torch.bool)
        mask[:, 0] = True
        by_depth: dict[int, list[int]] = {}
        for j, d in enumerate(depth):
            by_depth.setdefault(d, []).append(j)
        for d in sorted(by_depth):
            js = by_depth[d]
            f = torch.tensor([flat[j] for j in js])
            if d > 1:
                mask[f] = mask[torch.tensor([flat[parent[j]] for j in js])]
            mask[f, 1 + torch.tensor([slot[j] for j in js])] = True
        hidden = self._decoding.forward_tree(
            torch.tensor(tok, device=dev),
            torch.tensor(depth, device=dev),
            torch.tensor(flat, device=dev),
            width,
            mask.to(dev).view(n_rows, 1, width, 1 + width),
            enc.cache,
            enc.cross,
            enc.cross_mask,
        )
        w = torch.tensor(wanted, device=dev)
        out[w[:, 2], w[:, 3]] = self._decoding.gather_log_probs(hidden, w[:, 0], w[:, 1])


# Encoder-decoder families, most specific first: seq2seq_backend() builds the first whose
# ``supports(model)`` holds, else the generic Seq2SeqBackend.
SEQ2SEQ_FAMILIES: list[type[Seq2SeqBackend]] = [BartBackend]


def seq2seq_backend(model: torch.nn.Module, tokenizer, **options) -> Seq2SeqBackend:
    """The backend of the most specific registered family that runs ``model`` (``options``:
    :class:`Seq2SeqBackend`'s keyword arguments)."""
    family = next((f for f in SEQ2SEQ_FAMILIES if f.supports(model)), Seq2SeqBackend)
    return family(model, tokenizer, **options)


# --------------------------------------------------------------------------- decoder-only LMs


@dataclass
class CausalEncoded(Encoded):
    """Causal-LM state after the prompt prefill.

    cache: transformers cache of the shared prefix (P tokens, forked per row) and the left-padded
        passage prompt (L tokens): R rows of P + L slots.
    kv_pos: (R, P + L) position id of every cache slot, -1 for padding. The first answer token
        sits at kv_pos[:, -1] + 1 (prompts are left-padded: the last slot is always real).
    """

    cache: Cache
    kv_pos: Tensor


@dataclass
class CausalDecodeState(DecodeState):
    """N decoding rows: cache and kv_pos (N, P + L + t) after t answer tokens."""

    cache: Cache
    kv_pos: Tensor


class CausalBackend(GeneratorBackend):
    """Decoder-only LM prompted with ``prefix + passage_template`` per passage.

    The shared prefix is prefilled once (at construction / :meth:`refresh`) and its cache forked for
    every row. Passage prompts of different lengths are left-padded *after* the prefix; padding is
    masked out and position ids skip it, so every row sees exactly the positions of its unpadded
    prompt.

    The padding shifts cache indices, and transformers builds sliding-window masks (Gemma 2/3,
    ...) from cache indices, which would shrink the window of padded rows. For such models the
    attention masks are built here from position ids instead, and caches never drop old entries.
    For that, the states keep, per row, the position id of every cache slot (``kv_pos``, -1 for
    padding).
    """

    kind = "causal"

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        spec: PromptSpec,
        passage_cache_bytes: int = DEFAULT_PASSAGE_CACHE_BYTES,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        cfg = model.config
        self.eos_token_id = _first_id(tokenizer.eos_token_id, cfg.eos_token_id)
        self.bos_token_id = _first_id(tokenizer.bos_token_id, cfg.bos_token_id)
        pad = _first_id(tokenizer.pad_token_id, cfg.pad_token_id, self.eos_token_id, 0)
        self.pad_token_id = int(pad)
        self.target_start_id = self.pad_token_id
        layer_types = set(getattr(cfg, "layer_types", None) or [])
        window = getattr(cfg, "sliding_window", None)
        # Sliding-window size when some layers use one (masks built here, see the class doc).
        self.sliding_window: int | None = None
        self._layer_types: list[str] = []
        if window and "sliding_attention" in layer_types:
            if not layer_types <= {"full_attention", "sliding_attention"}:
                raise ValueError(f"unsupported attention layer types {sorted(layer_types)}")
            self.sliding_window = int(window)
            self._layer_types = sorted(layer_types)
        prefix_ids: list[int] = []
        if spec.prefix:
            prefix_ids = tokenizer(spec.prefix, add_special_tokens=False)["input_ids"]
        self._prefix_text_ids = list(prefix_ids)
        if spec.add_bos and self.bos_token_id is not None:
            prefix_ids = [self.bos_token_id, *prefix_ids]
        if not prefix_ids:
            raise ValueError(
                "openbook_prompt.json: the prompt prefix is empty and the tokenizer has no BOS "
                "token; at least one shared leading token is required"
            )
        self.prefix_ids = prefix_ids
        # The part of the passage template before the question: its keys/values depend on the
        # passage alone and are reused across requests (openbook/rag/passage_cache.py).
        self._head_template = _passage_head(spec.passage_template)
        self.passage_cache = PassageCache(passage_cache_bytes)
        # whether _head_logits reproduces the model's logits (set by refresh)
        self._own_head = False
        self.refresh()

    def set_passage_cache(self, max_bytes: int) -> None:
        self.passage_cache = PassageCache(max_bytes)

    def refresh(self) -> None:
        """Recompute the cached prefix keys/values (call after the weights change)."""
        with torch.no_grad():
            self.prefix_cache = self._prefix_forward(check_head=True)
        self.passage_cache.clear()  # keys/values of the old weights

    def _prefix_forward(self, check_head: bool = False) -> Cache:
        ids = torch.tensor([self.prefix_ids], device=self.device)
        # A config-less DynamicCache keeps every entry, even for sliding-window layers (class doc).
        cache = DynamicCache() if self.sliding_window else None
        # Only the cache is wanted: one position through the LM head, not the whole prefix.
        out = self.model(
            input_ids=ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
            output_hidden_states=check_head,
        )
        if check_head:
            mine = self._head_logits(out.hidden_states[-1][:, -1:]).float()
            self._own_head = bool(torch.allclose(mine, out.logits.float(), rtol=1e-4, atol=1e-4))
        return out.past_key_values

    def _head_logits(self, hidden: Tensor) -> Tensor:
        """The LM head over final hidden states (..., d) -> logits (..., V): the output
        embedding and, for Gemma 2/3, the final logit soft-capping. Used only where it was seen
        to reproduce the model's own logits (``_own_head``, checked on the prefix)."""
        logits = self.model.get_output_embeddings()(hidden)
        cap = getattr(self.model.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @property
    def prefix_len(self) -> int:
        return len(self.prefix_ids)

    # ---------------------------------------------------------------- input

    def prompt_ids(self, question: str, passage: Passage) -> list[int]:
        """Token ids of the passage part of the prompt, as they appear after the prefix."""
        return self._ids_after_prefix(
            self.spec.passage_prompt(passage.title, passage.text, question)
        )

    def _ids_after_prefix(self, text: str) -> list[int]:
        """Token ids of ``text`` as it appears after the prefix.

        The whole prompt is tokenised so that tokenizers which treat the start of a string
        specially (SentencePiece's dummy prefix) split it as the model saw it; when the prefix's
        tokens do not survive as a prefix of that (a merge across the boundary), ``text`` is
        tokenised on its own instead.
        """
        if self._prefix_text_ids:
            full = self.tokenizer(self.spec.prefix + text, add_special_tokens=False)["input_ids"]
            if full[: len(self._prefix_text_ids)] == self._prefix_text_ids:
                return full[len(self._prefix_text_ids) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def head_length(self, passage: Passage, ids: Sequence[int]) -> int:
        """How many leading tokens of a passage prompt ``ids`` depend on the passage alone: those
        of the template up to ``{question}``, when the prompt's tokens start with exactly them
        (a token merged across the boundary gives 0: nothing is reused). Always leaves one
        token at least to prefill."""
        if self._head_template is None:
            return 0
        try:
            text = self._head_template.format(title=passage.title, text=passage.text)
        except (KeyError, IndexError, ValueError):
            return 0
        head = self._ids_after_prefix(text)
        n = len(head)
        return n if 0 < n < len(ids) and list(ids[:n]) == head else 0

    def _prompt_batch(self, rows: Sequence[tuple[str, Passage]]) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded passage prompts of ``rows``: see :meth:`_prompt_tensors`."""
        return self._prompt_tensors([self.prompt_ids(q, p) for q, p in rows])

    def _prompt_tensors(self, prompts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded passage prompts right after the prefix: see :meth:`_tail_tensors`."""
        return self._tail_tensors(prompts, self._prefix_pos(len(prompts)))

    def _prefix_pos(self, n: int) -> Tensor:
        """(n, P) position ids of the prefix slots."""
        return torch.arange(self.prefix_len, device=self.device).expand(n, -1)

    def _tail_tensors(
        self, tails: Sequence[Sequence[int]], past_pos: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Left-padded token rows to prefill after cached slots whose position ids are
        ``past_pos`` (R, S) (-1: padding).

        Returns ids (R, L), kv_pos (R, S+L): position id of every cached and new slot (-1 for
        padding), and the position ids (R, L) of the new tokens (padding gets the position
        before the row's first new token, harmless: it is masked).
        """
        if any(not t for t in tails):
            raise ValueError("passage_template produced an empty prompt")
        n, width = len(tails), max(len(t) for t in tails)
        start = (past_pos.max(dim=1).values + 1).cpu()
        ids = torch.full((n, width), self.pad_token_id, dtype=torch.long)
        new_pos = torch.full((n, width), -1, dtype=torch.long)
        for r, t in enumerate(tails):
            ids[r, width - len(t) :] = torch.tensor(list(t))
            new_pos[r, width - len(t) :] = torch.arange(int(start[r]), int(start[r]) + len(t))
        pos = torch.where(new_pos >= 0, new_pos, start[:, None] - 1)
        dev = self.device
        kv_pos = torch.cat([past_pos, new_pos.to(dev)], dim=1)
        return ids.to(dev), kv_pos, pos.to(dev)

    def _mask(self, kv_pos: Tensor, q_pos: Tensor) -> Tensor | dict[str, Tensor]:
        """Attention mask for queries at ``q_pos`` (R, q) over keys at ``kv_pos`` (R, S) (which
        already include the queries' own slots)."""
        if self.sliding_window is None:
            return (kv_pos >= 0).long()
        keep = (kv_pos[:, None, :] >= 0) & (kv_pos[:, None, :] <= q_pos[:, :, None])
        in_window = q_pos[:, :, None] - kv_pos[:, None, :] < self.sliding_window
        dtype = next(self.model.parameters()).dtype
        neg = torch.finfo(dtype).min
        out = {}
        for t in self._layer_types:
            allowed = keep & in_window if t == "sliding_attention" else keep
            out[t] = torch.zeros(allowed.shape, dtype=dtype, device=kv_pos.device).masked_fill(
                ~allowed, neg
            )[:, None]
        return out

    def _forked_prefix(self, n: int, prefix_cache: Cache | None = None) -> Cache:
        # views, not copies: the prompt's forward concatenates the prefix into each row's cache
        cache = self.prefix_cache if prefix_cache is None else prefix_cache
        return broadcast_rows(cache, n)

    # ---------------------------------------------------------------- decoding

    def encode(self, items: Items, k: int) -> CausalEncoded:
        """Prefill every row's passage prompt after the shared prefix.

        A prompt is its passage's head (reused from :attr:`passage_cache` when that passage was
        prefilled before, else prefilled and kept there) and the question's tail. Rows are
        prefilled in groups of similar length (:func:`_length_groups`), so that left padding
        (computed, then masked) stays a small fraction of the work; the groups' caches are then
        joined (padded slots cost memory only) in row order.
        """
        rows = _pad_slots(items, k)
        prompts = [self.prompt_ids(q, p) for q, p in rows]
        heads = [0] * len(rows)
        if self.passage_cache.enabled:
            heads = [self.head_length(p, ids) for (_, p), ids in zip(rows, prompts, strict=True)]
        head_kv = self._head_keys_values(
            [tuple(ids[:h]) for ids, h in zip(prompts, heads, strict=True)]
        )
        tails = [ids[h:] for ids, h in zip(prompts, heads, strict=True)]
        groups = _length_groups([len(t) for t in tails])
        parts: list[CausalDecodeState] = []
        lasts: list[Tensor] = []  # last hidden states, or first log-probs without _own_head
        for group in groups:
            past = self._past([head_kv.get(tuple(prompts[r][: heads[r]])) for r in group])
            ids, kv_pos, pos = self._tail_tensors([tails[r] for r in group], past.kv_pos)
            inputs = dict(
                input_ids=ids,
                attention_mask=self._mask(kv_pos, pos),
                position_ids=pos,
                past_key_values=past.cache,
                use_cache=True,
            )
            if self._own_head:
                out = self.model.base_model(**inputs)
                lasts.append(out.last_hidden_state[:, -1])
            else:
                # Only the last prompt position predicts an answer token: the LM head over every
                # position (262k vocabulary x hundreds of positions x k rows) is what used to
                # exhaust memory.
                out = self.model(**inputs, logits_to_keep=1)
                lasts.append(_log_softmax(out.logits[:, -1]))
            parts.append(CausalDecodeState(out.past_key_values, kv_pos))
        # Back to row order in the same copy that joins the groups: group-order row j is row
        # order[j].
        order = [r for group in groups for r in group]
        dest = None if order == sorted(order) else torch.tensor(order, device=self.device)
        joined = self.join(parts, dest)
        # One pass of the LM head for every group: on a CPU it is bound by reading its weights
        # (Gemma's 262k x 640), whatever the rows.
        first = torch.cat(lasts)
        if self._own_head:
            first = _log_softmax(self._head_logits(first))
        if dest is not None:
            first = torch.empty_like(first).index_copy_(0, dest, first)
        return CausalEncoded(len(items), k, first, joined.cache, joined.kv_pos)

    def concats_encoded(self) -> bool:
        return True

    def concat_encoded(self, parts: Sequence[Encoded]) -> CausalEncoded:
        """The parts' rows joined as the length groups of one :meth:`encode` are (left-padded
        after the prefix, padding masked by ``kv_pos``)."""
        encoded = [p for p in parts if isinstance(p, CausalEncoded)]
        if len(encoded) != len(parts):
            raise TypeError("concat_encoded: parts of another model family")
        if len(encoded) == 1:
            return encoded[0]
        joined = self.join([CausalDecodeState(p.cache, p.kv_pos) for p in encoded])
        first = torch.cat([p.first_logprobs for p in encoded])
        return CausalEncoded(1, sum(p.k for p in encoded), first, joined.cache, joined.kv_pos)

    def _head_keys_values(self, heads: Sequence[tuple[int, ...]]) -> dict[tuple[int, ...], HeadKV]:
        """Keys/values of every distinct non-empty passage head: from the passage cache, or
        prefilled (grouped by length) after the prefix and kept there."""
        found: dict[tuple[int, ...], HeadKV] = {}
        missing: list[tuple[int, ...]] = []
        for head in dict.fromkeys(h for h in heads if h):
            kv = self.passage_cache.get(head)
            if kv is None:
                missing.append(head)
            else:
                found[head] = kv
        for group in _length_groups([len(h) for h in missing]):
            chunk = [missing[i] for i in group]
            ids, kv_pos, pos = self._prompt_tensors(chunk)
            out = self.model.base_model(  # keys/values only: no LM head
                input_ids=ids,
                attention_mask=self._mask(kv_pos, pos),
                position_ids=pos,
                past_key_values=self._forked_prefix(len(chunk)),
                use_cache=True,
            )
            layers = out.past_key_values.layers
            for i, head in enumerate(chunk):
                n = len(head)
                # the head's own slots (left padding sits before them), in tensors of its own
                kv = [
                    (x.keys[i : i + 1, :, -n:].clone(), x.values[i : i + 1, :, -n:].clone())
                    for x in layers
                ]
                self.passage_cache.put(head, kv)
                found[head] = kv
        return found

    def _past(self, heads: Sequence[HeadKV | None]) -> CausalDecodeState:
        """The cached slots rows start from: the prefix, then their passage head when given."""
        if all(h is None for h in heads):
            return CausalDecodeState(self._forked_prefix(len(heads)), self._prefix_pos(len(heads)))
        states = []
        for head in heads:
            if head is None:
                states.append(CausalDecodeState(self._forked_prefix(1), self._prefix_pos(1)))
                continue
            cache = copy.copy(self.prefix_cache)
            cache.layers = []
            for layer, (k, v) in zip(self.prefix_cache.layers, head, strict=True):
                new = copy.copy(layer)
                new.keys = torch.cat([layer.keys, k], dim=2)
                new.values = torch.cat([layer.values, v], dim=2)
                cache.layers.append(new)
            width = self.prefix_len + head[0][0].shape[2]
            pos = torch.arange(width, device=self.device)[None, :]
            states.append(CausalDecodeState(cache, pos))
        return self.join(states)

    def start(self, enc: CausalEncoded, copies: int) -> CausalDecodeState:
        if copies == 1:  # the encoded rows themselves; the first step's update copies them
            return CausalDecodeState(share_rows(enc.cache), enc.kv_pos)
        rows = _copy_rows(enc, copies)
        return CausalDecodeState(select_rows(enc.cache, rows), enc.kv_pos[rows])

    def step(self, state: CausalDecodeState, tokens: Tensor) -> Tensor:
        q_pos = state.kv_pos[:, -1:] + 1  # (N, 1): right after the last cached token
        state.kv_pos = torch.cat([state.kv_pos, q_pos], dim=1)
        growing(state.cache)  # append in place, not one copy of the cache per step
        out = self.model(
            input_ids=tokens[:, None],
            attention_mask=self._mask(state.kv_pos, q_pos),
            position_ids=q_pos,
            past_key_values=state.cache,
            use_cache=True,
        )
        state.cache = out.past_key_values
        return _log_softmax(out.logits[:, -1])

    def reorder(self, state: CausalDecodeState, rows: Tensor) -> None:
        # beams stay within their passage, whose rows share kv_pos
        reorder_self_attention(state.cache, rows)

    def join(
        self, states: Sequence[CausalDecodeState], dest: Tensor | None = None
    ) -> CausalDecodeState:
        """The rows of ``states`` in one state; with ``dest``, row j (counted through ``states``)
        becomes row ``dest[j]`` (:func:`~openbook.rag.cache.join_rows`)."""
        # Left padding is the prompts' own: slots at kv_pos -1 are masked, positions unchanged.
        if len(states) == 1 and dest is None:
            return states[0]
        width = max(s.kv_pos.shape[1] for s in states)
        kv_pos = torch.cat(
            [F.pad(s.kv_pos, (width - s.kv_pos.shape[1], 0), value=-1) for s in states]
        )
        if dest is not None:
            kv_pos = torch.empty_like(kv_pos).index_copy_(0, dest, kv_pos)
        return CausalDecodeState(join_rows([s.cache for s in states], dest), kv_pos)

    def keep(self, state: CausalDecodeState, rows: Tensor) -> CausalDecodeState:
        cache = select_rows(state.cache, rows)
        kv_pos = state.kv_pos[rows]
        # slots that only the rows which left used: padding for every row left
        lead = int((kv_pos >= 0).any(dim=0).long().argmax())
        drop_leading(cache, lead)
        return CausalDecodeState(cache, kv_pos[:, lead:])

    def score(
        self,
        enc: CausalEncoded,
        rows: Tensor,
        seqs: Tensor,
        lengths: Sequence[int] | None = None,
    ) -> Tensor:
        """Teacher forcing in chunks of rows and, when one row's logits alone exceed the budget,
        in segments of positions that extend the chunk's cache: at most
        :data:`SCORE_LOGIT_ELEMENTS` logits exist at any time, whatever the vocabulary size."""
        n_rows, length = seqs.shape
        out = torch.empty(n_rows, length, dtype=torch.float32, device=seqs.device)
        if n_rows == 0 or length == 0:
            return out
        out[:, 0] = enc.first_logprobs[rows].gather(1, seqs[:, :1]).squeeze(1)
        if length == 1:
            return out
        vocab = self.vocab_size
        chunk = max(1, SCORE_LOGIT_ELEMENTS // ((length - 1) * vocab))
        segment = max(1, SCORE_LOGIT_ELEMENTS // (min(chunk, n_rows) * vocab))
        for lo in range(0, n_rows, chunk):
            r = rows[lo : lo + chunk]
            s = seqs[lo : lo + chunk]
            cache = select_rows(enc.cache, r)
            kv_pos = enc.kv_pos[r]
            first_pos = kv_pos[:, -1:] + 1  # (c, 1) position of seqs[:, 0]
            for a in range(0, length - 1, segment):
                inputs = s[:, a : a + segment]
                q_pos = first_pos + a + torch.arange(inputs.shape[1], device=s.device)
                kv_pos = torch.cat([kv_pos, q_pos], dim=1)
                step = self.model(
                    input_ids=inputs,
                    attention_mask=self._mask(kv_pos, q_pos),
                    position_ids=q_pos,
                    past_key_values=cache,
                    use_cache=True,
                )
                cache = step.past_key_values
                lp = _log_softmax(step.logits)
                targets = s[:, a + 1 : a + 1 + inputs.shape[1], None]
                out[lo : lo + chunk, a + 1 : a + 1 + inputs.shape[1]] = lp.gather(
                    2, targets
                ).squeeze(2)
        return out

    # ---------------------------------------------------------------- training

    def target_logits(self, items: Items, targets: Tensor) -> Tensor:
        k = len(items[0][1])
        ids, kv_pos, pos = self._prompt_batch(_pad_slots(items, k))
        n_rows, width = ids.shape
        # Gradients must reach the weights through the prefix too, so the load-time cache is only
        # reused when no gradient is being recorded.
        prefix_cache = self._prefix_forward() if torch.is_grad_enabled() else self.prefix_cache
        answers = targets.to(ids.device).repeat_interleave(k, dim=0)[:, 1:]
        next_pos = kv_pos[:, -1:] + 1 + torch.arange(answers.shape[1], device=ids.device)
        q_pos = torch.cat([pos, next_pos], dim=1)
        logits = self.model(
            input_ids=torch.cat([ids, answers], dim=1),
            attention_mask=self._mask(torch.cat([kv_pos, next_pos], dim=1), q_pos),
            position_ids=q_pos,
            past_key_values=self._forked_prefix(n_rows, prefix_cache),
            use_cache=True,
            # Logits only at the positions the loss reads: the last prompt token (it predicts
            # targets[:, 1]) and every answer token; the prompt's other positions are never used.
            logits_to_keep=targets.shape[1],
        ).logits
        return logits

    def tokenize_targets(self, answers: Sequence[str]) -> Tensor:
        seqs = []
        for a in answers:
            ids = self.tokenizer(self.spec.answer_prefix + a, add_special_tokens=False)["input_ids"]
            tail = [self.eos_token_id] if self.eos_token_id is not None else []
            seqs.append([self.target_start_id, *ids, *tail])
        return _right_pad(seqs, self.pad_token_id).to(self.device)

    def decode(self, token_ids: Sequence[int]) -> str:
        text = self.tokenizer.decode(list(token_ids), skip_special_tokens=True)
        cut = [text.find(s) for s in self.spec.stop if s in text]
        if cut:
            text = text[: min(cut)]
        return text.removeprefix(self.spec.answer_prefix).strip()


def _passage_head(template: str) -> str | None:
    """The part of a passage template before ``{question}``, when it holds the passage (its
    title or text); None when nothing before the question depends on the passage.

    Without the whitespace that ends it: SentencePiece and byte-level BPE tokenizers join a
    space to the word after it, so "Question: {question}" reads "Question:" then " peru", and
    a head ending in the space would never be a prefix of the prompt's tokens (nothing reused)."""
    if "{question}" not in template:
        return None
    head = template.split("{question}", 1)[0].rstrip()
    return head if "{text}" in head or "{title}" in head else None


# A row joins a prefill group while its prompt is at least this fraction of the group's longest
# (so padding stays under 1 - this of the group's tokens).
_GROUP_MIN_FILL = 0.9


def _length_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Row indices grouped for prefill, longest first: each group's rows are within
    :data:`_GROUP_MIN_FILL` of its longest row's length."""
    order = sorted(range(len(lengths)), key=lambda r: -lengths[r])
    groups: list[list[int]] = []
    for r in order:
        if groups and lengths[r] >= _GROUP_MIN_FILL * lengths[groups[-1][0]]:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _first_id(*candidates) -> int | None:
    for c in candidates:
        if isinstance(c, list | tuple):
            c = c[0] if c else None
        if c is not None:
            return int(c)
    return None


def _right_pad(seqs: Sequence[Sequence[int]], pad: int) -> Tensor:
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), pad, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return out
