"""Row selection on transformers key/value caches without mutating the source cache.

Decoding forks one cache into many rows (passages x beams x candidates); each fork must own its
tensors because transformers' caches grow in place. The decoding engine joins the caches of
requests that started at different times (left-padded to a common length) and drops the rows of
finished ones.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Protocol, TypeGuard

import torch
from transformers.cache_utils import Cache, DynamicLayer, EncoderDecoderCache

from openbook.errors import InternalError

# Spare slots a growing layer allocates beyond what it holds: one copy of the cache per this
# many decoding steps instead of one per step (openbook/rag/memory.py counts them).
GROWTH_SLOTS = 16


class _FilledLayer(Protocol):
    """A cache layer holding keys/values (rows, heads, length, d): what this module edits."""

    keys: torch.Tensor
    values: torch.Tensor


def _layer_has_data(layer: object) -> TypeGuard[_FilledLayer]:
    """Whether ``layer`` holds keys/values; layers of other kinds (transformers' linear-attention
    and dummy layers, uninitialized ones) are left as they are."""
    keys = getattr(layer, "keys", None)
    return bool(getattr(layer, "is_initialized", False)) and keys is not None and keys.numel() > 0


def select_rows(cache: Cache, rows: torch.Tensor, start: int = 0) -> Cache:
    """A new cache whose row ``r`` is row ``rows[r]`` of ``cache`` (which is left untouched),
    from slot ``start`` on (the slots before dropped: padding no row kept attends to)."""
    if isinstance(cache, EncoderDecoderCache):
        both = EncoderDecoderCache(
            select_rows(cache.self_attention_cache, rows, start),
            select_rows(cache.cross_attention_cache, rows),
        )
        both.is_updated = dict(cache.is_updated)
        return both
    out = copy.copy(cache)
    out.layers = []
    span = _as_span(rows)  # the same rows for every layer
    for layer in cache.layers:
        new = copy.copy(layer)  # shares ``layer``'s tensors until they are replaced below
        if _layer_has_data(new):
            _select_into(new, rows.to(new.keys.device), span, start)
        out.layers.append(new)
    return out


def _select_into(layer: _FilledLayer, rows: torch.Tensor, span: slice | None, start: int) -> None:
    """``layer`` holds rows ``rows`` (``span``: the same as a slice, :func:`_as_span`) of its
    keys/values from slot ``start`` on, copied once into new tensors (with room to grow where
    the layer grows in place, :func:`_adopt`)."""
    keys, values = layer.keys, layer.values
    width = keys.shape[-2] - start
    new_keys, new_values = _allocate(layer, keys, len(rows), width)
    for source, target in ((keys, new_keys), (values, new_values)):
        if span is not None:  # a plain copy: about twice as fast as index_select's
            target[:, :, :width].copy_(source[span, :, start:])
        else:
            torch.index_select(source[:, :, start:], 0, rows, out=target[:, :, :width])
    _adopt(layer, new_keys, new_values, width)


def _as_span(rows: torch.Tensor) -> slice | None:
    """``rows`` as a slice where they are consecutive and increasing (rows leaving from either
    end of a batch), else None."""
    if len(rows) == 0:
        return None
    first = int(rows[0])
    if int(rows[-1]) - first + 1 != len(rows):
        return None
    if len(rows) > 1 and not bool((rows[1:] - rows[:-1] == 1).all()):
        return None
    return slice(first, first + len(rows))


def _allocate(
    layer: object, like: torch.Tensor, rows: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized keys and values (rows, heads, capacity, d) like ``like``, for ``width``
    slots: with :data:`GROWTH_SLOTS` to spare where ``layer`` grows in place, so that the next
    decoding step appends into them instead of copying them again."""
    spare = GROWTH_SLOTS if isinstance(layer, GrowingLayer) else 0
    shape = (rows, like.shape[1], width + spare, like.shape[3])
    return like.new_empty(shape), like.new_empty(shape)


def _adopt(layer: _FilledLayer, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
    """``layer`` holds the first ``width`` slots of the buffers ``keys``/``values`` (made by
    :func:`_allocate`); a :class:`GrowingLayer` appends after them in place."""
    layer.keys, layer.values = keys[:, :, :width], values[:, :, :width]
    if isinstance(layer, GrowingLayer):
        layer._slots = _Slots.over(keys, values, width)


def broadcast_rows(cache: Cache, rows: int) -> Cache:
    """A new cache of ``rows`` rows that all read the one row of ``cache``, without copying it.

    The rows are expanded views: safe because transformers' dynamic caches never write into
    their tensors (each update concatenates into new ones), so the first update of each layer
    is the only copy made.
    """
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)  # shares ``layer``'s tensors until they are replaced below
        if _layer_has_data(new):
            new.keys = new.keys.expand(rows, -1, -1, -1)
            new.values = new.values.expand(rows, -1, -1, -1)
        out.layers.append(new)
    return out


def share_rows(cache: Cache) -> Cache:
    """A new cache over the same tensors (no copy): growing it leaves ``cache`` unchanged, as
    every update concatenates into new tensors."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    return out


def reorder_self_attention(cache: Cache, rows: torch.Tensor) -> None:
    """In-place beam reorder of the decoder self-attention cache.

    Beams only ever move within one (request, passage) group, whose cross-attention keys/values are
    identical, so the encoder-decoder cross-attention cache is deliberately left alone.
    """
    target = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    span = _as_span(rows)
    for layer in target.layers:
        if _layer_has_data(layer):
            _select_into(layer, rows.to(layer.keys.device), span, 0)


def join_rows(caches: Sequence[Cache], dest: torch.Tensor | None = None) -> Cache:
    """One cache holding the rows of ``caches``, each layer left-padded with zeros to its longest
    length. Padding slots must be masked out by the caller (their keys are zeros, not absent).

    Rows are in order, or, with ``dest`` (a permutation of the total row count), input row i
    (counted through ``caches`` in order) becomes output row ``dest[i]``: joining and reordering
    in one copy."""
    first = caches[0]
    if isinstance(first, EncoderDecoderCache):
        pairs = [c for c in caches if isinstance(c, EncoderDecoderCache)]
        if len(pairs) != len(caches):
            raise TypeError("join_rows: an encoder-decoder cache joins only caches of its kind")
        both = EncoderDecoderCache(
            join_rows([c.self_attention_cache for c in pairs], dest),
            join_rows([c.cross_attention_cache for c in pairs], dest),
        )
        both.is_updated = dict(first.is_updated)
        return both
    out = copy.copy(first)
    out.layers = []
    for i, layer in enumerate(first.layers):
        new = copy.copy(layer)  # shares ``layer``'s tensors until they are replaced below
        if _layer_has_data(new):
            parts = [p for p in (c.layers[i] for c in caches) if _layer_has_data(p)]
            if len(parts) != len(caches):
                raise InternalError(f"join_rows: layer {i} holds keys/values in only some caches")
            width = max(p.keys.shape[-2] for p in parts)
            rows = sum(p.keys.shape[0] for p in parts)
            order = None if dest is None else dest.to(parts[0].keys.device)
            keys, values = _allocate(new, parts[0].keys, rows, width)
            _scatter_rows([p.keys for p in parts], keys, width, order)
            _scatter_rows([p.values for p in parts], values, width, order)
            _adopt(new, keys, values, width)
        out.layers.append(new)
    return out


def _scatter_rows(
    parts: Sequence[torch.Tensor], out: torch.Tensor, width: int, dest: torch.Tensor | None
) -> None:
    """(rows_i, heads, length_i, d) tensors into the first ``width`` slots of ``out`` (sum
    rows_i, heads, capacity, d): row j of their concatenation at ``dest[j]`` (at j without
    ``dest``, as plain copies), right-aligned, zeros before."""
    at = 0
    for p in parts:
        n, length = p.shape[0], p.shape[-2]
        if dest is None:
            out[at : at + n, :, width - length : width].copy_(p)
            out[at : at + n, :, : width - length].zero_()
        else:
            rows = dest[at : at + n]
            out[:, :, width - length : width].index_copy_(0, rows, p)
            if length < width:
                out[:, :, : width - length].index_fill_(0, rows, 0)
        at += n


def append_slots(cache: Cache, kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Cache:
    """A new cache whose layer i is ``cache``'s followed by the slots ``kv[i]`` (keys, values,
    each (rows, heads, n, d)); ``cache`` is left untouched (a causal LM's shared prefix
    followed by a passage head's cached keys/values)."""
    out = copy.copy(cache)
    out.layers = []
    for layer, (keys, values) in zip(cache.layers, kv, strict=True):
        new = copy.copy(layer)  # shares ``layer``'s tensors until they are replaced below
        out.layers.append(new)
        if not _layer_has_data(new):
            raise InternalError("append_slots: a layer without keys/values")
        new.keys = torch.cat([new.keys, keys], dim=2)
        new.values = torch.cat([new.values, values], dim=2)
    return out


def drop_trailing(cache: Cache, count: int) -> None:
    """In place: remove the last ``count`` slots of every (self-attention) layer: the rejected
    tail of a drafted step (:meth:`GrowingLayer.drop_trailing` rewinds its buffer, so the next
    step writes over those slots instead of copying the cache)."""
    if count <= 0:
        return
    target = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
    for layer in target.layers:
        if isinstance(layer, GrowingLayer):
            layer.drop_trailing(count)
        elif _layer_has_data(layer):
            layer.keys = layer.keys[:, :, :-count]
            layer.values = layer.values[:, :, :-count]


class GrowingLayer(DynamicLayer):
    """A :class:`DynamicLayer` that appends into spare capacity instead of concatenating.

    transformers' dynamic layer copies its whole keys/values at every update (``torch.cat``), so a
    decoding step copies the cache once more than it reads it. This layer keeps keys/values as
    views of the first ``filled`` slots of a larger buffer (:class:`_Slots`) and writes new slots
    after them; a full buffer, or keys that are not exactly that view (an expanded prefix, a
    drafted step's trimmed view), are copied into a new buffer with :data:`GROWTH_SLOTS` to
    spare. Rows joining or leaving (:func:`join_rows`, :func:`select_rows`, a beam reorder) are
    copied once, into such a buffer, so that the next step appends in place: at eight clients
    such copies, each made twice, were a fifth of the engine's time (docs/benchmarks.md, "Rows
    joining and leaving the batch").

    Copies of a layer (``copy.copy``: :func:`share_rows`, forks) share its buffer. Appending in
    place is allowed only to a layer whose view ends at the buffer's ``filled`` mark, and moves
    the mark: the first of two sharers to append writes slots nobody else sees; the second finds
    the mark past its view and copies. So no view ever changes under its holder, as with
    transformers' layer.

    :meth:`drop_trailing` (a drafted step's rejected slots) moves the mark back only while no
    copy of the layer was ever made (a copy's view may reach past the new mark, and later
    appends would write under it); otherwise it only shortens the view, and the next append
    copies.
    """

    def __copy__(self) -> GrowingLayer:
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        slots: _Slots | None = getattr(self, "_slots", None)
        if slots is not None:
            slots.shared = True  # a view of the buffer now has two holders: never rewind it
        return new

    def drop_trailing(self, count: int) -> None:
        """Remove the last ``count`` slots (rewinding the buffer when that is safe)."""
        keys, values = self.keys, self.values
        if count <= 0 or keys is None or values is None:
            return
        slots: _Slots | None = getattr(self, "_slots", None)
        length = keys.shape[-2] - count
        if (
            slots is not None
            and not slots.shared
            and _is_prefix_view(keys, slots.keys, slots.filled)
            and _is_prefix_view(values, slots.values, slots.filled)
        ):
            slots.filled = length
            self.keys, self.values = slots.keys[:, :, :length], slots.values[:, :, :length]
            return
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        keys, values = self.keys, self.values
        if keys is None or values is None:  # lazy_initialization sets both
            raise RuntimeError("GrowingLayer: keys/values missing after initialization")
        new = key_states.shape[-2]
        slots: _Slots | None = getattr(self, "_slots", None)
        if slots is None or not slots.appendable(keys, values, new):
            slots = _Slots(keys, values, key_states, value_states, new + GROWTH_SLOTS)
            self._slots = slots
        self.keys, self.values = slots.append(key_states, value_states)
        return self.keys, self.values


class _Slots:
    """Key/value buffers (rows, heads, capacity, d); the first ``filled`` slots hold data."""

    __slots__ = ("filled", "keys", "shared", "values")

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        spare: int,
    ) -> None:
        held = keys.shape[-2] if keys.numel() else 0
        self.keys = _buffer(keys, new_keys, held + spare)
        self.values = _buffer(values, new_values, held + spare)
        self.filled = held
        # whether a copy of a layer holding these buffers was made (GrowingLayer.__copy__)
        self.shared = False

    @classmethod
    def over(cls, keys: torch.Tensor, values: torch.Tensor, filled: int) -> _Slots:
        """Slots over buffers already holding ``filled`` slots of data (no copy)."""
        slots = cls.__new__(cls)
        slots.keys, slots.values, slots.filled, slots.shared = keys, values, filled, False
        return slots

    def appendable(self, keys: torch.Tensor, values: torch.Tensor, new: int) -> bool:
        """Whether ``keys``/``values`` are exactly the filled slots and ``new`` more fit."""
        return (
            self.filled + new <= self.keys.shape[2]
            and _is_prefix_view(keys, self.keys, self.filled)
            and _is_prefix_view(values, self.values, self.filled)
        )

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.filled + keys.shape[-2]
        self.keys[:, :, self.filled : end] = keys
        self.values[:, :, self.filled : end] = values
        self.filled = end
        return self.keys[:, :, :end], self.values[:, :, :end]


def _buffer(held: torch.Tensor, new: torch.Tensor, capacity: int) -> torch.Tensor:
    """(rows, heads, capacity, d) shaped like ``new``, starting with ``held`` (may be empty)."""
    rows, heads, _, dim = new.shape
    out = new.new_empty((rows, heads, capacity, dim))
    if held.numel():
        out[:, :, : held.shape[-2]] = held
    return out


def _is_prefix_view(view: torch.Tensor, buffer: torch.Tensor, filled: int) -> bool:
    return (
        view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and view.shape == (*buffer.shape[:2], filled, buffer.shape[3])
    )


def growing(cache: Cache) -> None:
    """In place: make every plain dynamic layer of ``cache`` a :class:`GrowingLayer` (its
    tensors unchanged; the first update copies them into a buffer with room)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            grown = copy.copy(layer)
            grown.__class__ = GrowingLayer
            cache.layers[i] = grown
