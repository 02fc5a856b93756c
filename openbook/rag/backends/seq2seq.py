"""Encoder-decoder family (T5, mBART, BART in training, ...) through transformers' own forward.

:class:`Seq2SeqBackend` formats each (question, passage) row as transformers' ``RagRetriever``
does, encodes it once, then decodes every beam through the model's forward with a transformers
encoder-decoder cache (:class:`Seq2SeqEncoded` / :class:`Seq2SeqDecodeState`). That cache has no
per-row padding, so only states at the same decoding step join (``joins_running = False``).
A family with a faster path of its own subclasses it (:mod:`openbook.rag.backends.bart`);
:mod:`openbook.rag.backends.registry` picks the family for a model.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Self

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache
from transformers.modeling_outputs import BaseModelOutput

from openbook.errors import InternalError
from openbook.rag import memory
from openbook.rag.backends import base
from openbook.rag.backends.base import DecodeState, Encoded, GeneratorBackend, Items
from openbook.rag.cache import join_rows, reorder_self_attention, select_rows
from openbook.rag.memory import MemoryModel
from openbook.rag.prompting import seq2seq_input
from openbook.types import Passage


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


class Seq2SeqBackend(GeneratorBackend[Seq2SeqEncoded, Seq2SeqDecodeState]):
    """Encoder-decoder generator; input formatted like transformers' ``RagRetriever``.

    This class runs any transformers encoder-decoder through its own forward; a family with a
    faster path of its own subclasses it (:class:`~openbook.rag.backends.bart.BartBackend`);
    :func:`~openbook.rag.backends.registry.seq2seq_backend` picks the family for a model.
    """

    kind = "bart"

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        """Whether this family runs ``model`` (the generic class runs every encoder-decoder)."""
        return True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        prefix: str | None = None,
        title_sep: str = " / ",
        doc_sep: str = " // ",
        max_combined_length: int = 300,
        question_tokenizer: PreTrainedTokenizerBase | None = None,
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
        self.eos_token_id = base.first_id(cfg.eos_token_id, tokenizer.eos_token_id)
        self.bos_token_id = base.first_id(cfg.bos_token_id, tokenizer.bos_token_id)
        pad = base.first_id(cfg.pad_token_id, tokenizer.pad_token_id)
        self.pad_token_id = 0 if pad is None else pad

    # ---------------------------------------------------------------- what it states

    # Whether beams share their encoded row's cross-attention keys/values (BART's own decoding)
    # instead of each holding a copy (transformers' forward).
    shares_cross_attention = False

    def memory_model(self) -> MemoryModel:
        """The encoder's output and every decoder layer's cross keys/values per encoder token,
        the decoder's self-attention cache per answer token; no shared prefix."""
        cfg = self.model.config
        elt = memory.parameter_bytes(self.model)
        d = int(cfg.d_model)
        heads = max(int(cfg.encoder_attention_heads), int(cfg.decoder_attention_heads))
        ffn = max(int(cfg.encoder_ffn_dim), int(cfg.decoder_ffn_dim))
        decoder_layers = int(cfg.decoder_layers)
        return MemoryModel(
            vocab=self.vocab_size,
            prefix_tokens=0,
            kv_bytes_per_token=decoder_layers * 2 * d * elt,
            # encoder output kept + every decoder layer's cross keys and values
            cross_bytes_per_token=(1 + decoder_layers * 2) * d * elt,
            activation_bytes_per_token=(6 * d + 2 * ffn) * elt,
            score_bytes_per_pair=heads * memory.score_bytes(self.model, elt),
            shared_cross=self.shares_cross_attention,
            score_bytes_cap=memory.score_bytes_cap(self.model),
            model_logit_bytes=memory.model_logit_bytes(elt),
        )

    def measuring_twin(self) -> Self:
        twin = super().measuring_twin()
        if twin.question_tokenizer is not None:
            twin.question_tokenizer = copy.deepcopy(twin.question_tokenizer)
        return twin

    # ---------------------------------------------------------------- input

    def input_lengths(self, question: str, passages: Sequence[Passage]) -> list[int]:
        texts = self.input_strings([(question, p) for p in passages])
        enc = self.tokenizer(texts, max_length=self.max_combined_length, truncation=True)
        return [len(ids) for ids in enc["input_ids"]]

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
        return base.decode_text(tok, ids, skip_special_tokens=True)

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
        ids, mask = self._tokenize_inputs(base.pad_slots(items, k))
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
        first = base.log_softmax(out.logits[:, -1])
        return Seq2SeqEncoded(len(items), k, first, hidden, mask, out.past_key_values)

    def start(self, enc: Seq2SeqEncoded, copies: int) -> Seq2SeqDecodeState:
        rows = base.copy_rows(enc, copies)
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
        return base.log_softmax(out.logits[:, -1])

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
            raise InternalError(
                "Seq2SeqBackend joins only states of equal decoder and encoder length"
            )
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
        :data:`~openbook.rag.backends.base.SCORE_LOGIT_ELEMENTS` (at least one row per chunk)."""
        n_rows, length = seqs.shape
        out = torch.empty(n_rows, length, dtype=torch.float32, device=seqs.device)
        chunk = max(1, base.SCORE_LOGIT_ELEMENTS // max(1, (length - 1) * self.vocab_size))
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
                lp = base.log_softmax(logits)
                out[lo : lo + chunk, 1:] = lp.gather(2, s[:, 1:, None]).squeeze(2)
        return out

    # ---------------------------------------------------------------- training

    def target_logits(self, items: Items, targets: Tensor) -> Tensor:
        k = len(items[0][1])
        ids, mask = self._tokenize_inputs(base.pad_slots(items, k))
        return self.model(
            input_ids=ids,
            attention_mask=mask,
            decoder_input_ids=targets.to(ids.device).repeat_interleave(k, dim=0),
            use_cache=False,
        ).logits

    def tokenize_targets(self, answers: Sequence[str]) -> Tensor:
        enc = self.tokenizer(text_target=list(answers), padding=False, truncation=False)
        seqs = [[self.decoder_start_token_id, *ids] for ids in enc["input_ids"]]
        return base.right_pad(seqs, self.pad_token_id).to(self.device)
