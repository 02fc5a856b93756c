"""Row selection on transformers key/value caches without mutating the source cache.

Decoding forks one cache into many rows (passages x beams x candidates); each fork must own its
tensors because transformers' caches grow in place. The decoding engine joins the caches of
requests that started at different times (left-padded to a common length) and drops the rows of
finished ones.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from transformers.cache_utils import Cache, EncoderDecoderCache


def _layer_has_data(layer: object) -> bool:
    keys = getattr(layer, "keys", None)
    return bool(getattr(layer, "is_initialized", False)) and keys is not None and keys.numel() > 0


def select_rows(cache: Cache, rows: torch.Tensor) -> Cache:
    """A new cache whose row ``r`` is row ``rows[r]`` of ``cache`` (which is left untouched)."""
    if isinstance(cache, EncoderDecoderCache):
        out = EncoderDecoderCache(
            select_rows(cache.self_attention_cache, rows),
            select_rows(cache.cross_attention_cache, rows),
        )
        out.is_updated = dict(cache.is_updated)
        return out
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if _layer_has_data(layer):
            idx = rows.to(layer.keys.device)
            new.keys = layer.keys.index_select(0, idx)
            new.values = layer.values.index_select(0, idx)
        out.layers.append(new)
    return out


def broadcast_rows(cache: Cache, rows: int) -> Cache:
    """A new cache of ``rows`` rows that all read the one row of ``cache``, without copying it.

    The rows are expanded views: safe because transformers' dynamic caches never write into
    their tensors (each update concatenates into new ones), so the first update of each layer
    is the only copy made.
    """
    out = copy.copy(cache)
    out.layers = []
    for layer in cache.layers:
        new = copy.copy(layer)
        if _layer_has_data(layer):
            new.keys = layer.keys.expand(rows, -1, -1, -1)
            new.values = layer.values.expand(rows, -1, -1, -1)
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
    for layer in target.layers:
        if _layer_has_data(layer):
            idx = rows.to(layer.keys.device)
            layer.keys = layer.keys.index_select(0, idx)
            layer.values = layer.values.index_select(0, idx)


def join_rows(caches: Sequence[Cache]) -> Cache:
    """One cache holding the rows of ``caches`` in order, each layer left-padded with zeros to
    its longest length. Padding slots must be masked out by the caller (their keys are zeros,
    not absent)."""
    first = caches[0]
    if isinstance(first, EncoderDecoderCache):
        out = EncoderDecoderCache(
            join_rows([c.self_attention_cache for c in caches]),
            join_rows([c.cross_attention_cache for c in caches]),
        )
        out.is_updated = dict(first.is_updated)
        return out
    out = copy.copy(first)
    out.layers = []
    for i, layer in enumerate(first.layers):
        new = copy.copy(layer)
        if _layer_has_data(layer):
            parts = [c.layers[i] for c in caches]
            width = max(p.keys.shape[-2] for p in parts)
            new.keys = torch.cat([_pad_left(p.keys, width) for p in parts])
            new.values = torch.cat([_pad_left(p.values, width) for p in parts])
        out.layers.append(new)
    return out


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """(rows, heads, length, d) -> (rows, heads, width, d), zeros first."""
    return F.pad(t, (0, 0, width - t.shape[-2], 0))


def drop_leading(cache: Cache, count: int) -> None:
    """In place: remove the first ``count`` slots (padding no row attends to) of every layer."""
    if count <= 0:
        return
    for layer in cache.layers:
        if _layer_has_data(layer):
            layer.keys = layer.keys[:, :, count:]
            layer.values = layer.values[:, :, count:]
