"""The CPU a process gets (openbook/runtime/cpu_budget.py) and the compute threads sized to it
(openbook/runtime/compute_threads.py): cgroup v1/v2 quotas and the affinity mask from fake and real
kernel files, contention from /proc/stat, the setting that overrides, and the size set on the
thread that computes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from openbook.runtime.compute_threads import ComputeThreads, ComputeThreadsOptions, explicit_setting
from openbook.runtime.cpu_budget import (
    REGAIN_AT,
    CpuBudget,
    CpuFiles,
    allowed_cpus,
    cgroup_cpu_quota,
)
from openbook_testkit.hog import CpuHog

TWO_CPUS = len(os.sched_getaffinity(0)) >= 2


def _files(tmp_path: Path, cgroup: str) -> CpuFiles:
    (tmp_path / "proc").mkdir(exist_ok=True)
    (tmp_path / "proc" / "cgroup").write_text(cgroup)
    return CpuFiles(
        cgroup_root=tmp_path / "cg",
        proc_self_cgroup=tmp_path / "proc" / "cgroup",
        proc_stat=tmp_path / "proc" / "stat",
    )


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_of_the_process_cgroup(tmp_path):
    files = _files(tmp_path, "0::/kubepods/pod1/c1\n")
    _write(tmp_path / "cg/kubepods/pod1/c1/cpu.max", "150000 100000\n")
    assert cgroup_cpu_quota(files) == pytest.approx(1.5)
    # 1.5 CPUs of quota: one compute thread (a second would wait out half of each period)
    assert allowed_cpus(files) == 1


def test_cgroup_v2_unlimited_and_a_parent_s_limit_binds(tmp_path):
    files = _files(tmp_path, "0::/kubepods/pod1/c1\n")
    _write(tmp_path / "cg/kubepods/pod1/c1/cpu.max", "max 100000\n")
    assert cgroup_cpu_quota(files) is None
    _write(tmp_path / "cg/kubepods/pod1/cpu.max", "100000 100000\n")  # the pod's limit
    assert cgroup_cpu_quota(files) == pytest.approx(1.0)
    assert allowed_cpus(files) == 1


def test_cgroup_v2_inside_a_container_reads_the_mount_root(tmp_path):
    # a cgroup namespace: the process's path is "/" and its limit is at the mount's root
    files = _files(tmp_path, "0::/\n")
    _write(tmp_path / "cg/cpu.max", "50000 100000\n")
    assert cgroup_cpu_quota(files) == pytest.approx(0.5)
    assert allowed_cpus(files) == 1  # never below one


def test_cgroup_v1_cfs_quota(tmp_path):
    files = _files(tmp_path, "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "300000\n")
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_quota(files) == pytest.approx(3.0)
    assert allowed_cpus(files) == min(3, len(os.sched_getaffinity(0)))
    _write(tmp_path / "cg/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")
    assert cgroup_cpu_quota(files) is None
    assert allowed_cpus(files) == len(os.sched_getaffinity(0))


def test_no_cgroup_files_means_no_quota(tmp_path):
    files = _files(tmp_path, "garbage\n")
    assert cgroup_cpu_quota(files) is None
    assert allowed_cpus(files) == len(os.sched_getaffinity(0))


def _stat(busy: dict[int, int]) -> str:
    lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
    for cpu, ticks in busy.items():
        # user nice system idle iowait irq softirq steal guest guest_nice
        lines.append(f"cpu{cpu} {ticks} 0 0 1000 0 0 0 0 0 0")
    return "\n".join(lines) + "\n"


class _FakeMachine:
    """/proc/stat and this process's CPU time, advanced by hand."""

    def __init__(self, tmp_path: Path) -> None:
        self.files = _files(tmp_path, "0::/\n")
        self.cpus = sorted(os.sched_getaffinity(0))
        self.busy = dict.fromkeys(self.cpus, 0)
        self.now = 0.0
        self.own = 0.0
        self.tick = os.sysconf("SC_CLK_TCK")
        self._write()

    def _write(self) -> None:
        _write(self.files.proc_stat, _stat(self.busy))

    def run(self, seconds: float, own_cpus: float, others_cpus: float) -> None:
        """``seconds`` pass with this process using ``own_cpus`` and others ``others_cpus``."""
        total = (own_cpus + others_cpus) * seconds * self.tick
        for cpu in self.cpus:
            self.busy[cpu] += round(total / len(self.cpus))
        self.own += own_cpus * seconds
        self.now += seconds
        self._write()

    def budget(self) -> CpuBudget:
        return CpuBudget(files=self.files, clock=lambda: self.now, own_cpu=lambda: self.own)


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_contention_takes_a_core_away_and_gives_it_back_with_hysteresis(tmp_path):
    machine = _FakeMachine(tmp_path)
    budget = machine.budget()
    n = len(machine.cpus)
    assert budget.usable() == n  # the first reading only starts a window
    machine.run(1.0, own_cpus=n, others_cpus=0.0)
    assert budget.usable() == n  # the process's own use is not contention
    # a neighbour spinning on one core: while the team is full size it gets about half of it
    for _ in range(3):
        machine.run(1.0, own_cpus=n - 0.5, others_cpus=0.5)
        budget.usable()
    assert budget.usable() == n - 1
    # others near the line (between REGAIN_AT and LOSE_AT of a core): the size stays
    for _ in range(6):
        machine.run(1.0, own_cpus=n - 1, others_cpus=0.2)
        assert budget.usable() == n - 1
    # the neighbour stopped: the core comes back
    for _ in range(6):
        machine.run(1.0, own_cpus=n - 1, others_cpus=0.0)
        budget.usable()
    assert budget.usable() == n


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_a_long_window_counts_at_once(tmp_path):
    """A piece of work that took seconds because a neighbour stalled the team is the reading
    that matters most: it weighs fully, not as one more second."""
    machine = _FakeMachine(tmp_path)
    budget = machine.budget()
    n = len(machine.cpus)
    budget.usable()
    machine.run(60.0, own_cpus=0.0, others_cpus=0.05)  # idle for a minute
    assert budget.usable() == n
    machine.run(6.0, own_cpus=n - 0.5, others_cpus=0.5)  # one long stalled step
    assert budget.usable() == n - 1
    assert budget.others == pytest.approx(0.5, abs=0.05)


def test_explicit_setting_then_omp_num_threads_then_automatic(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert explicit_setting(2) == (2, "OPENBOOK_COMPUTE_THREADS")
    assert explicit_setting(0) == (3, "OMP_NUM_THREADS")
    monkeypatch.setenv("OMP_NUM_THREADS", "")
    assert explicit_setting(0) is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert explicit_setting(0) is None


def test_the_setting_wins_over_the_budget_and_is_never_resized(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    applied: list[int] = []
    threads = ComputeThreads(
        ComputeThreadsOptions(setting=3, interval_s=0.0),
        budget=_FakeMachine(tmp_path).budget(),
        set_threads=applied.append,
    )
    assert not threads.automatic
    assert threads.apply() == 3
    assert threads.maybe_resize() == 3
    assert applied == [3] and threads.source == "OPENBOOK_COMPUTE_THREADS"


def test_torchrun_processes_share_the_budget(monkeypatch, tmp_path):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    threads = ComputeThreads(
        ComputeThreadsOptions(share=64), budget=_FakeMachine(tmp_path).budget(), set_threads=print
    )
    assert threads.apply() == 1


def test_the_size_is_set_on_the_thread_that_computes(monkeypatch):
    """torch's OpenMP size is per thread: a thread that has computed keeps its team unless the
    call is made on it, which is why services call apply/maybe_resize on their compute
    thread."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if not TWO_CPUS:
        pytest.skip("needs two CPUs")
    seen: dict[str, int] = {}
    threads = ComputeThreads(ComputeThreadsOptions(setting=1))
    go = threading.Event()

    def compute_thread() -> None:
        torch.set_num_threads(2)
        torch.ones(64, 64) @ torch.ones(64, 64)  # this thread has its own team now
        seen["before"] = torch.get_num_threads()
        go.wait(10)
        threads.apply()
        seen["after"] = torch.get_num_threads()

    worker = threading.Thread(target=compute_thread)
    worker.start()
    go.set()
    worker.join(10)
    assert seen == {"before": 2, "after": 1}


_ONE_CPU = textwrap.dedent(
    """
    import os, sys
    os.environ.pop("OMP_NUM_THREADS", None)
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    import torch
    from openbook.runtime.compute_threads import ComputeThreads
    threads = ComputeThreads()
    threads.apply()
    print(threads.size, torch.get_num_threads())
    """
)


@pytest.mark.skipif(not TWO_CPUS, reason="needs two CPUs")
def test_a_process_pinned_to_one_cpu_sizes_to_one():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(
        [sys.executable, "-c", _ONE_CPU], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["1", "1"]


def _wait_for(threads: ComputeThreads, size: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if threads.maybe_resize() == size:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="needs exactly two CPUs")
def test_a_cpu_hog_takes_a_thread_away_and_gives_it_back(monkeypatch):
    """A real neighbour spinning on one of two cores: the automatic size drops to one within a
    few seconds, and comes back once it stops."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    applied: list[int] = []
    threads = ComputeThreads(ComputeThreadsOptions(interval_s=0.5), set_threads=applied.append)
    threads.apply()
    if not _wait_for(threads, 2, 10.0):
        pytest.skip(f"the machine is busy already (others use {threads.budget.others:.1f} CPUs)")
    with CpuHog(1):
        assert _wait_for(threads, 1, 10.0), f"others: {threads.budget.others:.2f}"
    # Other work on a shared machine may keep using the core after the hog stops: the core is
    # given back once the others' use falls below REGAIN_AT of it, as it must then.
    if not _wait_for(threads, 2, 30.0):
        assert threads.budget.others > REGAIN_AT
        pytest.skip(f"the machine stayed busy (others use {threads.budget.others:.2f} CPUs)")
    assert applied[0] == 2 and 1 in applied and applied[-1] == 2
