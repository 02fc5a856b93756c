"""Row selection on transformers key/value caches without mutating the source cache.

Decoding forks one cache into many rows (passages x beams x candidates); each fork must own its
tensors because transformers' caches grow in place. The decoding engine joins the caches of
requests that started at different times (left-padded to a common length) and drops the rows of
finished ones: by copying into new buffers, or inside the running batch's own buffers where
they have room (:func:`keep_in_place`, :func:`join_in_place`).
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
# Room a running batch's buffers keep for rows to join it in place (join_in_place) instead of
# the batch being copied: rows beyond those held, and slots before them (for rows with longer
# prompts), as shares of what is held; made where the batch is copied (join_rows, select_rows
# and growth of a running batch) and left by rows leaving in place (keep_in_place).
ROOM_ROWS = 0.2
ROOM_SLOTS = 0.1
# What a copy holds beyond what its rows need (their slots, from the first held to the
# buffer's end), as a share of that.
ROOM_SHARE = (1 + ROOM_ROWS) * (1 + ROOM_SLOTS) - 1
# The most a running batch's buffer holds beyond what its rows need, as a share of that, after
# rows left in place: more than the room a copy makes, so that rows may leave in place after
# rows joined in place. openbook/rag/memory.py counts both.
SPARE_SHARE = 0.7
assert ROOM_SHARE < SPARE_SHARE


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
    from slot ``start`` on (the slots before dropped: padding no row kept attends to). Growing
    layers (a running batch's) get room for rows to join (:data:`ROOM_ROWS`)."""
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
            _select_into(new, rows.to(new.keys.device), span, start, room=True)
        out.layers.append(new)
    return out


def _select_into(
    layer: _FilledLayer, rows: torch.Tensor, span: slice | None, start: int, room: bool
) -> None:
    """``layer`` holds rows ``rows`` (``span``: the same as a slice, :func:`_as_span`) of its
    keys/values from slot ``start`` on, copied once into new tensors (with room to grow where
    the layer grows in place, and for rows to join with ``room``: :func:`_allocate`)."""
    keys, values = layer.keys, layer.values
    slots = _allocate(layer, keys, len(rows), keys.shape[-2] - start, room)
    for source, target in zip((keys, values), slots.view(), strict=True):
        if span is not None:  # a plain copy: about twice as fast as index_select's
            target.copy_(source[span, :, start:])
        else:
            torch.index_select(source[:, :, start:], 0, rows, out=target)
    _adopt(layer, slots)


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


def _allocate(layer: object, like: torch.Tensor, rows: int, width: int, room: bool) -> _Slots:
    """Uninitialized buffers like ``like`` for ``rows`` rows of ``width`` slots (their view to
    fill): where ``layer`` grows in place, with :data:`GROWTH_SLOTS` to spare, so that the next
    decoding step appends into them instead of copying them again, and with ``room``, room for
    rows to join (:meth:`_Slots.allocate`)."""
    if not isinstance(layer, GrowingLayer):
        return _Slots.allocate(like, rows, width, 0, room=False)
    return _Slots.allocate(like, rows, width, GROWTH_SLOTS, room)


def _adopt(layer: _FilledLayer, slots: _Slots) -> None:
    """``layer`` holds the view of ``slots`` (made by :func:`_allocate`, filled); a
    :class:`GrowingLayer` appends after it in place."""
    layer.keys, layer.values = slots.view()
    if isinstance(layer, GrowingLayer):
        layer._slots = slots


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
        if _layer_has_data(layer):  # beams reorder every step: no room for joining rows
            _select_into(layer, rows.to(layer.keys.device), span, 0, room=False)


def join_rows(caches: Sequence[Cache], dest: torch.Tensor | None = None) -> Cache:
    """One cache holding the rows of ``caches``, each layer left-padded with zeros to its longest
    length. Padding slots must be masked out by the caller (their keys are zeros, not absent).
    Growing layers (a running batch's) get room for rows to join (:data:`ROOM_ROWS`).

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
            slots = _allocate(new, parts[0].keys, rows, width, room=True)
            keys, values = slots.view()
            _scatter_rows([p.keys for p in parts], keys, order)
            _scatter_rows([p.values for p in parts], values, order)
            _adopt(new, slots)
        out.layers.append(new)
    return out


def _scatter_rows(
    parts: Sequence[torch.Tensor], out: torch.Tensor, dest: torch.Tensor | None
) -> None:
    """(rows_i, heads, length_i, d) tensors into ``out`` (sum rows_i, heads, width, d): row j
    of their concatenation at ``dest[j]`` (at j without ``dest``, as plain copies),
    right-aligned, zeros before."""
    width = out.shape[2]
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


def join_in_place(running: Cache, joining: Cache) -> bool:
    """Write the rows of ``joining`` after those of ``running`` into the room ``running``'s
    buffers keep (rows that left in place: :func:`keep_in_place`), copying only them; then
    ``running`` holds both, as :func:`join_rows` would (every row left-padded with zeros to the
    longer length). False, with nothing changed, where a layer has no such room or is not
    exactly the view its buffer holds (:meth:`_Slots.holds`); then join them by copying.
    ``joining`` is left untouched."""
    if isinstance(running, EncoderDecoderCache) or len(running.layers) != len(joining.layers):
        return False
    pairs: list[tuple[GrowingLayer, _Slots, torch.Tensor, torch.Tensor]] = []
    for layer, theirs in zip(running.layers, joining.layers, strict=True):
        held = _held_slots(layer)
        if held is None or not _layer_has_data(theirs):
            return False
        mine, slots = held
        keys: torch.Tensor = theirs.keys
        values: torch.Tensor = theirs.values
        if slots.rows + keys.shape[0] > slots.keys.shape[0] or keys.shape[-2] > slots.filled:
            return False
        pairs.append((mine, slots, keys, values))
    for mine, slots, keys, values in pairs:
        rows, width = keys.shape[0], keys.shape[-2]
        start = min(slots.start, slots.filled - width)  # the running rows' slots from here
        new, pad = slice(slots.rows, slots.rows + rows), slice(start, slots.filled - width)
        for source, buffer in ((keys, slots.keys), (values, slots.values)):
            buffer[: slots.rows, :, start : slots.start].zero_()  # their left padding
            buffer[new, :, pad].zero_()
            buffer[new, :, slots.filled - width : slots.filled].copy_(source)
        slots.rows, slots.start = slots.rows + rows, start
        mine.keys, mine.values = slots.view()
    return True


def keep_in_place(cache: Cache, rows: torch.Tensor, start: int = 0) -> bool:
    """Keep rows ``rows`` (increasing) of ``cache``, from slot ``start`` on, in the buffers
    ``cache`` holds: the rows after a leaving one move up (copies of them alone), and the rows
    and slots left over stay as room for rows to join (:func:`join_in_place`). ``cache``
    then holds what :func:`select_rows` would give; an older view of it is void. False, with
    nothing changed, where a layer is not exactly the view its buffer holds, was copied
    (another holder may read its rows), or would keep more room than
    :data:`SPARE_SHARE` of what the kept rows take; then select them by copying."""
    if isinstance(cache, EncoderDecoderCache) or len(rows) == 0:
        return False
    kept = rows.tolist()
    if any(b <= a for a, b in zip(kept, kept[1:], strict=False)):
        return False
    layers = []
    for layer in cache.layers:
        held = _held_slots(layer)
        if held is None or held[1].shared:
            return False
        layer, slots = held
        capacity_rows, capacity_slots = slots.keys.shape[0], slots.keys.shape[2]
        first = slots.start + start
        if capacity_rows * capacity_slots > (1 + SPARE_SHARE) * len(kept) * (
            capacity_slots - first
        ):
            return False
        layers.append((layer, slots, first))
    moves = _row_moves(kept)
    for layer, slots, first in layers:
        span = slice(first, slots.filled)
        for buffer in (slots.keys, slots.values):
            for target, source in moves:
                buffer[target, :, span].copy_(buffer[source, :, span])
        slots.rows, slots.start = len(kept), first
        layer.keys, layer.values = slots.view()
    return True


def _held_slots(layer: object) -> tuple[GrowingLayer, _Slots] | None:
    """``layer`` and its buffers where it is a growing layer holding exactly their view."""
    if not isinstance(layer, GrowingLayer):
        return None
    slots: _Slots | None = getattr(layer, "_slots", None)
    if slots is None or layer.keys is None or layer.values is None:
        return None
    return (layer, slots) if slots.holds(layer.keys, layer.values) else None


def _row_moves(kept: Sequence[int]) -> list[tuple[slice, slice]]:
    """Copies (target rows, source rows) that move row ``kept[i]`` to row ``i`` (``kept``
    increasing), in order, each between rows that do not overlap: a run of consecutive rows
    moving up by d is copied d rows at a time."""
    moves = []
    i = 0
    while i < len(kept):
        j = i
        while j + 1 < len(kept) and kept[j + 1] == kept[j] + 1:
            j += 1
        shift, end = kept[i] - i, j + 1  # rows i..j come from kept[i]..kept[j]
        if shift:
            for t in range(i, end, shift):
                n = min(shift, end - t)
                moves.append((slice(t, t + n), slice(t + shift, t + shift + n)))
        i = end
    return moves


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
    joining and leaving the batch"). Where the buffer has room, rows leave and join in it
    (:func:`keep_in_place`, :func:`join_in_place`): only the rows that move or join are copied.

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
        if slots is not None and not slots.shared and slots.holds(keys, values):
            slots.filled = slots.start + length
            self.keys, self.values = slots.view()
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
            # a running batch's buffers keep room for rows to join as they grow
            room = slots is not None and slots.room
            held = keys.shape[-2] if keys.numel() else 0
            slots = _Slots.allocate(key_states, len(key_states), held, new + GROWTH_SLOTS, room)
            if held:
                for source, target in zip((keys, values), slots.view(), strict=True):
                    target.copy_(source)
            self._slots = slots
        self.keys, self.values = slots.append(key_states, value_states)
        return self.keys, self.values


class _Slots:
    """Key/value buffers (capacity rows, heads, capacity slots, d); the first ``rows`` rows,
    slots ``start`` to ``filled``, hold data (the view a layer holds, :meth:`view`). Rows after
    ``rows`` and slots before ``start`` are room that rows left (:func:`keep_in_place`) and
    rows joining fill (:func:`join_in_place`); slots after ``filled``, room to grow."""

    __slots__ = ("filled", "keys", "room", "rows", "shared", "start", "values")

    def __init__(
        self,
        keys: torch.Tensor,
        values: torch.Tensor,
        rows: int,
        start: int,
        filled: int,
        room: bool,
    ) -> None:
        self.keys, self.values = keys, values
        self.rows, self.start, self.filled = rows, start, filled
        self.room = room  # copies keep room for rows to join (a running batch's buffers)
        # whether a copy of a layer holding these buffers was made (GrowingLayer.__copy__)
        self.shared = False

    @classmethod
    def allocate(cls, like: torch.Tensor, rows: int, width: int, spare: int, room: bool) -> _Slots:
        """Uninitialized buffers like ``like`` (·, heads, ·, d) whose view is ``rows`` rows of
        ``width`` slots (to be filled), with ``spare`` slots after it and, with ``room``,
        :data:`ROOM_ROWS` more rows and :data:`ROOM_SLOTS` more slots before it: at most
        :data:`ROOM_SHARE` more than its rows need."""
        extra_rows = int(rows * ROOM_ROWS) if room else 0
        before = int(width * ROOM_SLOTS) if room else 0
        shape = (rows + extra_rows, like.shape[1], before + width + spare, like.shape[3])
        keys, values = like.new_empty(shape), like.new_empty(shape)
        return cls(keys, values, rows, before, before + width, room)

    def view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values held: rows ``:rows``, slots ``start:filled``."""
        rows, held = slice(0, self.rows), slice(self.start, self.filled)
        return self.keys[rows, :, held], self.values[rows, :, held]

    def holds(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Whether ``keys``/``values`` are exactly :meth:`view` (and not an older view of the
        same buffers, which a sharer's append or a join in place has moved past)."""
        return self._is_view(keys, self.keys) and self._is_view(values, self.values)

    def _is_view(self, view: torch.Tensor, buffer: torch.Tensor) -> bool:
        at = buffer.data_ptr() + self.start * buffer.stride(2) * buffer.element_size()
        return (
            view.data_ptr() == at
            and view.stride() == buffer.stride()
            and view.shape[0] == self.rows
            and view.shape[2] == self.filled - self.start
            and view.shape[1::2] == buffer.shape[1::2]
        )

    def appendable(self, keys: torch.Tensor, values: torch.Tensor, new: int) -> bool:
        """Whether ``keys``/``values`` are exactly the view held and ``new`` more slots fit."""
        return self.filled + new <= self.keys.shape[2] and self.holds(keys, values)

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.filled + keys.shape[-2]
        self.keys[: self.rows, :, self.filled : end] = keys
        self.values[: self.rows, :, self.filled : end] = values
        self.filled = end
        return self.view()


def growing(cache: Cache) -> None:
    """In place: make every plain dynamic layer of ``cache`` a :class:`GrowingLayer` (its
    tensors unchanged; the first update copies them into a buffer with room)."""
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            grown = copy.copy(layer)
            grown.__class__ = GrowingLayer
            cache.layers[i] = grown
