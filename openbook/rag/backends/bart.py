"""BART family: ``BartForConditionalGeneration`` (plain BART, a RAG checkpoint's generator).

At inference (eval mode, autograd off) :class:`BartBackend` decodes with
:mod:`openbook.rag.backends.bart_decoding`: cross-attention keys/values computed once per passage
and shared by its beams, decoding rows kept in cross-attention segments
(:class:`BartEncoded` / :class:`BartDecodeState`), teacher-forced scoring as one pass over a
prefix tree. In training mode or with autograd on, :meth:`BartBackend.encode` returns the generic
:class:`~openbook.rag.backends.seq2seq.Seq2SeqEncoded` and every method continues exactly as
:class:`~openbook.rag.backends.seq2seq.Seq2SeqBackend` does (each method dispatches on the state
it is given).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from openbook.errors import InternalError
from openbook.rag.backends import bart_decoding
from openbook.rag.backends.base import DecodeState, Encoded, FedLogProbs, Items, copy_rows
from openbook.rag.backends.seq2seq import Seq2SeqBackend, Seq2SeqDecodeState, Seq2SeqEncoded

if TYPE_CHECKING:  # importing it loads transformers' BART modeling code (bart_decoding.supports)
    from transformers import BartForConditionalGeneration

# Sequences scored together as one prefix tree (bounds the cache size).
_TREE_CHUNK_SEQS = 1024


@dataclass
class BartEncoded(Encoded):
    """BART state after the decoder-start step, from :mod:`openbook.rag.backends.bart_decoding`.

    mask: (R, S) encoder attention mask.
    cross: per decoder layer, cross-attention keys and values (R, H, S, dh), computed once per row
        and shared by every beam / scored candidate of that row.
    cross_mask: (R, S) bool (True = attend), None when no row is padded.
    cache: per decoder layer, self-attention keys and values of the start token (R, H, 1, dh).
    """

    mask: Tensor
    cross: bart_decoding.KV
    cross_mask: Tensor | None
    cache: bart_decoding.KV


@dataclass
class BartDecodeState(DecodeState):
    """N decoding rows in cross-attention segments
    (:class:`~openbook.rag.backends.bart_decoding.CrossSegment`): the rows of one
    :meth:`BartBackend.start` form one segment, whose rows ``r * copies + c`` read encoded row
    r's cross keys/values; :meth:`BartBackend.join` concatenates segments.

    cache: per decoder layer, self-attention keys and values (N, H, L, dh), left-padded when rows
    started at different steps (the decoder-start token first). self_mask: (N, L) bool, True
    for real slots; None when no row is padded. positions: (N,) decoder position of each row's
    next token (1 + answer tokens so far).
    """

    segments: list[bart_decoding.CrossSegment]
    cache: bart_decoding.KV
    self_mask: Tensor | None
    positions: Tensor


# What BartBackend's methods take and give: BART's own states at inference, the generic ones
# otherwise (training mode, autograd on).
AnyEncoded = BartEncoded | Seq2SeqEncoded
AnyDecodeState = BartDecodeState | Seq2SeqDecodeState


class BartBackend(Seq2SeqBackend):
    """``BartForConditionalGeneration``, decoded by :mod:`~openbook.rag.backends.bart_decoding`
    at inference.

    :mod:`~openbook.rag.backends.bart_decoding` reproduces BART's eval-mode forward without
    autograd; in training mode (dropout) or with autograd on, :meth:`encode` returns the generic
    :class:`Seq2SeqEncoded` and every method continues as :class:`Seq2SeqBackend` does. Training
    logits (:meth:`target_logits`) always come from transformers' forward.

    Typing: :class:`Seq2SeqBackend`'s methods promise its generic states, these return either
    kind (:data:`AnyEncoded`, :data:`AnyDecodeState`); the ``type: ignore[override]`` below mark
    exactly those returns. Every method dispatches on the state it is given, so a state only
    ever goes back to the path that made it.
    """

    model: BartForConditionalGeneration
    shares_cross_attention = True  # bart_decoding keeps one cross cache per encoded row

    @classmethod
    def supports(cls, model: torch.nn.Module) -> bool:
        return bart_decoding.supports(model)

    def __init__(
        self,
        model: BartForConditionalGeneration,
        tokenizer: PreTrainedTokenizerBase,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, tokenizer, **kwargs)
        self._decoding = bart_decoding.BartDecoding(model)

    def _decodes_itself(self) -> bool:
        return not (self.model.training or torch.is_grad_enabled())

    def encode(self, items: Items, k: int) -> AnyEncoded:  # type: ignore[override]
        if not self._decodes_itself():
            return super().encode(items, k)
        hidden, mask = self._encoder_output(items, k)
        cross = self._decoding.cross_kv(hidden)
        # transformers drops an all-ones encoder mask as well
        cross_mask = None if bool(mask.all()) else mask.bool()
        start = torch.full((hidden.shape[0],), self.decoder_start_token_id, device=mask.device)
        zero = torch.zeros_like(start)
        segment = bart_decoding.CrossSegment(1, cross, cross_mask)
        h, cache = self._decoding.step_many(start[:, None], zero, None, None, [segment])
        first = self._decoding.log_probs(h[:, 0])
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

    def start(self, enc: AnyEncoded, copies: int) -> AnyDecodeState:  # type: ignore[override]
        if not isinstance(enc, BartEncoded):
            return super().start(enc, copies)
        rows = copy_rows(enc, copies)
        cache = [(k[rows], v[rows]) for k, v in enc.cache]
        segment = bart_decoding.CrossSegment(copies, enc.cross, enc.cross_mask)
        positions = torch.ones(rows.shape[0], dtype=torch.long, device=rows.device)
        return BartDecodeState([segment], cache, None, positions)

    def step(self, state: AnyDecodeState, tokens: Tensor) -> Tensor:
        if not isinstance(state, BartDecodeState):
            return super().step(state, tokens)
        return self.step_many(state, tokens[:, None]).at(0)  # one token: a step of one

    def drafts(self) -> bool:
        """BART's own decoding verifies drafts (at inference: training and autograd take
        transformers' forward, which does not)."""
        return not self.model.training

    def defers_head(self) -> bool:
        return True

    def step_many(self, state: AnyDecodeState, tokens: Tensor) -> FedLogProbs:
        if not isinstance(state, BartDecodeState):
            raise NotImplementedError("drafts are verified by BART's own decoding only")
        fed = tokens.shape[1]
        h, state.cache = self._decoding.step_many(
            tokens, state.positions, state.cache, state.self_mask, state.segments
        )
        state.positions = state.positions + fed
        if state.self_mask is not None:
            own = torch.ones_like(state.self_mask[:, :1]).expand(-1, fed)
            state.self_mask = torch.cat([state.self_mask, own], dim=1)
        return FedLogProbs(h, self._decoding.log_probs)

    def drop_fed(self, state: AnyDecodeState, fed: int, kept: Tensor) -> None:
        """The slots every row rejected leave the cache; the slots only some rows rejected stay
        as holes (``self_mask`` False, masked like padding). Each row's next position follows
        the tokens it kept: positions are the row's own, not its slot count."""
        if not isinstance(state, BartDecodeState):
            raise NotImplementedError("drafts are verified by BART's own decoding only")
        kept = kept.to(state.positions.device)
        most = int(kept.max())
        drop = fed - most
        if drop:
            state.cache = [(k[:, :, :-drop], v[:, :, :-drop]) for k, v in state.cache]
            if state.self_mask is not None:
                state.self_mask = state.self_mask[:, :-drop]
        state.positions = state.positions - fed + kept
        rejected = torch.arange(most, device=kept.device)[None, :] >= kept[:, None]
        if bool(rejected.any()):
            mask = state.self_mask
            if mask is None:
                width = state.cache[0][0].shape[2]
                mask = torch.ones(kept.shape[0], width, dtype=torch.bool, device=kept.device)
            else:
                mask = mask.clone()
            mask[:, -most:] &= ~rejected
            state.self_mask = mask

    def reorder(self, state: AnyDecodeState, rows: Tensor) -> None:
        if not isinstance(state, BartDecodeState):
            return super().reorder(state, rows)
        # beams stay within their passage: segments, mask and positions are unchanged
        state.cache = [(k[rows], v[rows]) for k, v in state.cache]

    joins_running = True

    def join(self, states: Sequence[AnyDecodeState]) -> AnyDecodeState:  # type: ignore[override]
        if len(states) == 1:
            return states[0]
        own = [s for s in states if isinstance(s, BartDecodeState)]
        generic = [s for s in states if isinstance(s, Seq2SeqDecodeState)]
        if len(generic) == len(states):
            return super().join(generic)
        if len(own) != len(states):
            raise TypeError("BartBackend.join: states of both decoding paths")
        return self._join_own(own)

    def _join_own(self, states: Sequence[BartDecodeState]) -> BartDecodeState:
        """BART's own states joined: self-attention caches left-padded to the longest (padding
        masked by ``self_mask``), cross-attention segments concatenated."""
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

    def keep(self, state: AnyDecodeState, rows: Tensor) -> AnyDecodeState:  # type: ignore[override]
        if not isinstance(state, BartDecodeState):
            return super().keep(state, rows)
        kept = rows.tolist()
        segments: list[bart_decoding.CrossSegment] = []
        at = 0
        for seg in state.segments:
            mine = [r - at for r in kept if at <= r < at + seg.rows]
            at += seg.rows
            if not mine:
                continue
            passages = sorted({r // seg.copies for r in mine})
            if len(passages) * seg.copies != len(mine):
                raise InternalError("keep: a passage row's copies must leave together")
            idx = torch.tensor(passages, device=rows.device)
            cross = [(k[idx], v[idx]) for k, v in seg.cross]
            mask = None if seg.mask is None else seg.mask[idx]
            segments.append(bart_decoding.CrossSegment(seg.copies, cross, mask))
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
        enc: AnyEncoded,
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
