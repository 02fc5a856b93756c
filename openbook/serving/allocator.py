"""The C allocator of a serving process: set up once at start, asked to give memory back.

Why: torch takes tensors from the C library's ``malloc``. glibc serves a block of at least its
mmap threshold with a mapping of its own, unmapped when freed, and everything smaller from heap
arenas, whose freed pages stay resident (and are reused, without a page fault). It also raises
that threshold to the size of every mapped block freed (up to 32 MiB), so once a request has
freed its first large tensor, most of what the next requests allocate comes from the arenas
and stays resident after them. Measured on the default generator (docs/benchmarks.md,
"Generator working memory"): one k=100 request left 2.8 GB of its 4.2 GB peak resident, and
RSS only grew from request to request.

Two settings give it back, and one keeps the common answer fast:

* the mmap threshold is fixed (which stops glibc's raising) and follows the size of the work
  running (:class:`MemoryReleaser`): while every running request is small (estimated below
  :data:`LARGE_REQUEST_BYTES`, e.g. the default k=5 answer) it is :data:`SMALL_WORK_THRESHOLD`
  (32 MiB, glibc's own ceiling): a decoding step's tensors (its logits, a layer's keys/values)
  reuse freed arena pages instead of faulting fresh pages in on every step — the fixed 256 KiB
  of before cost a fifth of a single answer's latency and half the 8-client throughput
  (docs/benchmarks.md, "The allocator's toll"). Once a large request runs it is
  :data:`LARGE_WORK_THRESHOLD` (2 MiB): a large request's large tensors (its caches, prefill
  activations, logits) are unmapped as they are freed, which also lowered a k=100 request's
  peak by 1.4 GB (freed arena pages were not reused across arenas and sizes), while a decoding
  step's per-layer tensors stay in the arenas;
* :func:`release` (``malloc_trim(0)``): returns the free pages of every arena, what the smaller
  blocks left; :class:`MemoryReleaser` calls it once the generator has stayed idle for
  :data:`IDLE_RELEASE_AFTER_S`, before the threshold drops for a large request, and under a load
  that never leaves it idle only once the process holds more than its work accounts for
  (:data:`RESIDENT_SLACK_BYTES` over its idle size and the running requests' estimates), outside
  any decoding step. The idle release waits on a thread of its own: done as the last request
  ended, it stood in the way of the next (a caller asking again at once waited for the trim,
  50-200 ms, and then faulted the pages it had given back in again). Under load it used to run
  after every 512 MiB of work ended, whatever was resident: about every second default answer,
  each time handing back pages the next steps faulted in again (25,000 minor faults per answer
  at one client, 132,000 at eight; docs/benchmarks.md, "Trimming under load only past the
  slack").

Only glibc has these; with another C library (musl, macOS) all do nothing. glibc's own
environment settings (``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES``) win over
:func:`configure`: a deployment that sets one keeps it, and the threshold is never changed then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading
import time
from collections.abc import Callable
from functools import cache

log = logging.getLogger(__name__)

# While a large request runs, blocks from this size up get a mapping of their own: large enough
# that a decoding step's per-layer tensors (a layer's activations at 80 rows: 80 x 2,048 x 2
# bytes, 320 KiB) stay in the arenas, small enough that the tensors of a batch that outlive a
# step (one layer's keys/values of one row of Gemma 3 270M: 18 KiB per token, so 2 MiB past
# ~115 tokens) and a prefill's activations are unmapped when freed. At 256 KiB (until
# 2026-12-01) those per-layer tensors were mapped and faulted in again on every layer of every
# step: eight clients asking k=10 (estimated ~855 MiB each, so large) spent a third of the
# generator's CPU in the kernel (1.2 s per answer, 640,000 minor faults); at 2 MiB 0.27 s and
# 125,000, and 1.60x the answers per second (docs/benchmarks.md, "Large work's threshold at
# 2 MiB"). (1 MiB had kept 0.5 GB more resident than 256 KiB after a crowd of k=20 requests, at
# the same peaks: what the idle release gives back.)
LARGE_WORK_THRESHOLD = 2 * 2**20
# While only small requests run: glibc's own ceiling for its raised threshold (64-bit), so the
# step's tensors (a k=5 step's float32 logits: 5 MiB) come from arena pages already resident.
SMALL_WORK_THRESHOLD = 32 * 2**20
# A request estimated (openbook/rag/memory.py) at this much or more is large: the default answer
# (k=5, bf16: ~480 MiB) is not, k=20 (~1.2 GiB) or k=5 x 16 beams (~2.3 GiB) are. What small
# requests leave in the arenas is bounded by their own estimates and given back when the
# generator goes idle or the threshold drops.
LARGE_REQUEST_BYTES = 768 * 2**20
# How long the generator stays idle before what its work left in the arenas is given back. A
# caller asking again within it (the next question of a conversation, a client's queue) finds the
# pages resident and no trim in its way; a generator left idle is back at its idle size this long
# after its last request.
IDLE_RELEASE_AFTER_S = 1.0
# Under a load that never leaves the generator idle: how much more than its idle size and the
# estimates of the requests running the process may hold before freed pages are given back, and
# how much work must end between two such releases (a bound on their frequency where what is
# resident does not shrink with a release: kernel caches, buffers). Freed tensors' pages within
# it are reused by the next steps without a page fault.
RESIDENT_SLACK_BYTES = 512 * 2**20
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
    """Fix glibc's mmap threshold at :data:`SMALL_WORK_THRESHOLD` (module docstring), unless
    the environment sets it; call once, at the start of a serving process, before its model
    loads. Returns whether the threshold is ours to set (then :func:`set_mmap_threshold`
    moves it)."""
    libc = _glibc()
    if libc is None:
        log.info("not glibc: the C allocator keeps its own settings")
        return False
    if any(name in os.environ for name in _ENV_MMAP_THRESHOLD):
        log.info("glibc's mmap threshold is set by the environment; left as it is")
        return False
    return set_mmap_threshold(SMALL_WORK_THRESHOLD)


def set_mmap_threshold(nbytes: int) -> bool:
    """Fix glibc's mmap threshold at ``nbytes`` (blocks from that size up are mapped on their
    own and unmapped when freed); False where there is no glibc or it refused."""
    libc = _glibc()
    return bool(libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, nbytes))


def owns_mmap_threshold() -> bool:
    """Whether this process may move the threshold: glibc, and no environment setting."""
    return _glibc() is not None and not any(name in os.environ for name in _ENV_MMAP_THRESHOLD)


def _mib(nbytes: int | None) -> str:
    return "?" if nbytes is None else f"{nbytes / 2**20:,.0f}"


def resident_bytes() -> int | None:
    """This process's resident set size (Linux ``/proc/self/statm``); None where unknown."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            pages = int(statm.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def release() -> bool:
    """Return the C allocator's free pages to the system (glibc ``malloc_trim(0)``, every
    arena); False where there is no such call or nothing was returned."""
    libc = _glibc()
    return bool(libc is not None and libc.malloc_trim(0))


class MemoryReleaser:
    """Gives freed memory back (:func:`release`) when the work no longer needs it, and moves
    the mmap threshold with the size of the work running (module docstring).

    Told of every request that starts (:meth:`started`) and ends (:meth:`finished`) with its
    estimated working memory and, at the end, whether the generator is idle now: it releases
    once the generator has stayed idle for ``idle_after_s`` after any work (on a thread of its
    own, :meth:`close` stops it; at once, on the caller's thread, when ``idle_after_s`` is 0),
    and, under a load that never leaves it idle, when a request ends with the process holding
    more than its *floor* (its resident size when it was made, or after the last release less
    the estimates of the requests then running) plus the estimates of the requests still
    running plus ``slack_bytes``, at most once per ``slack_bytes`` of work ended. A release
    walks the arenas' free blocks (~50-200 ms after large requests, measured) and hands back
    pages the next steps fault in again, so a busy generator whose freed pages are being reused
    keeps them. Where the resident size is unknown (``resident`` returns None) it releases under
    load once per ``slack_bytes`` of work ended.

    Invariants: at every request's end, unless a release follows, resident memory is at most
    floor + the running requests' estimates + ``slack_bytes`` (or fewer than ``slack_bytes`` of
    work ended since the last release), so freed pages kept beside the work are bounded by the
    slack and by what the running work's estimates leave unused. The threshold is
    :data:`LARGE_WORK_THRESHOLD` exactly while at least one started request estimated at
    ``large_bytes`` or more has not finished, else :data:`SMALL_WORK_THRESHOLD`; before it drops,
    the arenas are released (what small work left resident is not kept beside a large request's
    peak). With ``set_threshold`` None (not glibc, or the environment set it) the threshold is
    left alone. A pending idle release is dropped by any request that starts before it is due
    (the next idle period schedules its own).
    """

    def __init__(
        self,
        slack_bytes: int,
        release_fn: Callable[[], object] = release,
        *,
        resident: Callable[[], int | None] = resident_bytes,
        large_bytes: int = LARGE_REQUEST_BYTES,
        set_threshold: Callable[[int], object] | None = None,
        idle_after_s: float = 0.0,
    ) -> None:
        self.slack_bytes = slack_bytes
        self.large_bytes = large_bytes
        self.idle_after_s = idle_after_s
        self._release = release_fn
        self._resident = resident
        self._set_threshold = set_threshold
        self._floor = resident()  # resident bytes with no work running, when last measured
        self._ended = 0  # estimated bytes of requests ended since the last release
        self._running = 0  # estimated bytes of started, unfinished requests
        self._large_running = 0  # started, unfinished requests of at least large_bytes
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._idle_since: float | None = None  # idle with work to give back, since (monotonic)
        self._waiter: threading.Thread | None = None
        self._closed = False
        self.releases = 0

    @classmethod
    def for_this_process(cls, slack_bytes: int) -> MemoryReleaser:
        """Moving the threshold where :func:`owns_mmap_threshold`, else only releasing; the
        idle release after :data:`IDLE_RELEASE_AFTER_S`."""
        return cls(
            slack_bytes,
            set_threshold=set_mmap_threshold if owns_mmap_threshold() else None,
            idle_after_s=IDLE_RELEASE_AFTER_S,
        )

    def started(self, estimate_bytes: int) -> None:
        """A request of ``estimate_bytes`` is about to run (before any of its tensors exist)."""
        with self._lock:
            self._idle_since = None  # not idle: a pending idle release waits for the next time
            self._running += max(0, estimate_bytes)
            if estimate_bytes < self.large_bytes:
                return
            self._large_running += 1
            first = self._large_running == 1
        if first and self._set_threshold is not None:
            self._timed_release()
            self._measure_floor()
            self._set_threshold(LARGE_WORK_THRESHOLD)

    def finished(self, estimate_bytes: int, idle: bool) -> None:
        """A request of ``estimate_bytes`` ended and its tensors are dropped; ``idle``: nothing
        runs or waits now."""
        with self._lock:
            last_large = False
            if estimate_bytes >= self.large_bytes and self._large_running:
                self._large_running -= 1
                last_large = self._large_running == 0
            self._running = max(0, self._running - max(0, estimate_bytes))
            self._ended += max(0, estimate_bytes)
            at_once = bool(idle and self._ended and self.idle_after_s <= 0)
            due = at_once or (self._ended >= self.slack_bytes and self._holds_too_much())
            if due:
                self._ended = 0
            elif idle and self._ended:
                self._idle_since = time.monotonic()
                self._start_waiter()
                self._wake.notify()
        if due:
            before = self._resident()
            self._timed_release()
            self._measure_floor()
            log.log(
                logging.DEBUG if at_once else logging.INFO,
                "memory released as work ended: %s -> %s MiB resident, floor now %s MiB",
                _mib(before),
                _mib(self._resident()),
                _mib(self._floor),
            )
        if last_large and self._set_threshold is not None:
            self._set_threshold(SMALL_WORK_THRESHOLD)

    def _holds_too_much(self) -> bool:
        """Called with the lock held: whether the process holds more than its floor, the work
        running and the slack (class docstring); True where either size is unknown."""
        resident = self._resident()
        if resident is None or self._floor is None:
            return True
        return resident > self._floor + self._running + self.slack_bytes

    def _measure_floor(self) -> None:
        """After a release: idle, what the process holds is its floor now (weights, the passage
        cache's entries, kernel caches and buffers that stay); under load, what it holds beyond
        the running requests' estimates, if more (an estimate bounds what its request holds,
        so this never exceeds the true floor). Without it, memory that no release gives back
        (grown kernel caches, say) would keep the process over its allowance, and every slack
        of work ended would pay a release for nothing."""
        resident = self._resident()
        with self._lock:
            if resident is None:
                return
            if self._running == 0 or self._floor is None:
                self._floor = resident - self._running
            else:
                self._floor = max(self._floor, resident - self._running)

    def close(self) -> None:
        """Stop the idle-release thread (a pending release is dropped)."""
        with self._lock:
            self._closed = True
            self._wake.notify()
            waiter = self._waiter
        if waiter is not None:
            waiter.join()

    def _start_waiter(self) -> None:
        """Called with the lock held."""
        if self._waiter is None and not self._closed:
            self._waiter = threading.Thread(
                target=self._release_when_idle, name="memory-release", daemon=True
            )
            self._waiter.start()

    def _release_when_idle(self) -> None:
        while True:
            with self._lock:
                while not self._closed:
                    if self._idle_since is not None:
                        left = self._idle_since + self.idle_after_s - time.monotonic()
                        if left <= 0:
                            break
                        self._wake.wait(left)
                    else:
                        self._wake.wait()
                if self._closed:
                    return
                self._idle_since = None
                self._ended = 0
            self._timed_release()
            self._measure_floor()

    def _timed_release(self) -> None:
        with self._lock:
            self.releases += 1
        started = time.perf_counter()
        self._release()
        log.debug("memory released in %.0f ms", 1000 * (time.perf_counter() - started))
