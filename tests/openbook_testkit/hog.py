"""A competing CPU load: processes that keep cores busy, as a neighbour on a shared node does.

``CpuHog(1)`` starts one process spinning (``while True: pass``) pinned to the last CPU this
process may use, so that on a 2-core machine one core is taken, as in the issue that found the
compute threads collapsing under exactly this. Used by ``bench/load --real --hog`` and the
default-stack fault tests (``OPENBOOK_TEST_CPU_HOG``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

_SPIN = "while True:\n    pass\n"


class CpuHog:
    def __init__(self, processes: int = 1) -> None:
        self.processes = processes
        self._procs: list[subprocess.Popen] = []

    def cpus(self) -> list[int]:
        """The CPUs the hog takes: the last ``processes`` of this process's affinity."""
        allowed = sorted(os.sched_getaffinity(0))
        return allowed[-self.processes :] if self.processes else []

    def __enter__(self) -> CpuHog:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for cpu in self.cpus():
            proc = subprocess.Popen([sys.executable, "-c", _SPIN], start_new_session=True)
            os.sched_setaffinity(proc.pid, {cpu})
            self._procs.append(proc)

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self._procs.clear()
