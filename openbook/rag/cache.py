"""Row selection on transformers key/value caches without mutating the source cache.

Decoding forks one cache into many rows (passages x beams x candidates); each fork must own its
tensors because transformers' caches grow in place.
"""

from __future__ import annotations

import copy

import torch
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
