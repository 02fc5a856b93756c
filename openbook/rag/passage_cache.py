"""Keys/values of passage prompts, kept across requests (decoder-only generators).

A causal LM's prompt for passage z is ``prefix + head(z) + tail(question)``: with the default
template, ``head`` is "Title: ... Passage: ... Question:" and ``tail`` the question and
"Answer:". The keys/values at a position depend only on the tokens up to it, and every head sits
right after the same shared prefix, at the same positions; so a passage retrieved again (by
another request, or another question) reuses its head's keys/values exactly, and only the short
tail is prefilled. This is the "repeated question/passage work reused across requests".

Entries are keyed by the head's token ids (what the keys/values are a function of, with the
weights), held least-recently-used first under a byte budget, and dropped whenever the weights
change (:meth:`PassageCache.clear`, from ``CausalBackend.refresh``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from torch import Tensor

from openbook.errors import InvalidArgument

# per layer: keys, values (1, kv_heads, head tokens, head_dim)
HeadKV = list[tuple[Tensor, Tensor]]


class PassageCache:
    """LRU of passage-head keys/values under ``max_bytes`` (0: disabled)."""

    def __init__(self, max_bytes: int) -> None:
        self._entries: OrderedDict[tuple[int, ...], tuple[HeadKV, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.reset(max_bytes)

    def reset(self, max_bytes: int) -> None:
        """Empty, with a budget of ``max_bytes`` and its counts at 0: as a new cache, but the
        same object, so that every holder of it (a backend's measuring twin) sees the change."""
        if max_bytes < 0:
            raise InvalidArgument(f"passage cache size must be >= 0 bytes, got {max_bytes}")
        with self._lock:
            self.max_bytes = max_bytes
            self.bytes = 0
            self.hits = 0
            self.misses = 0
            self._entries.clear()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: tuple[int, ...]) -> HeadKV | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry[0]

    def holds(self, key: tuple[int, ...]) -> bool:
        """Whether ``key``'s keys/values are kept now (a look, not a use: no count, no
        recency)."""
        with self._lock:
            return key in self._entries

    def put(self, key: tuple[int, ...], kv: HeadKV) -> None:
        """Keep ``kv`` (tensors the cache owns: not views of larger ones), evicting the least
        recently used entries to stay within the budget; an entry larger than it is not kept."""
        size = sum(k.nbytes + v.nbytes for k, v in kv)
        if not self.enabled or size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            while self._entries and self.bytes + size > self.max_bytes:
                _, (_, evicted) = self._entries.popitem(last=False)
                self.bytes -= evicted
            self._entries[key] = (kv, size)
            self.bytes += size

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self.bytes = 0
