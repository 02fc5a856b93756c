"""Incremental BART decoding for RAG, with the encoder side computed once per passage.

transformers' ``BartDecoder`` needs one encoder row per decoder row, so beam search over k
passages copies every passage's encoder states (and their cross-attention keys/values)
``num_beams`` times and reorders those copies after every step. Here the decoder layers are run
directly on the model's own modules (same weights, same operations, no copies of them):

* cross-attention keys/values are projected ONCE per (question, passage) row, from the encoder
  output, and never copied: the queries of all decoder rows that read the same passage (its beams,
  or the prefix-tree nodes scored under it) are stacked along the query axis of one attention
  call, which is exact because cross-attention has no causal structure;
* the decoder self-attention cache is a plain list of per-layer key/value tensors; beam reordering
  gathers only those;
* teacher-forced scoring (:meth:`BartDecoding.forward_tree`) decodes every distinct prefix of the
  scored sequences once, in a single pass with a tree-shaped self-attention mask;
* on CPU the LM head multiplies by a cached contiguous transpose of its weight (bit-identical,
  faster for the few rows of a decoding step; costs one extra copy of that weight).

Only ``BartForConditionalGeneration`` in eval mode without autograd takes this path
(:class:`openbook.rag.backends.bart.BartBackend`); anything else (T5, mBART, training) uses
transformers' forward (:class:`openbook.rag.backends.seq2seq.Seq2SeqBackend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from openbook.rag.errors import ModelLoadError

if TYPE_CHECKING:  # importing it loads transformers' BART modeling code, needed only with BART
    from transformers import BartForConditionalGeneration

# Rows x vocabulary logits materialised at once by the LM head.
_LM_HEAD_ROWS = 1024

KV = list[tuple[Tensor, Tensor]]  # per decoder layer: keys, values (rows, heads, length, head_dim)


@dataclass
class CrossSegment:
    """Consecutive decoder rows reading P passage rows, ``copies`` rows per passage row.

    cross: per decoder layer, cross-attention keys and values (P, H, S, dh); mask: (P, S) bool
    (True = attend), None when no passage row is padded.
    """

    copies: int
    cross: KV
    mask: Tensor | None

    @property
    def rows(self) -> int:
        return int(self.cross[0][0].shape[0]) * self.copies


def supports(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a BART this module reproduces (``BartForConditionalGeneration``)."""
    from transformers import BartForConditionalGeneration

    return type(model) is BartForConditionalGeneration and model.config.model_type == "bart"


class BartDecoding:
    """BART decoder + LM head for cached incremental decoding (module docstring)."""

    def __init__(self, model: BartForConditionalGeneration) -> None:
        self.model = model
        cfg = model.config
        heads, d_model = cfg.decoder_attention_heads, cfg.d_model
        if heads is None or d_model is None:
            raise ModelLoadError("BART config without decoder_attention_heads or d_model")
        self.heads = int(heads)
        self.head_dim = int(d_model) // self.heads
        self._head_t: Tensor | None = None
        self._head_key: tuple | None = None

    @property
    def _decoder(self):
        return self.model.model.decoder

    def cross_kv(self, hidden: Tensor) -> KV:
        """Cross-attention keys/values of every decoder layer for encoder output ``hidden``."""
        rows, length, _ = hidden.shape
        shape = (rows, length, -1, self.head_dim)
        out: KV = []
        for layer in self._decoder.layers:
            attn = layer.encoder_attn
            k = attn.k_proj(hidden).view(shape).transpose(1, 2)
            v = attn.v_proj(hidden).view(shape).transpose(1, 2)
            out.append((k, v))
        return out

    def step_many(
        self,
        tokens: Tensor,
        positions: Tensor,
        past: KV | None,
        self_mask: Tensor | None,
        segments: list[CrossSegment],
    ) -> tuple[Tensor, KV]:
        """Feed L consecutive tokens per decoder row: tokens (N, L), the first at decoder
        position ``positions`` (N,), each attending to the cache and to the row's tokens before
        it (a drafted step, :mod:`openbook.rag.drafting`; L = 1: one decoding step).

        ``segments`` cover the N rows in order; in a segment of P passage rows with ``copies``
        rows each, decoder row ``p * copies + c`` (counted from the segment's first row) reads
        passage row p: its cross keys/values, per layer (P, H, S, dh), and mask (P, S) bool
        (True = attend) or None. past: self-attention cache of the N rows (left-padded when rows
        started at different steps), or None at the decoder-start step; self_mask (N, T) bool
        says which cached slots are real (None: all). Returns the new hidden states (N, L, d)
        and the cache extended by L slots.
        """
        dec = self._decoder
        n, length = tokens.shape
        x = dec.embed_tokens(tokens)
        at = positions[:, None] + torch.arange(length, device=positions.device)
        pos = dec.embed_positions.weight[at + dec.embed_positions.offset]
        x = dec.layernorm_embedding(x + pos)
        hidden_shape = (n, length, -1, self.head_dim)
        smask = _self_attention_mask(self_mask, past, n, length, tokens.device)
        new_cache: KV = []
        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            q = attn.q_proj(x).view(hidden_shape).transpose(1, 2)
            k = attn.k_proj(x).view(hidden_shape).transpose(1, 2)
            v = attn.v_proj(x).view(hidden_shape).transpose(1, 2)
            if past is not None:
                k = torch.cat([past[i][0], k], dim=2)
                v = torch.cat([past[i][1], v], dim=2)
            new_cache.append((k, v))
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=smask, scale=attn.scaling)
            a = a.transpose(1, 2).reshape(n, length, -1)
            x = layer.self_attn_layer_norm(x + attn.out_proj(a))

            attn = layer.encoder_attn
            q_all = attn.q_proj(x)
            outs = []
            start = 0
            for seg in segments:
                ck, cv = seg.cross[i]
                passages = ck.shape[0]
                rows = passages * seg.copies
                # the `copies` rows of one passage row, all their positions, attend to its
                # keys/values together (cross-attention has no causal structure)
                q = q_all[start : start + rows].view(
                    passages, seg.copies * length, self.heads, self.head_dim
                )
                xmask = None if seg.mask is None else seg.mask[:, None, None, :]
                a = F.scaled_dot_product_attention(
                    q.transpose(1, 2), ck, cv, attn_mask=xmask, scale=attn.scaling
                )
                outs.append(a.transpose(1, 2).reshape(rows, length, -1))
                start += rows
            a = outs[0] if len(outs) == 1 else torch.cat(outs)
            x = layer.encoder_attn_layer_norm(x + attn.out_proj(a))

            h = layer.fc2(layer.activation_fn(layer.fc1(x)))
            x = layer.final_layer_norm(x + h)
        return x, new_cache

    def forward_tree(
        self,
        tokens: Tensor,
        positions: Tensor,
        slots: Tensor,
        width: int,
        tree_mask: Tensor,
        start: KV,
        cross: KV,
        cross_mask: Tensor | None,
    ) -> Tensor:
        """Run the decoder once over prefix-tree nodes; returns their hidden states (N, d).

        tokens, positions: (N,) input token and position id of every node. Node j sits at slot
        ``slots[j]`` of the flattened (P, width) layout, row p holding the nodes decoded under
        passage row p. tree_mask: (P, 1, width, 1 + width) bool; entry [p, 0, s, 1 + s'] says
        whether the node at slot s sees the node at slot s' (its ancestors and itself), column 0 the
        decoder-start token whose keys/values are ``start`` (per layer (P, H, 1, dh)).
        """
        dec = self._decoder
        n_rows = start[0][0].shape[0]
        x = dec.embed_tokens(tokens)
        pos = dec.embed_positions.weight[positions + dec.embed_positions.offset]
        x = dec.layernorm_embedding(x + pos)
        xmask = None if cross_mask is None else cross_mask[:, None, None, :]

        def pad(t: Tensor) -> Tensor:  # (N, d) -> (P, H, width, dh)
            out = t.new_zeros(n_rows * width, t.shape[-1])
            out[slots] = t
            return out.view(n_rows, width, -1, self.head_dim).transpose(1, 2)

        def unpad(t: Tensor) -> Tensor:  # (P, H, width, dh) -> (N, d)
            return t.transpose(1, 2).reshape(n_rows * width, -1)[slots]

        for i, layer in enumerate(dec.layers):
            attn = layer.self_attn
            q = pad(attn.q_proj(x))
            k = torch.cat([start[i][0], pad(attn.k_proj(x))], dim=2)
            v = torch.cat([start[i][1], pad(attn.v_proj(x))], dim=2)
            a = F.scaled_dot_product_attention(q, k, v, attn_mask=tree_mask, scale=attn.scaling)
            x = layer.self_attn_layer_norm(x + attn.out_proj(unpad(a)))

            attn = layer.encoder_attn
            q = pad(attn.q_proj(x))
            ck, cv = cross[i]
            a = F.scaled_dot_product_attention(q, ck, cv, attn_mask=xmask, scale=attn.scaling)
            x = layer.encoder_attn_layer_norm(x + attn.out_proj(unpad(a)))

            h = layer.fc2(layer.activation_fn(layer.fc1(x)))
            x = layer.final_layer_norm(x + h)
        return x

    def log_probs(self, hidden: Tensor) -> Tensor:
        """log_softmax of the LM head over ``hidden`` (..., d), float32 (..., V)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        head, bias = self.model.lm_head, self.model.final_logits_bias
        weight_t = self._head_weight_t()
        out = torch.empty(
            flat.shape[0], head.weight.shape[0], dtype=torch.float32, device=flat.device
        )
        for lo in range(0, flat.shape[0], _LM_HEAD_ROWS):
            x = flat[lo : lo + _LM_HEAD_ROWS]
            logits = head(x) if weight_t is None else x @ weight_t
            logits += bias
            torch.log_softmax(logits.float(), dim=-1, out=out[lo : lo + _LM_HEAD_ROWS])
        return out.view(*hidden.shape[:-1], -1)

    def _head_weight_t(self) -> Tensor | None:
        """The LM head weight as a contiguous (d, V) copy, on CPU.

        MKL multiplies a few rows by the (V, d) weight about 1.5x slower than by its contiguous
        transpose, with bit-identical results; the copy is refreshed whenever the weight changes.
        """
        head = self.model.lm_head
        w = head.weight
        if w.device.type != "cpu" or head.bias is not None:
            return None
        key = (w.data_ptr(), w._version, w.dtype, tuple(w.shape))
        if self._head_key != key:
            self._head_t = w.detach().t().contiguous()
            self._head_key = key
        return self._head_t

    def gather_log_probs(self, hidden: Tensor, nodes: Tensor, tokens: Tensor) -> Tensor:
        """log p(tokens[m] | node nodes[m]) for hidden states (N, d), without keeping (N, V)."""
        out = torch.empty(nodes.shape[0], dtype=torch.float32, device=hidden.device)
        for lo in range(0, hidden.shape[0], _LM_HEAD_ROWS):
            lp = self.log_probs(hidden[lo : lo + _LM_HEAD_ROWS])
            sel = ((nodes >= lo) & (nodes < lo + lp.shape[0])).nonzero().squeeze(1)
            out[sel] = lp[nodes[sel] - lo, tokens[sel]]
        return out


def _self_attention_mask(
    self_mask: Tensor | None, past: KV | None, rows: int, length: int, device: torch.device
) -> Tensor | None:
    """(N, 1, L, T + L) bool (True = attend) for L new tokens per row after T cached slots:
    the real cached slots (``self_mask`` (N, T), None: all) and the new tokens up to each one's
    own; None where that is every slot (one new token, nothing padded)."""
    if length == 1:
        if self_mask is None:
            return None
        own = torch.ones(rows, 1, dtype=torch.bool, device=device)
        return torch.cat([self_mask, own], dim=1)[:, None, None, :]
    cached = 0 if past is None else int(past[0][0].shape[2])
    if self_mask is None:
        self_mask = torch.ones(rows, cached, dtype=torch.bool, device=device)
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return torch.cat(
        [
            self_mask[:, None, None, :].expand(rows, 1, length, cached),
            causal[None, None].expand(rows, 1, length, length),
        ],
        dim=3,
    )
