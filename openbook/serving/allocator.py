"""The C allocator of a serving process: set up once at start, asked to give memory back.

Why: torch takes tensors from the C library's ``malloc``. glibc serves a block of at least its
mmap threshold with a mapping of its own, unmapped when freed, and everything smaller from heap
arenas, whose freed pages stay resident. It also raises that threshold to the size of every
mapped block freed (up to 32 MiB), so once a request has freed its first large tensor, most of
what the next requests allocate (a layer's keys/values, a step's logits, prefill activations)
comes from the arenas and stays resident after them. Measured on the default generator
(docs/benchmarks.md, "Generator working memory"): one k=100 request left 2.8 GB of its 4.2 GB
peak resident, and RSS only grew from request to request. Two settings give it back:

* :func:`configure`: a fixed mmap threshold (:data:`MMAP_THRESHOLD_BYTES`, which also stops the
  raising): a request's large tensors are unmapped as they are freed;
* :func:`release` (``malloc_trim(0)``): returns the free pages of every arena, what the smaller
  blocks left; :class:`MemoryReleaser` calls it when the generator goes idle and after large
  requests, outside any decoding step.

Only glibc has these; with another C library (musl, macOS) both do nothing. glibc's own
environment settings (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_ARENA_MAX``, ...) win over
:func:`configure`: a deployment that sets one keeps it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from functools import cache

log = logging.getLogger(__name__)

# Blocks from this size up get a mapping of their own: large enough that the many small blocks
# of Python and the tokenizers stay in the arenas, small enough that every tensor of a batch
# (one layer's keys/values of one row of Gemma 3 270M: 18 KiB per token) that outlives a step
# is unmapped when freed. 1 MiB kept 0.5 GB more resident after a crowd of k=20 requests than
# this, at the same peaks. The cost: freed tensors' pages are faulted in again when the next
# ones are allocated, 4x the minor page faults of glibc's default on a k=30 request (+1.1 s of
# system time on 24-68 s of compute, measured on a shared 2-CPU machine).
MMAP_THRESHOLD_BYTES = 256 * 2**10
# glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
# The environment variables that set the same (glibc reads them at start; they win).
_ENV_MMAP_THRESHOLD = ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")


@cache
def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (has ``malloc_trim``), else None."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    if not hasattr(libc, "malloc_trim") or not hasattr(libc, "mallopt"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc


def configure() -> bool:
    """Fix glibc's mmap threshold at :data:`MMAP_THRESHOLD_BYTES` (module docstring), unless
    the environment sets it; call once, at the start of a serving process, before its model
    loads. Returns whether the threshold was set here."""
    libc = _glibc()
    if libc is None:
        log.info("not glibc: the C allocator keeps its own settings")
        return False
    if any(name in os.environ for name in _ENV_MMAP_THRESHOLD):
        log.info("glibc's mmap threshold is set by the environment; left as it is")
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


def release() -> bool:
    """Return the C allocator's free pages to the system (glibc ``malloc_trim(0)``, every
    arena); False where there is no such call or nothing was returned."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class MemoryReleaser:
    """Gives freed memory back (:func:`release`) once enough work has ended.

    Told of every request that ends (:meth:`finished`) with its estimated working memory and
    whether the generator is idle now: it releases when the generator goes idle after any work,
    and, under a load that never leaves it idle, once the requests ended since the last release
    add up to ``every_bytes`` (their memory was freed piecemeal, between other requests'
    steps). A release walks the arenas' free blocks (~50-200 ms after large requests, measured),
    so it is not done after every small request of a busy generator.
    """

    def __init__(self, every_bytes: int, release_fn=release) -> None:
        self.every_bytes = every_bytes
        self._release = release_fn
        self._ended = 0  # estimated bytes of requests ended since the last release
        self._lock = threading.Lock()
        self.releases = 0

    def finished(self, estimate_bytes: int, idle: bool) -> None:
        with self._lock:
            self._ended += max(0, estimate_bytes)
            if not (self._ended and (idle or self._ended >= self.every_bytes)):
                return
            self._ended = 0
            self.releases += 1
        started = time.perf_counter()
        self._release()
        log.debug("memory released in %.0f ms", 1000 * (time.perf_counter() - started))
