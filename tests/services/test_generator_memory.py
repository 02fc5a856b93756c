"""The generator gives memory back (openbook/serving/allocator.py): glibc's freed pages return to
the system when it is asked, and the service asks when decoding goes idle and after large work."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from openbook.serving import allocator
from openbook.serving.allocator import MemoryReleaser
from openbook.v1 import common_pb2, generator_pb2
from openbook_testkit.rag import make_tiny_bart
from openbook_testkit.stack import generator_service

glibc = pytest.mark.skipif(allocator._glibc() is None, reason="glibc's allocator only")

# Allocates 256 MiB in 64 KiB blocks (below any mmap threshold: in the heap), frees all but
# every 16th (which pins the heap: nothing at its top to give back on its own), and prints the
# resident size before and after release(). A fresh process: pytest's own heap is not measured.
_FRAGMENTED_HEAP = textwrap.dedent(
    """
    import ctypes, threading
    from openbook.serving import allocator

    def rss():
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024

    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    block, count = 64 * 1024, 4096
    out = {}

    def work():  # a thread of its own, as the decoding thread: another arena than main's
        blocks = [libc.malloc(block) for _ in range(count)]
        for b in blocks:
            ctypes.memset(b, 1, block)
        for i, b in enumerate(blocks):
            if i % 16:
                libc.free(b)
        out["freed"] = rss()
        out["released"] = allocator.release()
        out["after"] = rss()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    print(out["freed"], out["after"], int(out["released"]))
    """
)


@glibc
def test_release_gives_the_freed_pages_of_a_fragmented_heap_back():
    out = subprocess.run(
        [sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, check=True
    )
    freed, after, released = (int(x) for x in out.stdout.split())
    assert released == 1
    # 240 MiB were freed between pinned blocks; most of it must leave (whole pages only)
    assert freed - after > 128 * 2**20, (freed, after)


@glibc
def test_configure_fixes_the_mmap_threshold_unless_the_environment_sets_it(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert allocator.configure()
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert not allocator.configure()


def test_the_releaser_releases_when_idle_or_after_enough_work_where_rss_is_unknown():
    calls: list[int] = []
    releaser = MemoryReleaser(
        slack_bytes=100, release_fn=lambda: calls.append(1), resident=lambda: None
    )
    releaser.finished(30, idle=False)
    releaser.finished(30, idle=False)
    assert calls == []  # busy, 60 < 100 bytes of work ended
    releaser.finished(50, idle=False)
    assert len(calls) == 1  # 110 >= 100: released although busy
    releaser.finished(10, idle=True)
    assert len(calls) == 2  # idle after some work
    releaser.finished(0, idle=True)
    assert len(calls) == 2  # nothing ended since: nothing to give back


def test_under_load_only_what_the_work_does_not_account_for_is_given_back():
    """A busy generator keeps the freed pages its next steps reuse: it releases when a request
    ends with more resident than the floor, the running requests' estimates and the slack, at
    most once per slack of work ended; each release measures the floor again."""
    calls: list[int] = []
    rss = {"now": 1_000}
    releaser = MemoryReleaser(
        slack_bytes=100, release_fn=lambda: calls.append(1), resident=lambda: rss["now"]
    )  # floor: 1,000

    def small_request() -> None:
        releaser.started(40)
        releaser.finished(40, idle=False)

    for _ in range(3):
        releaser.started(300)
    rss["now"] = 1_650  # the three requests' tensors
    for _ in range(6):  # each ending request's pages are reused by the next one
        releaser.finished(300, idle=False)
        releaser.started(300)
    assert calls == []  # 1,650 <= 1,000 + 600 running + 100, however much work ended
    rss["now"] = 2_100  # grown past it; a release does not shrink it (kernel caches, say)
    releaser.finished(300, idle=False)
    assert calls == [1]  # floor now 2,100 - 600 running = 1,500
    for _ in range(3):
        small_request()
    assert calls == [1]  # 2,100 <= 1,500 + 600 + 100: not released at every end for nothing
    releaser.finished(300, idle=False)
    assert calls == [1, 1]  # 2,100 > 1,500 + 300 + 100; floor 1,800
    rss["now"] = 3_000  # grown again
    small_request()
    small_request()
    assert calls == [1, 1]  # over, but 80 < 100 bytes of work ended since the last release
    small_request()
    assert calls == [1, 1, 1]
    releaser.finished(300, idle=True)  # the last one: idle, released at once (idle_after_s=0)
    assert calls == [1, 1, 1, 1]  # and the floor is what stays: 3,000
    rss["now"] = 3_090
    releaser.started(300)
    releaser.finished(300, idle=False)
    assert calls == [1, 1, 1, 1]  # 3,090 <= 3,000 + 0 running + 100


def test_the_threshold_follows_the_size_of_the_work_running():
    """Small requests keep the high threshold (their steps reuse arena pages); the first large
    one releases the arenas, then drops it; it rises again when the last large one ends."""
    events: list[object] = []
    releaser = MemoryReleaser(
        slack_bytes=10_000,
        release_fn=lambda: events.append("release"),
        large_bytes=100,
        set_threshold=events.append,
    )
    releaser.started(50)
    assert events == []  # small: nothing moves
    releaser.started(200)
    assert events == ["release", allocator.LARGE_WORK_THRESHOLD]
    releaser.started(300)  # a second large one: already low
    releaser.finished(200, idle=False)
    assert events == ["release", allocator.LARGE_WORK_THRESHOLD]  # one large still runs
    releaser.finished(300, idle=False)
    assert events[-1] == allocator.SMALL_WORK_THRESHOLD
    releaser.finished(50, idle=True)
    assert events[-1] == "release"  # idle: given back; the threshold stays high
    unmanaged = MemoryReleaser(slack_bytes=10, release_fn=lambda: None, large_bytes=1)
    unmanaged.started(5)
    unmanaged.finished(5, idle=True)  # the environment's threshold: never moved


def test_the_idle_release_waits_and_a_request_that_starts_meanwhile_drops_it():
    """Given back once the generator has stayed idle for ``idle_after_s``, on a thread of its
    own: a caller asking again at once finds no trim in its way and its pages still resident."""
    released = threading.Event()
    releaser = MemoryReleaser(
        slack_bytes=10_000, release_fn=released.set, resident=lambda: None, idle_after_s=0.3
    )
    try:
        releaser.finished(30, idle=True)
        releaser.started(30)  # the next request, before the release was due
        assert not released.wait(1.0)  # dropped: the generator did not stay idle
        assert releaser.releases == 0
        releaser.finished(30, idle=True)
        assert released.wait(30)  # this time it stays idle
        assert releaser.releases == 1
        released.clear()
        releaser.finished(0, idle=True)  # nothing ended since: nothing to give back
        assert not released.wait(1.0)
        # enough work under load (and the resident size unknown): at once, on this thread
        releaser.finished(20_000, idle=False)
        assert released.is_set() and releaser.releases == 2
    finally:
        releaser.close()
    assert releaser._waiter is not None and not releaser._waiter.is_alive()


@glibc
def test_the_service_moves_the_threshold_only_when_it_owns_it(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    assert MemoryReleaser.for_this_process(1)._set_threshold is allocator.set_mmap_threshold
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert MemoryReleaser.for_this_process(1)._set_threshold is None


def _request(k: int, **options) -> generator_pb2.GenerateRequest:
    passages = [
        common_pb2.Passage(id=str(i), title=f"t{i}", text=f"passage {i} about Paris", score=1)
        for i in range(k)
    ]
    return generator_pb2.GenerateRequest(
        question="where is paris?",
        passages=passages,
        options=generator_pb2.DecodingOptions(**options),
    )


def test_the_service_releases_memory_once_decoding_goes_idle(tmp_path, redis_server):
    """Through the service users run: every request that ends tells the releaser, which gives
    memory back when nothing runs or waits any more (after the last of a crowd)."""
    with generator_service(make_tiny_bart(tmp_path / "bart"), tmp_path, redis_server.url) as (
        _,
        servicer,
        stub,
    ):
        told: list[tuple[int, bool]] = []
        started: list[int] = []
        released = threading.Event()
        releaser = servicer.releaser
        original = releaser.finished
        releaser.started = started.append  # type: ignore[method-assign]

        def finished(estimate_bytes: int, idle: bool) -> None:
            told.append((estimate_bytes, idle))
            original(estimate_bytes, idle)

        releaser.finished = finished
        releaser._release = released.set
        requests = [_request(3, max_new_tokens=4), _request(5, num_beams=2, max_new_tokens=4)]
        threads = [threading.Thread(target=stub.Generate, args=(r,)) for r in requests * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        deadline = time.monotonic() + 30
        while len(told) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.01)  # told from the decoding thread, just after each reply
        assert len(told) == len(threads)
        assert sorted(started) == sorted(estimate for estimate, _ in told)  # each started once
        assert all(estimate > 0 for estimate, _ in told)
        assert told[-1][1]  # the last one left the generator idle
        assert released.wait(30)  # once it has stayed idle for IDLE_RELEASE_AFTER_S
        assert releaser.releases >= 1
