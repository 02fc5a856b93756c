"""Decoder-only family (Gemma, Llama, ...): a prompt per passage after a shared prefix.

:class:`CausalBackend` prefills the prompt's shared prefix once (at load and after the weights
change) and forks its cache for every row; each row then prefills its passage prompt (the
passage's head reused across requests from :class:`~openbook.rag.passage_cache.PassageCache`)
and decodes with :class:`CausalEncoded` / :class:`CausalDecodeState`. Prompts are left-padded
*after* the prefix and ``kv_pos`` keeps the position id of every cache slot (-1 for padding), so
every row sees exactly the positions of its unpadded prompt and rows that started at different
steps join one batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicCache

from openbook.errors import InternalError, InvalidArgument
from openbook.rag import memory
from openbook.rag.backends import base
from openbook.rag.backends.base import (
    DecodeState,
    Encoded,
    FedLogProbs,
    GeneratorBackend,
    Items,
    copy_rows,
    decode_text,
    first_id,
    log_softmax,
    pad_slots,
    right_pad,
)
from openbook.rag.backends.int8_head import RESCORE_MARGIN, Int8Head, Int8Product
from openbook.rag.cache import (
    append_slots,
    broadcast_rows,
    drop_trailing,
    growing,
    join_in_place,
    join_rows,
    keep_in_place,
    reorder_self_attention,
    select_rows,
    share_rows,
)
from openbook.rag.errors import ModelLoadError
from openbook.rag.memory import MemoryModel
from openbook.rag.packed_weights import PackedLinear, Packing, pack_linears, unpack_linears
from openbook.rag.passage_cache import HeadKV, PassageCache
from openbook.rag.prompting import PromptSpec
from openbook.types import Passage

# Keys/values of passage prompts a causal backend keeps across requests, by default
# (openbook/rag/passage_cache.py; the generator service sets OPENBOOK_GENERATOR_PASSAGE_CACHE_MB).
DEFAULT_PASSAGE_CACHE_BYTES = 256 * 2**20


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
    """N decoding rows: cache and kv_pos (N, P + L + t) after t answer tokens (and slots of
    drafted tokens that some rows rejected and others kept: kv_pos -1, as padding)."""

    cache: Cache
    kv_pos: Tensor


class CausalBackend(GeneratorBackend[CausalEncoded, CausalDecodeState]):
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
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        spec: PromptSpec,
        passage_cache_bytes: int = DEFAULT_PASSAGE_CACHE_BYTES,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.spec = spec
        cfg = model.config
        self.eos_token_id = first_id(tokenizer.eos_token_id, cfg.eos_token_id)
        self.bos_token_id = first_id(tokenizer.bos_token_id, cfg.bos_token_id)
        pad = first_id(tokenizer.pad_token_id, cfg.pad_token_id, self.eos_token_id)
        self.pad_token_id = 0 if pad is None else pad
        self.target_start_id = self.pad_token_id
        layer_types = set(getattr(cfg, "layer_types", None) or [])
        window = getattr(cfg, "sliding_window", None)
        # Sliding-window size when some layers use one (masks built here, see the class doc).
        self.sliding_window: int | None = None
        self._layer_types: list[str] = []
        if window and "sliding_attention" in layer_types:
            if not layer_types <= {"full_attention", "sliding_attention"}:
                raise ModelLoadError(f"unsupported attention layer types {sorted(layer_types)}")
            self.sliding_window = int(window)
            self._layer_types = sorted(layer_types)
        prefix_ids: list[int] = []
        if spec.prefix:
            prefix_ids = tokenizer(spec.prefix, add_special_tokens=False)["input_ids"]
        self._prefix_text_ids = list(prefix_ids)
        if spec.add_bos and self.bos_token_id is not None:
            prefix_ids = [self.bos_token_id, *prefix_ids]
        if not prefix_ids:
            raise ModelLoadError(
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
        self.passage_cache.reset(max_bytes)  # in place: the measuring twin holds it too

    def clear_passage_cache(self) -> None:
        self.passage_cache.clear()

    def refresh(self) -> None:
        """Recompute the cached prefix keys/values (call after the weights change)."""
        with torch.no_grad():
            self.prefix_cache = self._prefix_forward(check_head=True)
        self.passage_cache.clear()  # keys/values of the old weights

    def quantize_head(
        self, product: Int8Product | None = None, margin: float | None = RESCORE_MARGIN
    ) -> None:
        head = self.model.get_output_embeddings()
        if isinstance(head, Int8Head):
            return
        if isinstance(head, PackedLinear):  # the int8 copy is made from the plain weights
            head = head.unpacked()
        if not isinstance(head, nn.Linear) or head.bias is not None:
            raise ModelLoadError(f"an int8 LM head replaces a Linear without bias, not {head!r}")
        try:
            int8 = Int8Head(head.weight, product, margin)
        except InvalidArgument as e:  # a head torch's int8 kernel cannot run: this model's
            raise ModelLoadError(str(e)) from None
        # A tied model's embedding keeps its own matrix; the head reads the int8 copy only.
        self.model.config.tie_word_embeddings = False
        self.model.set_output_embeddings(int8)
        self.refresh()  # _own_head is checked again against the new head

    def pack_weights(self, packing: Packing = Packing.AUTO) -> bool:
        return pack_linears(self.model, packing) > 0

    def unpack_weights(self) -> bool:
        return unpack_linears(self.model) > 0

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

    # ---------------------------------------------------------------- what it states

    prompted = True

    @property
    def answer_prefix(self) -> str:
        return self.spec.answer_prefix

    def stop_strings(self) -> list[str]:
        return list(self.spec.stop)

    def memory_model(self) -> MemoryModel:
        """The shared prefix forked into every row, then the passage prompt; no cross-attention;
        the prefill builds one attention mask per attention layer type."""
        cfg = self.model.config
        elt = memory.parameter_bytes(self.model)
        hidden = int(cfg.hidden_size)
        heads = int(cfg.num_attention_heads)
        kv_heads = int(getattr(cfg, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(cfg, "head_dim", None) or hidden // heads)
        inter = int(getattr(cfg, "intermediate_size", None) or 4 * hidden)
        layer_types = 2 if self.sliding_window else 1
        head = self.model.get_output_embeddings()
        return MemoryModel(
            vocab=self.vocab_size,
            prefix_tokens=self.prefix_len,
            kv_bytes_per_token=int(cfg.num_hidden_layers) * 2 * kv_heads * head_dim * elt,
            cross_bytes_per_token=0,
            # residual, normed input, q/k/v/attention output, MLP gate + up + activation
            activation_bytes_per_token=(4 * hidden + 2 * heads * head_dim + 3 * inter) * elt,
            score_bytes_per_pair=heads * memory.score_bytes(self.model, elt),
            shared_cross=False,
            mask_bytes_per_pair=layer_types * elt,  # one mask per attention layer type
            score_bytes_cap=memory.score_bytes_cap(self.model),
            model_logit_bytes=memory.model_logit_bytes(elt),
            head_logit_bytes=head.transient_bytes_per_logit if isinstance(head, Int8Head) else 0,
        )

    # ---------------------------------------------------------------- input

    def input_lengths(self, question: str, passages: Sequence[Passage]) -> list[int]:
        return [len(self.prompt_ids(question, p)) for p in passages]

    def cached_input_tokens(self, question: str, passages: Sequence[Passage]) -> int:
        """The prompt tokens of these passages whose keys/values the passage cache holds now
        (their heads): what a prefill would not compute if they are still there."""
        if not self.passage_cache.enabled:
            return 0
        cached = 0
        for passage in passages:
            ids = self.prompt_ids(question, passage)
            head = self.head_length(passage, ids)
            if head and self.passage_cache.holds(tuple(ids[:head])):
                cached += head
        return cached

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
            raise InternalError("passage_template produced an empty prompt")
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
        rows = pad_slots(items, k)
        prompts = [self.prompt_ids(q, p) for q, p in rows]
        heads = [0] * len(rows)
        if self.passage_cache.enabled:
            heads = [self.head_length(p, ids) for (_, p), ids in zip(rows, prompts, strict=True)]
        head_kv, prefilled_heads = self._head_keys_values(
            [tuple(ids[:h]) for ids, h in zip(prompts, heads, strict=True)]
        )
        tails = [ids[h:] for ids, h in zip(prompts, heads, strict=True)]
        groups = _length_groups([len(t) for t in tails])
        parts: list[CausalDecodeState] = []
        lasts: list[FedLogProbs] = []  # after each group's last prompt position
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
            cache, last = self._forward(inputs, last_only=True)
            lasts.append(last)
            parts.append(CausalDecodeState(cache, kv_pos))
        # Back to row order in the same copy that joins the groups: group-order row j is row
        # order[j].
        order = [r for group in groups for r in group]
        dest = None if order == sorted(order) else torch.tensor(order, device=self.device)
        joined = self.join(parts, dest)
        # One pass of the LM head for every group: on a CPU it is bound by reading its weights
        # (Gemma's 262k x 640), whatever the rows.
        first = FedLogProbs.cat(lasts).at(0)
        if dest is not None:
            first = torch.empty_like(first).index_copy_(0, dest, first)
        reused = sum(heads) - prefilled_heads
        return CausalEncoded(
            len(items), k, first, joined.cache, joined.kv_pos, reused_tokens=reused
        )

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
        reused = sum(p.reused_tokens for p in encoded)
        k = sum(p.k for p in encoded)
        return CausalEncoded(1, k, first, joined.cache, joined.kv_pos, reused_tokens=reused)

    def _head_keys_values(
        self, heads: Sequence[tuple[int, ...]]
    ) -> tuple[dict[tuple[int, ...], HeadKV], int]:
        """Keys/values of every distinct non-empty passage head: from the passage cache, or
        prefilled (grouped by length) after the prefix and kept there; and how many head
        tokens were prefilled (each distinct head once)."""
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
        return found, sum(len(h) for h in missing)

    def _past(self, heads: Sequence[HeadKV | None]) -> CausalDecodeState:
        """The cached slots rows start from: the prefix, then their passage head when given."""
        if all(h is None for h in heads):
            return CausalDecodeState(self._forked_prefix(len(heads)), self._prefix_pos(len(heads)))
        states = []
        for head in heads:
            if head is None:
                states.append(CausalDecodeState(self._forked_prefix(1), self._prefix_pos(1)))
                continue
            cache = append_slots(self.prefix_cache, head)
            width = self.prefix_len + head[0][0].shape[2]
            pos = torch.arange(width, device=self.device)[None, :]
            states.append(CausalDecodeState(cache, pos))
        return self.join(states)

    def start(self, enc: CausalEncoded, copies: int) -> CausalDecodeState:
        if copies == 1:  # the encoded rows themselves; the first step's update copies them
            return CausalDecodeState(share_rows(enc.cache), enc.kv_pos)
        rows = copy_rows(enc, copies)
        return CausalDecodeState(select_rows(enc.cache, rows), enc.kv_pos[rows])

    def step(self, state: CausalDecodeState, tokens: Tensor) -> Tensor:
        return self.step_many(state, tokens[:, None]).at(0)

    def drafts(self) -> bool:
        return True

    def defers_head(self) -> bool:
        return self._own_head

    def step_many(self, state: CausalDecodeState, tokens: Tensor) -> FedLogProbs:
        # right after the row's last real token: the max, not the last slot, which is a hole
        # (kv_pos -1) in a row that kept fewer drafted tokens than another (drop_fed)
        last = state.kv_pos.amax(dim=1, keepdim=True)
        q_pos = last + 1 + torch.arange(tokens.shape[1], device=tokens.device)  # (N, L)
        state.kv_pos = torch.cat([state.kv_pos, q_pos], dim=1)
        growing(state.cache)  # append in place, not one copy of the cache per step
        inputs = dict(
            input_ids=tokens,
            attention_mask=self._mask(state.kv_pos, q_pos),
            position_ids=q_pos,
            past_key_values=state.cache,
            use_cache=True,
        )
        state.cache, fed = self._forward(inputs)
        return fed

    def _forward(
        self, inputs: dict[str, Any], last_only: bool = False
    ) -> tuple[Cache, FedLogProbs]:
        """The model over ``inputs`` -> its cache and the log-probs after every fed position
        (after the last only, with ``last_only``). Where :meth:`defers_head`, the LM head runs
        later and only over the positions read; otherwise the model's own logits are kept."""
        if self.defers_head():
            out = self.model.base_model(**inputs)
            hidden = out.last_hidden_state
            hidden = hidden[:, -1:] if last_only else hidden
            return out.past_key_values, FedLogProbs(hidden, self._head_log_probs)
        # logits_to_keep=1 after a prompt: the LM head over every position (262k vocabulary x
        # hundreds of positions x k rows) is what used to exhaust memory; 0 keeps them all.
        out = self.model(**inputs, logits_to_keep=1 if last_only else 0)
        return out.past_key_values, FedLogProbs.computed(log_softmax(out.logits))

    def _head_log_probs(self, hidden: Tensor) -> Tensor:
        return log_softmax(self._head_logits(hidden))

    def drop_fed(self, state: CausalDecodeState, fed: int, kept: Tensor) -> None:
        """The slots every row rejected leave the cache (its buffer rewound, no copy); the
        slots only some rows rejected stay as holes: kv_pos -1, masked like padding."""
        most = int(kept.max())
        drop_trailing(state.cache, fed - most)
        kv_pos = state.kv_pos[:, : state.kv_pos.shape[1] - (fed - most)]
        rejected = (
            torch.arange(most, device=kv_pos.device)[None, :] >= kept.to(kv_pos.device)[:, None]
        )
        if bool(rejected.any()):
            kv_pos = kv_pos.clone()
            kv_pos[:, -most:] = kv_pos[:, -most:].masked_fill(rejected, -1)
        state.kv_pos = kv_pos

    def draft_sources(self, question: str, passages: Sequence[Passage]) -> list[list[int]]:
        """Each passage's prompt after the prefix (its title, text and the question), as the
        model reads it: a copied span tokenises as it does there."""
        return [self.prompt_ids(question, p) for p in passages]

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
        # a request joining the running batch: written into the room rows that left it kept,
        # where there is room; else every row is copied into a new batch
        if len(states) == 2 and dest is None and join_in_place(states[0].cache, states[1].cache):
            return CausalDecodeState(states[0].cache, kv_pos)
        return CausalDecodeState(join_rows([s.cache for s in states], dest), kv_pos)

    def keep(self, state: CausalDecodeState, rows: Tensor) -> CausalDecodeState:
        kv_pos = state.kv_pos[rows]
        # slots that only the rows which left used: padding for every row left, not copied
        lead = int((kv_pos >= 0).any(dim=0).long().argmax())
        if keep_in_place(state.cache, rows, lead):  # the rows after a leaving one move up
            return CausalDecodeState(state.cache, kv_pos[:, lead:])
        return CausalDecodeState(select_rows(state.cache, rows, lead), kv_pos[:, lead:])

    def score(
        self,
        enc: CausalEncoded,
        rows: Tensor,
        seqs: Tensor,
        lengths: Sequence[int] | None = None,
    ) -> Tensor:
        """Teacher forcing in chunks of rows and, when one row's logits alone exceed the budget,
        in segments of positions that extend the chunk's cache: at most
        :data:`~openbook.rag.backends.base.SCORE_LOGIT_ELEMENTS` logits exist at any time,
        whatever the vocabulary size."""
        n_rows, length = seqs.shape
        out = torch.empty(n_rows, length, dtype=torch.float32, device=seqs.device)
        if n_rows == 0 or length == 0:
            return out
        out[:, 0] = enc.first_logprobs[rows].gather(1, seqs[:, :1]).squeeze(1)
        if length == 1:
            return out
        vocab = self.vocab_size
        chunk = max(1, base.SCORE_LOGIT_ELEMENTS // ((length - 1) * vocab))
        segment = max(1, base.SCORE_LOGIT_ELEMENTS // (min(chunk, n_rows) * vocab))
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
                lp = log_softmax(step.logits)
                targets = s[:, a + 1 : a + 1 + inputs.shape[1], None]
                out[lo : lo + chunk, a + 1 : a + 1 + inputs.shape[1]] = lp.gather(
                    2, targets
                ).squeeze(2)
        return out

    # ---------------------------------------------------------------- training

    def target_logits(self, items: Items, targets: Tensor) -> Tensor:
        k = len(items[0][1])
        ids, kv_pos, pos = self._prompt_batch(pad_slots(items, k))
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
        return right_pad(seqs, self.pad_token_id).to(self.device)

    def decode(self, token_ids: Sequence[int]) -> str:
        text = decode_text(self.tokenizer, token_ids, skip_special_tokens=True)
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
