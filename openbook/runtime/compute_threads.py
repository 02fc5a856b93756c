"""torch's compute threads sized to the CPU the process gets, and resized as that changes.

torch runs each CPU kernel on an OpenMP team as large as the calling thread's setting, which by
default is the machine's core count. An OpenMP team waits at every barrier for its slowest
thread: when a neighbour takes one of two cores, the thread that shares that core runs half the
time and the whole team with it, and libgomp's waiting threads spin on the core they are
waiting for. On the default stack that took a 2-core machine from 48 answers to 0 in the same
test, and to 35 with ``OMP_NUM_THREADS=1`` (issue 29). :class:`ComputeThreads` sizes the team
to :class:`~openbook.runtime.cpu_budget.CpuBudget`'s ``usable`` CPUs at start and re-reads it at
most every :attr:`ComputeThreadsOptions.interval_s` between pieces of work.

An explicit setting wins and is never changed: ``OPENBOOK_COMPUTE_THREADS`` (the services'
``compute_threads`` setting; 0 or unset: automatic), else ``OMP_NUM_THREADS`` when the
environment sets it (a deployment that chose it knows why).

**Call it on the thread that computes.** In torch's OpenMP build ``torch.set_num_threads`` sets
the calling thread's OpenMP team size (``omp_set_num_threads`` is per thread) and a process-wide
default that only threads which have not computed yet pick up: the decoding thread that has run
the model keeps its team unless the call is made on it. So a service calls :meth:`apply` and
:meth:`maybe_resize` from its decoding / encoding thread, never from a request thread.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from openbook.runtime.cpu_budget import CpuBudget

log = logging.getLogger(__name__)


def explicit_setting(setting: int = 0) -> tuple[int, str] | None:
    """(threads, where it comes from) when the size is set explicitly, else None (automatic).
    ``setting`` is OPENBOOK_COMPUTE_THREADS (0: automatic); then ``OMP_NUM_THREADS``."""
    if setting and setting > 0:
        return setting, "OPENBOOK_COMPUTE_THREADS"
    omp = os.environ.get("OMP_NUM_THREADS", "").strip()
    if omp:
        try:
            n = int(omp.split(",")[0])  # "4,2": the outermost level's
        except ValueError:
            return None
        if n > 0:
            return n, "OMP_NUM_THREADS"
    return None


@dataclass(frozen=True)
class ComputeThreadsOptions:
    """``setting``: OPENBOOK_COMPUTE_THREADS (0: automatic). ``interval_s``: the budget is
    re-read at most this often. ``share``: processes that split the budget (torchrun's
    processes per node); each gets ``usable // share``, at least 1."""

    setting: int = 0
    interval_s: float = 1.0
    share: int = 1


def _torch_set(n: int) -> None:
    import torch

    torch.set_num_threads(n)
    try:  # faiss has its own OpenMP runtime; a retriever's searches follow the same size
        import faiss

        faiss.omp_set_num_threads(n)
    except ImportError:
        pass


@dataclass
class ComputeThreads:
    """The compute-thread size of one service (module docstring). ``on_change(n)`` is told of
    every size applied (a metrics gauge); the size is logged when it changes, not per call.

    Invariant: ``size`` is the size last applied (≥ 1), on the thread that last called
    :meth:`apply` / :meth:`maybe_resize`; with an explicit setting it never changes.
    """

    options: ComputeThreadsOptions = field(default_factory=ComputeThreadsOptions)
    budget: CpuBudget = field(default_factory=CpuBudget)
    on_change: Callable[[int], None] | None = None
    set_threads: Callable[[int], None] = _torch_set
    clock: Callable[[], float] = time.monotonic
    size: int = 0
    source: str = "auto"
    _next_read: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        explicit = explicit_setting(self.options.setting)
        if explicit is not None:
            self._fixed: int | None = explicit[0]
            self.source = explicit[1]
        else:
            self._fixed = None

    @property
    def automatic(self) -> bool:
        return self._fixed is None

    def target(self) -> int:
        """The size the budget gives now (reads the kernel; the explicit setting if set)."""
        if self._fixed is not None:
            return self._fixed
        return max(1, self.budget.usable() // max(1, self.options.share))

    def apply(self) -> int:
        """Read the budget and set the calling thread's size now; the size."""
        with self._lock:
            self._next_read = self.clock() + self.options.interval_s
            self._set(self.target())
            return self.size

    def maybe_resize(self) -> int:
        """Between two pieces of work: re-read the budget if ``interval_s`` has passed since the
        last reading and resize if it changed; the size. Cheap otherwise (one clock read)."""
        if self._fixed is not None and self.size:
            return self.size
        now = self.clock()
        if now < self._next_read and self.size:
            return self.size
        with self._lock:
            self._next_read = now + self.options.interval_s
            self._set(self.target())
            return self.size

    def _set(self, n: int) -> None:
        # set on every call, not only on a change: a call from a thread that has not run the
        # model yet (a new decoding thread) must set its own team too
        self.set_threads(n)
        if n != self.size:
            log.info(
                "compute threads: %d (%s; %d CPUs allowed, others using %.1f)",
                n,
                self.source,
                self.budget.allowed(),
                self.budget.others,
            )
            self.size = n
            if self.on_change is not None:
                self.on_change(n)
