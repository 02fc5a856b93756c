"""How much CPU this process gets: the compute-thread budget of every torch service.

Two readings, both from the kernel, never from ``os.cpu_count()`` (the machine's cores, which a
container, a CPU limit or a neighbour may not let the process have):

* **allowed** (:func:`allowed_cpus`): what the process may use at most, at start and whenever
  asked — the CPUs of its affinity mask (``os.sched_getaffinity``, which ``taskset``, cpusets
  and Kubernetes' static CPU manager set) and its cgroup CPU quota (v2 ``cpu.max``, v1
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; Kubernetes' CPU limit, ``docker --cpus``),
  whichever is smaller, rounded down, at least 1. A quota of 1.5 CPUs gives 1: a second compute
  thread would spend half of each period throttled, and an OpenMP team waits for its slowest
  thread.
* **contention** (:class:`CpuBudget`): how much of the affinity CPUs other processes are using
  now — the busy time of those CPUs in ``/proc/stat`` minus this process's own CPU time, over
  the time between two readings, smoothed. A neighbour spinning on one of two cores takes one
  core from the process as surely as an affinity mask would, but no setting says so.

``usable`` = min(allowed, affinity CPUs − others' use), at least 1, with hysteresis: a core
counts as lost once others use more than :data:`LOSE_AT` of it, and as regained once they use
less than :data:`REGAIN_AT` (so that a reading near the line does not make the size flap). The
threshold is well below half a core because a team that shares a core with a spinning
neighbour gets only half of it: what the others are measured to use while the team is that
size is about 0.5 of a core, not 1.

Everything read from files takes a root (:class:`CpuFiles`) so that tests write fake cgroup and
``/proc`` files in a temporary directory.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

# A core is lost once others use more than this share of it, regained once below REGAIN_AT.
LOSE_AT = 0.25
REGAIN_AT = 0.1
# Seconds over which readings of others' use fade (e-fold): a reading over a window of w
# seconds weighs 1 - exp(-w / SMOOTHING_S) against the past. A long window weighs at once: a
# piece of work that took seconds because a neighbour stalled the team must not be discounted,
# which is exactly when the reading matters.
SMOOTHING_S = 1.0
# /proc/stat columns that are busy time: user nice system (idle iowait) irq softirq steal.
# guest and guest_nice are already counted in user and nice.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


@dataclass(frozen=True)
class CpuFiles:
    """Where the kernel's CPU files are (tests point these at a temporary directory)."""

    cgroup_root: Path = Path("/sys/fs/cgroup")
    proc_self_cgroup: Path = Path("/proc/self/cgroup")
    proc_stat: Path = Path("/proc/stat")


def affinity_cpus() -> set[int]:
    """The CPUs this process may run on."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return set(range(os.cpu_count() or 1))


def _cgroup_paths(files: CpuFiles) -> tuple[str | None, str | None, str | None]:
    """(v2 path, v1 cpu controller's mount name, v1 path) of this process's cgroup."""
    v2 = v1_mount = v1_path = None
    try:
        lines = files.proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None, None, None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "":
            v2 = path
        elif "cpu" in controllers.split(","):
            v1_mount, v1_path = controllers, path
    return v2, v1_mount, v1_path


def _ancestors(base: Path, path: str) -> Iterable[Path]:
    """``base/path`` and every directory above it up to ``base`` (those that exist: inside a
    container the process's path is often not visible under the mount)."""
    rel = Path(path.lstrip("/")) if path else Path()
    while True:
        here = base / rel
        if here.is_dir():
            yield here
        if rel == Path() or str(rel) == ".":
            return
        rel = rel.parent


def _v2_quota(directory: Path) -> float | None:
    try:
        text = (directory / "cpu.max").read_text().split()
    except OSError:
        return None
    if not text or text[0] == "max":
        return None
    period = float(text[1]) if len(text) > 1 else 100_000.0
    return float(text[0]) / period if period > 0 else None


def _v1_quota(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text().strip())
        period = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:  # -1: no limit
        return None
    return quota / period


def cgroup_cpu_quota(files: CpuFiles = CpuFiles()) -> float | None:
    """The CPU quota (CPUs' worth of time per period) of this process's cgroup: the smallest of
    its own and its ancestors' (a parent's limit binds its children); None when unlimited."""
    v2, v1_mount, v1_path = _cgroup_paths(files)
    quotas: list[float] = []
    root = files.cgroup_root
    if v2 is not None:
        for directory in _ancestors(root, v2):
            q = _v2_quota(directory)
            if q is not None:
                quotas.append(q)
    if v1_mount is not None:
        for mount in (v1_mount, "cpu,cpuacct", "cpu"):
            base = root / mount
            if base.is_dir():
                for directory in _ancestors(base, v1_path or "/"):
                    q = _v1_quota(directory)
                    if q is not None:
                        quotas.append(q)
                break
    return min(quotas) if quotas else None


def allowed_cpus(files: CpuFiles = CpuFiles()) -> int:
    """The CPUs this process may use at most: min(affinity CPUs, cgroup quota), rounded down,
    at least 1 (module docstring)."""
    n = len(affinity_cpus())
    quota = cgroup_cpu_quota(files)
    if quota is not None:
        n = min(n, math.floor(quota + 1e-9))
    return max(1, n)


def read_busy(cpus: set[int], files: CpuFiles = CpuFiles()) -> float | None:
    """Seconds the kernel counts ``cpus`` as busy since boot (all processes); None if
    ``/proc/stat`` cannot be read."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        lines = files.proc_stat.read_text().splitlines()
    except OSError:
        return None
    busy = 0
    seen = False
    for line in lines:
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu") or name == "cpu":
            continue
        try:
            cpu = int(name[3:])
        except ValueError:
            continue
        if cpu not in cpus:
            continue
        columns = [int(v) for v in rest.split()]
        busy += sum(columns[i] for i in _BUSY_COLUMNS if i < len(columns))
        seen = True
    return busy / tick if seen else None


@dataclass
class CpuBudget:
    """The CPUs this process can use now: allowed, less what other processes take (module
    docstring). :meth:`usable` reads the kernel each time it is called; call it at most every
    second or so (a reading over a shorter window is mostly clock-tick noise).

    Not thread-safe: one owner (a :class:`~openbook.runtime.compute_threads.ComputeThreads`) calls
    it.
    """

    files: CpuFiles = field(default_factory=CpuFiles)
    clock: Callable[[], float] = time.monotonic
    own_cpu: Callable[[], float] = time.process_time
    # smoothed CPUs' worth of the affinity CPUs that other processes use
    others: float = 0.0
    _last: tuple[float, float, float] | None = None  # (wall, busy, own) at the last reading
    _size: int | None = None  # the last size given, for hysteresis

    def allowed(self) -> int:
        return allowed_cpus(self.files)

    def read_others(self) -> tuple[float, float] | None:
        """Take a reading: (CPUs' worth of the affinity CPUs others used since the last one,
        the seconds since it); None for the first reading, which only starts a window."""
        cpus = affinity_cpus()
        now, busy, own = self.clock(), read_busy(cpus, self.files), self.own_cpu()
        if busy is None:
            return None
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return None
        wall = now - last[0]
        if wall <= 0:
            return None
        used = max(0.0, (busy - last[1]) - (own - last[2])) / wall
        return min(used, float(len(cpus))), wall

    def usable(self) -> int:
        """The compute threads to run now: min(allowed, affinity CPUs − others' use), with
        hysteresis (module docstring), at least 1."""
        allowed = self.allowed()
        reading = self.read_others()
        if reading is not None:
            used, wall = reading
            self.others += (1.0 - math.exp(-wall / SMOOTHING_S)) * (used - self.others)
        free = len(affinity_cpus()) - self.others
        # a core others use more than LOSE_AT of is lost; one they use less than REGAIN_AT of
        # is regained (REGAIN_AT < LOSE_AT: between the two, the size stays)
        lose = max(1, min(allowed, math.floor(free + LOSE_AT)))
        regain = max(1, min(allowed, math.floor(free + REGAIN_AT)))
        current = self._size if self._size is not None else allowed
        if lose < current:
            size = lose
        elif regain > current:
            size = regain
        else:
            size = min(current, allowed)
        self._size = size
        return size
